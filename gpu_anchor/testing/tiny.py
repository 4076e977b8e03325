"""Tiny random-weight models and a local tokenizer, for tests, examples and CPU smoke runs.

No hub access is assumed: ``make_tiny_model`` builds a Llama / Qwen2 / Qwen3 config,
seeds random weights, saves config + safetensors with ``save_pretrained``, and trains a
small byte-level BPE tokenizer (``tokenizers``) on a built-in text so the HTTP frontend
has a real ``tokenizer.json`` to use.
"""
from __future__ import annotations

import json
import os

TEXT = ("The quick brown fox jumps over the lazy dog. A paged KV cache keeps keys and values in "
        "fixed-size blocks; a block table maps each sequence to its blocks. When the engine dies, "
        "the daemon keeps the memory and the journal keeps the metadata, so a new engine resumes "
        "every request from its last committed step. Hello world! How are you today? I am fine, "
        "thank you. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. ") * 8

FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16),
    # Mistral 7B v0.2 / v0.3 and Mistral Small: Llama's layers, no sliding window, an explicit head_dim
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None, head_dim=16),
}


def tiny_config(family: str = "llama", vocab_size: int = 384, hidden: int = 64, layers: int = 2,
                heads: int = 4, kv_heads: int = 2, intermediate: int = 128, **kw) -> dict:
    d = dict(FAMILIES[family], vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
             num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate,
             max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    d.update(kw)
    return d


def train_tokenizer(vocab_size: int, path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.save(path)


def make_tiny_model(path: str, family: str = "llama", seed: int = 0, dtype: str = "float32", **kw) -> str:
    """Write a random-weight model directory (config, safetensors, tokenizer.json)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg_d = tiny_config(family, **kw)
    cfg = AutoConfig.for_model(**cfg_d)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    with torch.no_grad():   # HF's default init is too flat to make interesting greedy text
        for n, p in sorted(model.named_parameters()):
            if not n.endswith("norm.weight"):
                p.normal_(0.0, cfg_d["initializer_range"])
    model.save_pretrained(path)
    train_tokenizer(cfg_d["vocab_size"], os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    return path
