"""The program-change table (Anchor paper §5.4), on CPU with a host daemon.

A toy serving program — an LLM (optionally behind a vision encoder) plus an engine
that keeps a per-layer KV cache in a plain dict — builds its state in a
``managed_scope``, loads weights only for objects that were *created* (a matched
object keeps what the previous worker had), prefills a prompt, decodes, and commits
its progress to the journal after every token.  Run 1 (original program) is
SIGKILLed after two tokens; run 2 is a *modified* program that resumes from the
anchored KV cache when its engine metadata says the cache belongs to this model;
its output is compared, bit for bit, with a fresh run of the modified program
without gpu-anchor.

    PYTHONPATH=. python examples/scope_program_changes.py     # prints the table

Outcomes: ``correct`` (same tokens and logits), ``refused`` (ConflictError, daemon
untouched), ``WRONG`` (ran, different output).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import zlib

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # workers are forked: never init CUDA here
import torch  # noqa: E402
from torch import nn

PROMPT = [3, 14, 15, 9, 2, 6]
TOTAL_NEW = 6          # tokens generated in all
KILL_AFTER = 2         # run 1 is killed after this many
CASES = {
    "a": ("add LoRA adapters", {"lora": True}),
    "b": ("remove the vision encoder", {"vision": False}),
    "c": ("INT8 quantization with per-layer scale tensors", {"int8": True}),
    "d": ("rename the KV cache attribute", {"kv_attr": "cache"}),
    "e": ("swap attention/MLP init order", {"mlp_first": True}),
    "f": ("remove the last decoder layer", {"layers": 2}),
    "g": ("shrink the KV cache", {"kv_tokens": 12}),
    "h": ("KV layout NHD -> HND, same shape", {"layout": "HND"}),
}
BASE = dict(device="cpu", vocab=64, d=16, heads=2, layers=3, kv_tokens=16, layout="NHD", lora=False, vision=True,
            int8=False, kv_attr="kv_cache", mlp_first=False)


# ----------------------------------------------------------------------------- the program
class Linear(nn.Module):
    def __init__(self, i, o, int8=False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(o, i))
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        if int8:  # a per-layer scale tensor, allocated right after its weight
            self.register_buffer("scale", torch.ones(o, 1))
        self.lora_A = self.lora_B = None

    def forward(self, x):
        w = self.weight
        if getattr(self, "scale", None) is not None:
            w = (w / self.scale).round().clamp(-127, 127) * self.scale
        y = x @ w.t()
        if self.lora_A is not None:
            y = y + (x @ self.lora_A.t()) @ self.lora_B.t()
        return y


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c["d"]
        self.wq, self.wk, self.wv, self.wo = (Linear(d, d, c["int8"]) for _ in range(4))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.up, self.down = Linear(c["d"], 4 * c["d"], c["int8"]), Linear(4 * c["d"], c["d"], c["int8"])


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        if c["mlp_first"]:
            self.mlp = MLP(c)
            self.attn = Attention(c)
        else:
            self.attn = Attention(c)
            self.mlp = MLP(c)
        self.norm1, self.norm2 = nn.LayerNorm(c["d"]), nn.LayerNorm(c["d"])


class VisionEncoder(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.patch = nn.Linear(48, c["d"])
        self.proj = nn.Linear(c["d"], c["d"])


class LM(nn.Module):
    def __init__(self, c):
        super().__init__()
        if c["vision"]:
            self.vision = VisionEncoder(c)   # built first: shifts every later allocation
        self.embed = nn.Embedding(c["vocab"], c["d"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.norm = nn.LayerNorm(c["d"])
        self.head = Linear(c["d"], c["vocab"])


class Engine:
    def __init__(self, c):
        self.c = c
        self.model = LM(c)
        dh = c["d"] // c["heads"]
        setattr(self, c["kv_attr"], {f"layer_{i}": torch.zeros(2, c["kv_tokens"] * c["heads"] * dh)
                                     for i in range(c["layers"])})

    @property
    def kv(self):
        return getattr(self, self.c["kv_attr"])

    def _kv_view(self, i):
        c = self.c
        dh, t = c["d"] // c["heads"], c["kv_tokens"]
        buf = self.kv[f"layer_{i}"]
        if c["layout"] == "NHD":
            return buf.view(2, t, c["heads"], dh)                  # [token, head, dim]
        return buf.view(2, c["heads"], t, dh).transpose(1, 2)      # [head, token, dim] seen as NHD

    @torch.no_grad()
    def step(self, token: int, pos: int) -> torch.Tensor:
        """Run one token at position ``pos`` (writing its K/V), return next-token logits."""
        c, m = self.c, self.model
        h, dh = c["heads"], c["d"] // c["heads"]
        x = m.embed.weight[token][None]
        for i, blk in enumerate(m.layers):
            kv = self._kv_view(i)
            a = blk.norm1(x)
            q, k, v = blk.attn.wq(a), blk.attn.wk(a), blk.attn.wv(a)
            kv[0, pos] = k.view(h, dh)
            kv[1, pos] = v.view(h, dh)
            keys, vals = kv[0, :pos + 1], kv[1, :pos + 1]                  # [T, H, D]
            att = torch.einsum("hd,thd->ht", q.view(h, dh), keys) / dh ** 0.5
            o = torch.einsum("ht,thd->hd", att.softmax(-1), vals).reshape(1, -1)
            x = x + blk.attn.wo(o)
            x = x + blk.mlp.down(torch.relu(blk.mlp.up(blk.norm2(x))))
        return m.head(m.norm(x))[0]


def apply_lora(model: LM, r: int = 2) -> None:
    for blk in model.layers:
        for lin in (blk.attn.wq, blk.attn.wv):
            lin.lora_A = nn.Parameter(torch.randn(r, lin.weight.shape[1]) * 0.01)
            lin.lora_B = nn.Parameter(torch.zeros(lin.weight.shape[0], r))


def checkpoint_value(name: str, shape) -> torch.Tensor:
    """The 'weight file': a deterministic tensor per access path."""
    if name.endswith("lora_B"):
        return torch.zeros(shape)
    if "norm" in name and name.endswith("weight"):
        return torch.ones(shape)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g) * 0.3


def model_signature(c) -> str:
    # What the engine records to decide whether its KV cache belongs to this model.
    # The KV layout is deliberately *not* part of it: case (h) shows that gpu-anchor
    # itself cannot tell (same names, shapes and dtypes).
    keys = ("vocab", "d", "heads", "layers", "lora", "int8")
    return json.dumps({k: c[k] for k in keys}, sort_keys=True)


def load_weights(engine: Engine, created_ptrs=None) -> None:
    from gpu_anchor.scope import access_paths
    with torch.no_grad():
        for name, t in access_paths({"engine": engine}).items():
            if created_ptrs is not None and t.data_ptr() not in created_ptrs:
                continue
            if ".kv_cache" in name or ".cache[" in name:
                continue
            if name.endswith(".scale"):
                continue
            t.copy_(checkpoint_value(name, t.shape))
        for lin in engine.model.modules():   # scales are computed from the loaded weights
            if isinstance(lin, Linear) and getattr(lin, "scale", None) is not None:
                if created_ptrs is None or lin.scale.data_ptr() in created_ptrs:
                    lin.scale.copy_(lin.weight.abs().amax(1, keepdim=True) / 127)


def run(c, namespace=None, naming="access_path", kill_after=None, out=None):
    """One worker.  ``namespace=None``: no gpu-anchor at all (the ground truth)."""
    torch.manual_seed(0)
    journal = None
    # forked from a parent whose thread pool does not survive fork: rebuild it in this, the only
    # thread (left to later, concurrent first users it races: "Invalid thread pool!")
    torch.set_num_threads(1)
    if namespace is None:
        with torch.device(c["device"]):
            engine = Engine(c)
            if c["lora"]:
                apply_lora(engine.model)
        load_weights(engine)
        kv_matched = False
    else:
        import gpu_anchor
        from gpu_anchor.scope.scope import ManagedScope
        try:
            with ManagedScope(namespace, naming=naming) as scope, torch.device(c["device"]):
                engine = Engine(c)
                if c["lora"]:
                    apply_lora(engine.model)
        except gpu_anchor.ConflictError as e:
            out.put({"outcome": "refused", "error": str(e).splitlines()[1]})
            return
        created = {scope.objects[n].data_ptr() for n in scope.report.created}
        kv_ptrs = {t.data_ptr() for t in engine.kv.values()}
        kv_matched = not (kv_ptrs & created)
        del scope
        load_weights(engine, created)
        journal = gpu_anchor.connect(c["device"], namespace=namespace).journal
    sig = model_signature(c)
    progress = json.loads(journal.get("progress") or b"{}") if journal is not None else {}
    resumed = bool(kv_matched and progress.get("sig") == sig)
    if resumed:
        tokens = progress["tokens"]                      # resume from the anchored KV cache
    else:
        tokens = list(PROMPT)
        for pos, tok in enumerate(tokens[:-1]):
            engine.step(tok, pos)
    while len(tokens) < len(PROMPT) + TOTAL_NEW:
        logits = engine.step(tokens[-1], len(tokens) - 1)
        tokens.append(int(logits.argmax()))
        if journal is not None:
            journal.put("progress", json.dumps({"sig": sig, "tokens": tokens}).encode())
        if kill_after is not None and len(tokens) - len(PROMPT) == kill_after:
            out.put({"outcome": "ready"})
            signal.pause()                                # the harness SIGKILLs us here
    out.put({"outcome": "ran", "tokens": tokens, "logits": logits.tolist(), "resumed": resumed})


# ----------------------------------------------------------------------------- harness
def _child(ctx, *args, **kw):
    q = ctx.Queue()
    p = ctx.Process(target=run, args=args, kwargs={**kw, "out": q})
    p.start()
    return p, q


def _result(p, q, timeout: float) -> dict:
    """The worker's message; a worker that dies first is reported at once, with its exit code
    (waiting out the timeout would make one crash look like a hang of the whole table)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            if not p.is_alive():
                try:
                    return q.get(timeout=0.5)   # sent just before exiting
                except queue.Empty:
                    return {"outcome": "worker died", "error": f"exit code {p.exitcode}"}
            if time.monotonic() > deadline:
                p.kill()
                return {"outcome": "worker timed out", "error": f"no result within {timeout:.0f} s"}


def run_case(case: str, naming: str, namespace: str, timeout: float = 120, device: str = "cpu") -> dict:
    """Kill the original program, restart it modified, compare with a fresh modified run.

    Workers are forked: the calling process must not have initialised CUDA."""
    ctx = mp.get_context("fork")
    base = {**BASE, "device": device}
    modified = {**base, **CASES[case][1]}
    t0 = time.monotonic()
    p, q = _child(ctx, base, namespace, naming, KILL_AFTER)
    first = _result(p, q, timeout)
    if first["outcome"] != "ready":
        p.join(timeout)
        return {"case": case, "naming": naming, "outcome": "first run failed", "detail": first}
    os.kill(p.pid, signal.SIGKILL)
    p.join(timeout)
    p2, q2 = _child(ctx, modified, namespace, naming)
    restarted = _result(p2, q2, timeout)
    p2.join(timeout)
    p3, q3 = _child(ctx, modified)
    fresh = _result(p3, q3, timeout)
    p3.join(timeout)
    print(f"({case}, {naming}): restarted {restarted['outcome']}, fresh {fresh['outcome']} "
          f"({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    for r in (restarted, fresh):
        if r["outcome"] in ("worker died", "worker timed out"):
            return {"case": case, "naming": naming, "outcome": r["outcome"], "detail": r["error"]}
    res = {"case": case, "change": CASES[case][0], "naming": naming, "resumed": restarted.get("resumed")}
    if restarted["outcome"] == "refused":
        res.update(outcome="refused", detail=restarted["error"])
    elif restarted["tokens"] == fresh["tokens"] and restarted["logits"] == fresh["logits"]:
        res.update(outcome="correct")
    else:
        res.update(outcome="WRONG", detail=f"tokens {restarted['tokens'][len(PROMPT):]} vs {fresh['tokens'][len(PROMPT):]}")
    return res


def table(results: list[dict]) -> str:
    mark = {"correct": "✓ correct", "refused": "▲ refused", "WRONG": "✗ WRONG"}
    rows = ["| case | change | allocation order | access path (gpu-anchor) |", "| --- | --- | --- | --- |"]
    by = {(r["case"], r["naming"]): r for r in results}
    for case, (change, _) in CASES.items():
        a = by.get((case, "allocation_order"), {}).get("outcome", "-")
        b = by.get((case, "access_path"), {}).get("outcome", "-")
        rows.append(f"| ({case}) | {change} | {mark.get(a, a)} | {mark.get(b, b)} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    import argparse
    import tempfile
    from gpu_anchor.client import control
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON line at the end")
    a = ap.parse_args(argv)
    d = tempfile.mkdtemp(prefix="ga-pc-")
    os.environ["GPU_ANCHOR_SOCKET_DIR"] = d
    path = os.path.join(d, a.device.replace(":", "") + ".sock")
    proc = control.start(a.device, path)
    try:
        results = [run_case(c, n, f"pc-{c}-{n}", device=a.device)
                   for c in CASES for n in ("allocation_order", "access_path")]
    finally:
        control.stop(a.device, path)
        proc.wait(30)
    print(f"device {a.device}")
    print(table(results))
    for r in results:
        if "detail" in r:
            print(f"({r['case']}, {r['naming']}): {r['detail']}")
    if a.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
