"""A Hugging Face Llama built inside ``managed_scope``: bit-identical to a build without
gpu-anchor, and after a SIGKILL the restarted worker binds 100 % matched, replays nothing,
and gives the same logits and the same random-number stream afterwards.

    PYTHONPATH=. python examples/scope_llama_restart.py --device cpu
    PYTHONPATH=. python examples/scope_llama_restart.py --device cuda:0 --layers 4 --hidden 256

Workers are forked from this process, which imports torch and transformers but never
touches CUDA (so CUDA works in the children).  Prints one JSON object; exit status 0 when
every check holds.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # workers are forked: never init CUDA here
import torch  # noqa: E402


def _config(a):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                       num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128)


def _worker(a, namespace, q):
    from transformers import LlamaForCausalLM
    try:
        if a.device == "cpu":
            torch.set_num_threads(1)
        torch.manual_seed(0)
        report = None
        if namespace is None:
            with torch.device(a.device):
                model = LlamaForCausalLM(_config(a))
        else:
            from gpu_anchor.scope import managed_scope
            with managed_scope(namespace) as scope:
                with torch.device(a.device):
                    model = LlamaForCausalLM(_config(a))
            r = scope.report
            report = {"matched": len(r.matched), "created": len(r.created), "native": len(r.native),
                      "rng": r.rng, "replayed_ops": r.replayed_ops, "timings_ms": r.timings_ms}
            del scope
        after_cpu = torch.rand(4)
        after_dev = torch.rand(4, device=a.device).cpu()
        ids = torch.arange(1, 9, device=a.device)[None] % a.vocab
        with torch.no_grad():
            logits = model(ids).logits.float().cpu()
        q.put({"logits": logits.numpy(), "after_cpu": after_cpu.numpy(), "after_dev": after_dev.numpy(),
               "report": report})
    except Exception as e:
        q.put({"error": f"{type(e).__name__}: {e}"})
    if namespace is not None:
        signal.pause()  # the harness SIGKILLs us: the anchored state stays


def _run(ctx, a, namespace):
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(a, namespace, q))
    p.start()
    out = q.get(timeout=600)
    if namespace is not None:
        os.kill(p.pid, signal.SIGKILL)
    p.join(60)
    if "error" in out:
        raise RuntimeError(out["error"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    a = ap.parse_args(argv)
    from transformers import LlamaForCausalLM  # noqa: F401 — imported once, inherited by the workers
    from gpu_anchor.client import control
    if "GPU_ANCHOR_SOCKET_DIR" not in os.environ:
        os.environ["GPU_ANCHOR_SOCKET_DIR"] = tempfile.mkdtemp(prefix="ga-llama-")
    sock = os.path.join(os.environ["GPU_ANCHOR_SOCKET_DIR"], a.device.replace(":", "") + ".sock")
    started = control.start(a.device, sock)
    ctx = mp.get_context("fork")
    try:
        native = _run(ctx, a, None)
        first = _run(ctx, a, "llama-restart")
        second = _run(ctx, a, "llama-restart")
    finally:
        control.stop(a.device, sock)
        started.wait(30)

    def same(x, y, k):
        return bool((x[k] == y[k]).all()) and x[k].shape == y[k].shape

    r1, r2 = first["report"], second["report"]
    checks = {
        "create_logits_bit_identical": same(first, native, "logits"),
        "create_rng_after_identical": same(first, native, "after_cpu") and same(first, native, "after_dev"),
        "restart_all_matched": r2["created"] == 0 and r2["matched"] == r1["created"] and r1["native"] == 0,
        "restart_replayed_nothing": r2["replayed_ops"] == 0,
        "restart_logits_bit_identical": same(second, native, "logits"),
        "restart_rng_after_identical": same(second, native, "after_cpu") and same(second, native, "after_dev"),
    }
    print(json.dumps({"device": a.device, "checks": checks, "create": r1, "restart": r2}, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
