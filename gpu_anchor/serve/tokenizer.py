"""Text <-> token ids for the frontend (torch-free).

A model directory's ``tokenizer.json`` (Hugging Face ``tokenizers``) is used when present;
otherwise a byte-level fallback maps each UTF-8 byte to the id of the same value (needs a
vocabulary of at least 256).  Chat prompts use ``chat_template`` from
``tokenizer_config.json`` (Jinja) when present, else a ChatML-style text template.
"""
from __future__ import annotations

import json
import os


class Codec:
    def __init__(self, model_dir: str | None, vocab_size: int) -> None:
        self.tok = None
        self.template = None
        self.special: dict = {}
        path = os.path.join(model_dir, "tokenizer.json") if model_dir and os.path.isdir(model_dir) else None
        if path and os.path.exists(path):
            from tokenizers import Tokenizer
            self.tok = Tokenizer.from_file(path)
            self.kind = "tokenizer.json"
        else:
            if vocab_size < 256:
                raise ValueError(f"no tokenizer.json and vocab_size {vocab_size} < 256: byte fallback impossible")
            self.kind = "bytes"
        cfg = os.path.join(model_dir, "tokenizer_config.json") if model_dir and os.path.isdir(model_dir) else None
        if cfg and os.path.exists(cfg):
            with open(cfg) as f:
                tc = json.load(f)
            self.template = tc.get("chat_template")
            self.special = {k: tc[k] for k in ("bos_token", "eos_token") if isinstance(tc.get(k), str)}

    def encode(self, text: str) -> list[int]:
        if self.tok is not None:
            return self.tok.encode(text, add_special_tokens=False).ids
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        if self.tok is not None:
            return self.tok.decode(ids, skip_special_tokens=True)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def chat(self, messages: list[dict]) -> str:
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError("each message needs a role and content")
            if not isinstance(m.get("content", ""), str):
                m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
        if self.template:
            import jinja2
            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
            return env.from_string(self.template).render(messages=messages, add_generation_prompt=True,
                                                         **self.special)
        text = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
        return text + "<|im_start|>assistant\n"
