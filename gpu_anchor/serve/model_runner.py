"""A compact Llama / Qwen2 / Qwen3 forward over the paged KV cache.

The Hugging Face module is built on the ``meta`` device only to learn parameter names
and shapes (and its rotary embedding class); the weights themselves are anchored
tensors, loaded from safetensors or seeded-random only when the daemon "created" them.
The forward mirrors the HF modules op for op (RMSNorm in float32, rotary from HF's own
module, optional q/k/v biases, Qwen3's q_norm/k_norm), but attention reads the paged
cache through :mod:`.attention`.  With ``deterministic=True`` every matmul, norm and the
attention go through :mod:`.batch_invariant` instead, so a token's result does not depend
on the batch it runs in (``gpu-anchor serve --deterministic``).  Otherwise, on the GPU, the
norms, rotary, K/V store, residual adds and ``silu · up`` run as the fused kernels of
:mod:`.fused` (same rounding points; ~13 launches a layer instead of ~58).
"""
from __future__ import annotations

import glob
import hashlib
import json
import math
import os

import torch
import torch.nn.functional as F

from . import batch_invariant, fused
from .attention import AttnMeta, attend, write_kv

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


def eos_token_ids(mc, path: str) -> list[int]:
    """The ids that end a reply: the config's ``eos_token_id`` and those of the model
    directory's ``generation_config.json`` (Qwen3 lists ``<|endoftext|>`` there beside the
    config's ``<|im_end|>``; vLLM stops at both)."""
    out = []
    gen = os.path.join(path, "generation_config.json") if os.path.isdir(path) else None
    extra = None
    if gen and os.path.exists(gen):
        with open(gen) as f:
            extra = json.load(f).get("eos_token_id")
    for v in (mc.eos_token_id, extra):
        for t in ([] if v is None else [v] if isinstance(v, int) else v):
            if t not in out:
                out.append(int(t))
    return out


def load_config(path: str):
    """A transformers config from a model directory or a ``config.json`` file."""
    from transformers import AutoConfig
    if os.path.isdir(path):
        cfg = AutoConfig.from_pretrained(path)
    elif os.path.isfile(path):
        with open(path) as f:
            d = json.load(f)
        cfg = AutoConfig.for_model(**d)
    else:
        raise FileNotFoundError(f"no model directory or config file at {path}")
    if cfg.model_type not in SUPPORTED:
        raise ValueError(f"model_type {cfg.model_type!r} is not supported (supported: {', '.join(SUPPORTED)})")
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported")
    return cfg


def check_window(cfg, max_model_len: int) -> None:
    """Mistral's sliding window (v0.1: 4 096 tokens) is not built: the engine attends to the whole
    context, which is the same computation while the context fits in the window."""
    w = getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None
    if w is not None and max_model_len > w:
        raise ValueError(f"the model attends within a sliding window of {w} tokens, which this engine does not "
                         f"build; serve it with --max-model-len {w} or less (full attention is the same there)")


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


_META: dict[str, object] = {}


def meta_model(cfg):
    """The HF module on the meta device (names, shapes, classes; no memory).  Cached: the
    supervisor builds it once before forking engines, so they inherit the imports."""
    key = cfg.to_json_string()
    if key not in _META:
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):
            _META[key] = AutoModelForCausalLM.from_config(cfg)
    return _META[key]


def param_specs(cfg, dtype: torch.dtype) -> list[tuple[str, tuple, torch.dtype]]:
    m = meta_model(cfg)
    return [(n, tuple(p.shape), dtype) for n, p in m.named_parameters()]


def weights_fingerprint(source: str, cfg, dtype: torch.dtype, seed: int | None, part: str = "") -> str:
    """Identifies what the anchored weights must contain: checkpoint files or (config, seed),
    and which part of them (``part``: a tensor-parallel rank's shard, "" for all)."""
    h = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode())
    h.update(str(dtype).encode() + f"seed={seed}".encode() + part.encode())
    if seed is not None:
        h.update(f"drawn in rows of at most {DRAW_ELEMENTS}".encode())
    for f in sorted(glob.glob(os.path.join(source, "*.safetensors"))) if os.path.isdir(source) else ():
        st = os.stat(f)
        h.update(f"{os.path.basename(f)}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


@torch.no_grad()
def load_weights(model_dir: str, tensors: dict[str, torch.Tensor], progress=None, part=None) -> None:
    """Copy safetensors checkpoint values into the (anchored) tensors; ``progress(bytes_done)``
    after each tensor, if given.  ``part(name, full_shape)``: the index of this process's
    shard of a tensor (``None``: all of it); only that slice is read from the file."""
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    seen = set()
    done = 0
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                if name in tensors:
                    t = tensors[name]
                    if part is None:
                        t.copy_(sf.get_tensor(name))
                    else:
                        sl = sf.get_slice(name)
                        ix = part(name, tuple(sl.get_shape()))
                        t.copy_(sf.get_tensor(name) if ix is None else sl[ix])
                    seen.add(name)
                    done += t.numel() * t.element_size()
                    if progress is not None:
                        progress(done)
    missing = set(tensors) - seen
    if missing:
        raise ValueError(f"{model_dir} lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")


# float32 values drawn at a time by ``init_random`` (256 MB): drawn whole, the 8B embedding's
# draw alone was 2.5 GB, most of a serving pre-warm's peak memory.  The values depend on it,
# so the weights' fingerprint names it.
DRAW_ELEMENTS = 1 << 26


@torch.no_grad()
def init_random(tensors: dict[str, torch.Tensor], cfg, seed: int, progress=None, full_shapes=None, part=None) -> None:
    """Seeded random weights (normal(0, initializer_range); norms 1, biases 0);
    ``progress(bytes_done)`` after each tensor, if given.  Each tensor is drawn in blocks of
    whole rows (``DRAW_ELEMENTS`` at most), one generator per tensor.  A tensor-parallel shard
    draws the full tensor's blocks (``full_shapes[name]``) and keeps its part of each
    (``part(name, shape)``), so every parallel size gets the same weights."""
    std = getattr(cfg, "initializer_range", 0.02)
    done = 0
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            g = torch.Generator(device=t.device).manual_seed(seed * 100003 + i)
            shape = tuple(full_shapes[name] if full_shapes is not None else t.shape)
            ix = part(name, shape) if part is not None else None
            rows, row = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
            block = max(1, DRAW_ELEMENTS // max(1, row))
            for r0 in range(0, rows, block):
                r1 = min(rows, r0 + block)
                x = torch.randn((r1 - r0, *shape[1:]), generator=g, device=t.device, dtype=torch.float32).mul_(std)
                if ix is None:
                    t.view(rows, *shape[1:])[r0:r1].copy_(x)
                    continue
                lo, hi, _ = ix[0].indices(rows)       # this part's rows of the full tensor
                a, b = max(lo, r0), min(hi, r1)
                if a < b:
                    t[a - lo:b - lo].copy_(x[(slice(a - r0, b - r0), *ix[1:])])
        done += t.numel() * t.element_size()
        if progress is not None:
            progress(done)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dt)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Model:
    """The forward in three pieces, so that ``cuda_graphs.py`` can capture the layers of a
    decode step while the lm_head (and sampling) stay eager:
    ``embed`` → ``layers(lo, hi)`` → ``head``.  ``forward`` chains them (the eager path)."""

    def __init__(self, cfg, weights: dict[str, torch.Tensor], kv_caches: list[torch.Tensor], device,
                 max_positions: int | None = None, tp=None, deterministic: bool = False, packed=None) -> None:
        """``tp``: this rank's tensor-parallel group (``tp.Group``), whose shards ``weights``
        and ``kv_caches`` are (``shards.py``); ``None``: the whole model.  ``deterministic``:
        batch-invariant kernels (``batch_invariant.py``) for every matmul, norm and attention.
        ``packed``: ``packing.py``'s tensors (``qkv_proj``, ``gate_up_proj``) of which the
        members in ``weights`` are views; the fused path multiplies by them."""
        from transformers.activations import ACT2FN
        self.cfg = cfg
        self.w = weights
        self.kv = kv_caches
        self.tp = tp
        n = tp.size if tp is not None else 1
        self.L = cfg.num_hidden_layers
        self.hq, self.hkv, self.d = cfg.num_attention_heads // n, cfg.num_key_value_heads // n, head_dim(cfg)
        self.eps = cfg.rms_norm_eps
        self.scale = self.d ** -0.5
        self.act = ACT2FN[cfg.hidden_act]
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        self.packed = packed or {}
        rot_cls = type(meta_model(cfg).model.rotary_emb)
        try:   # the constructor's signature differs across transformers versions
            self.rotary = rot_cls(config=cfg, device=device)
        except TypeError:
            self.rotary = rot_cls(config=cfg)
        self.rotary.to(device)
        # cos/sin of every position, computed once by HF's own module: a lookup is a single
        # capturable gather, and the values equal a per-step call's (elementwise maths)
        self._rope = None
        self._max_positions = max(max_positions or 0, cfg.max_position_embeddings)
        self.device = torch.device(device)
        self.deterministic = deterministic
        if deterministic:
            why = batch_invariant.supported(self.device, weights["model.embed_tokens.weight"].dtype)
            if why:
                raise ValueError(why)
            self._linear, self._norm, self._attend = batch_invariant.linear, batch_invariant.rms_norm, \
                batch_invariant.attend
        else:
            self._linear, self._norm, self._attend = F.linear, _rms, attend
        # the fused kernels: the default mode on the GPU (the batch-invariant mode keeps its own
        # linear and attention; its norm is the same row kernel)
        self.fused = (not deterministic and cfg.hidden_act == "silu"
                      and fused.available(self.device, weights["model.embed_tokens.weight"].dtype, self.d))
        if self.fused:
            self._norm = lambda x, w, eps: fused.add_rms_norm(x, w, eps)[1]

    @torch.no_grad()
    def _rope_table(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].dtype != dtype:
            pos = torch.arange(self._max_positions, device=self.device)[None]
            cos, sin = self.rotary(torch.empty(1, device=self.device, dtype=dtype), pos)
            self._rope = (cos[0].contiguous(), sin[0].contiguous())
        return self._rope

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """Returns ``(h, cos, sin)``: the token embeddings and the rotary factors [T, 1, D]
        (with the fused kernels: the whole tables [positions, D], read at ``meta.positions``)."""
        emb = self.w["model.embed_tokens.weight"]
        if self.tp is None:
            h = F.embedding(input_ids, emb)
        else:   # vocabulary-parallel: rows of other ranks' tokens are zeros here, and the sum is exact
            lo, hi = self.tp.vocab
            outside = (input_ids < lo) | (input_ids >= hi)
            h = F.embedding((input_ids - lo).masked_fill(outside, 0), emb).masked_fill(outside[:, None], 0.0)
            self.tp.all_reduce(h)
        cos_t, sin_t = self._rope_table(h.dtype)
        if self.fused:
            return h, cos_t, sin_t
        return h, cos_t[positions][:, None, :], sin_t[positions][:, None, :]

    @torch.no_grad()
    def layers(self, h: torch.Tensor, cos, sin, meta: AttnMeta, lo: int, hi: int) -> torch.Tensor:
        """Decoder layers ``lo..hi-1``; writes their K/V into the cache."""
        if self.fused:
            return self._layers_fused(h, cos, sin, meta, lo, hi)
        w, T = self.w, h.shape[0]
        lora, masks = self._lora(meta, h.dtype)
        for i in range(lo, hi):
            p = f"model.layers.{i}."
            x = self._norm(h, w[p + "input_layernorm.weight"], self.eps)
            a = p + "self_attn."
            q, k, v = (self._linear(x, w[a + n + ".weight"], w.get(a + n + ".bias")) for n in ("q_proj", "k_proj", "v_proj"))
            lora([q, k, v], x, i, "qkv", masks)
            q, k, v = q.view(T, self.hq, self.d), k.view(T, self.hkv, self.d), v.view(T, self.hkv, self.d)
            if a + "q_norm.weight" in w:
                q = self._norm(q, w[a + "q_norm.weight"], self.eps)
                k = self._norm(k, w[a + "k_norm.weight"], self.eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            write_kv(self.kv[i], k, v, meta.slots)
            o = self._attend(q, self.kv[i], meta, self.scale).reshape(T, self.hq * self.d)
            o_out = self._row(o, w[a + "o_proj.weight"], w.get(a + "o_proj.bias"),
                              lambda y: lora([y], o, i, "o", masks))
            h = h + o_out
            x = self._norm(h, w[p + "post_attention_layernorm.weight"], self.eps)
            m = p + "mlp."
            gate, up = self._linear(x, w[m + "gate_proj.weight"]), self._linear(x, w[m + "up_proj.weight"])
            lora([gate, up], x, i, "gate_up", masks)
            y = self.act(gate) * up
            h = h + self._row(y, w[m + "down_proj.weight"], None, lambda d: lora([d], y, i, "down", masks))
        return h

    def _lora(self, meta: AttnMeta, dtype):
        """``(add, masks)``: the adapters' ``add`` (``lora_slots.py``) and this step's token masks, or
        nothing to add when no adapter is served or no token of the step has one."""
        if self.lora is None or meta.lora is None:
            return (lambda outs, x, layer, group, masks: None), None
        return self.lora.add, self.lora.masks(meta.lora, dtype)

    def _layers_fused(self, h: torch.Tensor, cos, sin, meta: AttnMeta, lo: int, hi: int) -> torch.Tensor:
        """``layers`` with :mod:`.fused`'s kernels: each residual add is fused with the norm
        that follows it (the last layer's with nothing: a plain add)."""
        w, T = self.w, h.shape[0]
        lora, masks = self._lora(meta, h.dtype)
        x = fused.add_rms_norm(h, w[f"model.layers.{lo}.input_layernorm.weight"], self.eps)[1]
        for i in range(lo, hi):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            q, k, v = self._qkv(x, a, T)
            if masks is not None:
                lora([t.view(T, -1) for t in (q, k, v)], x, i, "qkv", masks)
            fused.qk_norm_rope_store(q, k, v, w.get(a + "q_norm.weight"), w.get(a + "k_norm.weight"), self.eps,
                                     cos, sin, meta.positions, self.kv[i], meta.slots)
            o = self._attend(q, self.kv[i], meta, self.scale).reshape(T, self.hq * self.d)
            o_out = self._row(o, w[a + "o_proj.weight"], w.get(a + "o_proj.bias"),
                              lambda y: lora([y], o, i, "o", masks))
            h, x = fused.add_rms_norm(o_out, w[p + "post_attention_layernorm.weight"], self.eps, residual=h)
            m = p + "mlp."
            gate_up = self.packed.get(m + "gate_up_proj.weight")
            if gate_up is not None:
                gate, up = self._linear(x, gate_up).chunk(2, dim=1)
            else:
                gate, up = self._linear(x, w[m + "gate_proj.weight"]), self._linear(x, w[m + "up_proj.weight"])
            lora([gate, up], x, i, "gate_up", masks)
            g = fused.silu_mul(gate, up)
            y = self._row(g, w[m + "down_proj.weight"], None, lambda d: lora([d], g, i, "down", masks))
            if i + 1 < hi:
                h, x = fused.add_rms_norm(y, w[f"model.layers.{i + 1}.input_layernorm.weight"], self.eps, residual=h)
            else:
                h = h + y
        return h

    def _qkv(self, x: torch.Tensor, a: str, T: int):
        """q [T, Hq, D], k and v [T, Hkv, D]: one GEMM when the projections are packed (then
        they are column views of its output)."""
        w, qkv = self.w, self.packed.get(a + "qkv_proj.weight")
        if qkv is not None and (a + "q_proj.bias" in w) == (a + "qkv_proj.bias" in self.packed):
            y = self._linear(x, qkv, self.packed.get(a + "qkv_proj.bias"))
            q, k, v = y.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=1)
        else:
            q, k, v = (self._linear(x, w[a + n + ".weight"], w.get(a + n + ".bias")) for n in ("q_proj", "k_proj", "v_proj"))
        return q.view(T, self.hq, self.d), k.view(T, self.hkv, self.d), v.view(T, self.hkv, self.d)

    def _row(self, x: torch.Tensor, weight: torch.Tensor, bias, terms=None) -> torch.Tensor:
        """A row-parallel linear (o_proj, down_proj): each rank's partial product, summed over
        the ranks; the (replicated) bias is added once, after the sum.  ``terms(y)`` adds the
        LoRA adapters' terms in place, to the partial product (the rank's part of them)."""
        if self.tp is None:
            y = self._linear(x, weight, bias)
            if terms is not None:
                terms(y)
            return y
        y = self._linear(x, weight)
        if terms is not None:
            terms(y)
        y = self.tp.all_reduce(y)
        return y if bias is None else y + bias

    @torch.no_grad()
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head of the rows to sample: float32 logits [rows, V] (on every
        rank of a tensor-parallel group: each computes its vocabulary range, then all-gather)."""
        logits = self._linear(self._norm(h, self.w["model.norm.weight"], self.eps), self.lm_head).float()
        if self.tp is None:
            return logits
        if not h.shape[0]:       # every rank has the same rows (the step's plan): no collective
            return logits.new_empty(0, self.cfg.vocab_size)
        return self.tp.gather_vocab(logits)

    @property
    def mid(self) -> int:
        return self.L // 2

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, meta: AttnMeta, sample_rows: torch.Tensor) -> torch.Tensor:
        """Writes every token's K/V into the cache; returns logits [len(sample_rows), V]."""
        h, cos, sin = self.embed(input_ids, meta.positions)
        h = self.layers(h, cos, sin, meta, 0, self.mid)
        if self.mid_hook is not None:     # layers 0..mid-1 have written their K/V
            self.mid_hook()
        h = self.layers(h, cos, sin, meta, self.mid, self.L)
        return self.head(h[sample_rows])

    mid_hook = None   # fault injection: called once per forward, halfway through the layers
    lora = None       # lora_slots.Adapters, when the engine serves adapters
