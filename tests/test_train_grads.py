"""Backward's gradients are copied into their anchored buffers by a post-accumulate hook
(``gpu_anchor.train.grads``); whatever the user's code does with ``p.grad`` after ``backward()``
returns must act on the anchored buffers and give plain PyTorch's results.

    PYTHONPATH=. python -m pytest -q tests/test_train_grads.py          # the CUDA case: -m gpu

A transformers Llama with tied embeddings (one gradient made from two uses), three
micro-batches a step (the later ones accumulate into the anchored buffers), and
``clip_grad_norm_`` between backward and step (reads every gradient, scales them in place):
the anchored run must equal plain PyTorch bit for bit — losses, norms, weights, Adam states.
The CPU case (a smaller model) runs everywhere, the CUDA one on a GPU.
"""
import pytest
import torch

# device -> (daemon fixture, vocab, hidden, layers, tokens a micro-batch)
CASES = {"cpu": ("host_daemon", 1000, 64, 2, (2, 32)), "cuda": ("cuda_daemon", 32000, 512, 4, (4, 256))}


def llama(seed, vocab, hidden, layers, device, attn="sdpa"):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                   tie_word_embeddings=True, attn_implementation=attn)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(device, torch.bfloat16)


def checkpointing(model, reentrant: bool) -> None:
    """transformers' activation checkpointing on, as a Trainer user turns it on, in train mode."""
    if hasattr(model, "activation_checkpointing_enable"):      # transformers >= 5.2x; the older name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()


def train_side_by_side(ref, ropt, model, opt, vocab, shape, device, steps=4, micro=3):
    """``steps`` steps of ``micro`` micro-batches + ``clip_grad_norm_`` on both twins; asserts the
    losses and norms are equal bit for bit at every step."""
    gen = torch.Generator(device=device).manual_seed(1)
    for step in range(steps):
        batches = [torch.randint(0, vocab, shape, device=device, generator=gen) for _ in range(micro)]
        seen = []
        for m, o in ((ref, ropt), (model, opt)):
            losses = []
            for ids in batches:
                loss = m(input_ids=ids, labels=ids).loss / len(batches)
                loss.backward()
                losses.append(loss.detach())
            seen.append((torch.stack(losses), torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)))
            o.step()
            o.zero_grad()
        (lr, nr), (la, na) = seen
        assert torch.equal(lr, la) and torch.equal(nr, na), (step, nr.item(), na.item())


def same_state(ref, ropt, model, opt):
    """Weights and Adam moments of the twins equal bit for bit."""
    opt.flush()
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a, b), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ropt.state[a][k], opt.optimizer.state[b][k]), (n, k)


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_user_reads_and_scales_gradients_after_backward_bit_for_bit(request, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fixture, vocab, hidden, layers, shape = CASES[device]
    request.getfixturevalue(fixture)
    import gpu_anchor
    from gpu_anchor.train import AnchoredOptimizer, anchor_module
    client = gpu_anchor.connect("cuda:0" if device == "cuda" else "cpu", namespace="grads-side-stream")
    ref, model = (llama(0, vocab, hidden, layers, device) for _ in range(2))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    anchor_module(model, client)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = AnchoredOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, client=client)
    train_side_by_side(ref, ropt, model, opt, vocab, shape, device)
    same_state(ref, ropt, model, opt)
    client.drop_namespace()
