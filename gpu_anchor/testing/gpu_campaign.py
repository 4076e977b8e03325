"""Ten SIGKILLs at the five protocol phases on a ~1B Llama (transformers, bf16, AdamW).

    PYTHONPATH=. python -m gpu_anchor.testing.gpu_campaign --out train_gpu_faults.json
    python -m gpu_anchor.testing.gpu_campaign --device cpu --tiny      # the same on a toy model
    PYTHONPATH=. python -m gpu_anchor.testing.gpu_campaign --every-chunk   # the MLP, bit for bit

``--lend-grad-bytes N`` / ``--[no-]grads-in-place``: the runs lend their gradient buffers /
write their Linear layers' weight gradients in place (``StepProtocolConfig``); without them, the
optimizer's automatic choice, as a user's job has it (both on for a CUDA device).

``--every-chunk``: the CPU campaign's MLP (``campaign.py``, fp32 AdamW, so the fused update
on CUDA) killed at the four chunk phases of every chunk, each phase once more while the
previous kill is recovered, then compared with a fault-free run bit for bit (every loss,
every anchored object).

This process imports torch and transformers but never touches CUDA; every worker is
forked from it (CUDA starts in the child, ~0.5 s instead of a cold interpreter).  It
starts the device's daemon, runs a fault-free reference, then a run whose workers are
killed at ``before_update / mid_chunk / after_update / after_commit / between_steps``
(twice each, at first / middle / last chunks).  The last worker compares its anchored
state with the reference's.  Output JSON: per-step losses of both runs, the max
per-step loss difference, whether they are bit-identical, max parameter / optimizer
state differences, each worker's recovery time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time

from gpu_anchor.testing.campaign import _child, _wait

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=2048)


def build(tiny: bool, device, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**(LLAMA_1B | (TINY if tiny else {})))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM(cfg).to(torch.bfloat16)


def worker(ns: str, a: dict, log_path: str, fault: str | None, compare_ns: str | None = None) -> None:
    import torch

    import gpu_anchor

    from gpu_anchor.train import faults
    from gpu_anchor.train.anchor import anchor_module
    from gpu_anchor.train.config import StepProtocolConfig
    from gpu_anchor.train.optimizer import AnchoredOptimizer

    t0 = time.perf_counter()
    faults.arm(fault)
    dev = torch.device(a["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    client = gpu_anchor.connect(a["device"], namespace=ns)
    model = build(a["tiny"], dev)
    anchor_module(model, client)
    inner = torch.optim.AdamW(model.parameters(), lr=a["lr"], weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: min(1.0, (s + 1) / 5))
    opt = AnchoredOptimizer(inner, model=model, client=client, schedulers=[sched],
                            config=StepProtocolConfig(chunk_bytes=a["chunk_bytes"],
                                                      lend_grad_bytes=a.get("lend_grad_bytes"),
                                                      grads_in_place=a.get("grads_in_place")))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"resumed {opt.completed_steps} {time.perf_counter() - t0:.3f} chunks {opt.num_chunks}\n".encode())
    vocab = model.config.vocab_size
    for step in range(opt.completed_steps, a["steps"]):
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, vocab, (a["batch"], a["seq"]), generator=g).to(dev)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        os.write(fd, f"{step} {float(loss.detach())!r}\n".encode())
        opt.step()
        opt.zero_grad()
    if opt.lender is not None:
        st = opt.lender.stats
        os.write(fd, f"lending lent_last_step={st['last_lent_bytes']} evicted={st['evicted_bytes']}\n".encode())
    if opt.config.grads_in_place:
        os.write(fd, f"in_place {opt._grads.stats['in_place']}\n".encode())
    if compare_ns:
        ref = gpu_anchor.connect(a["device"], namespace=compare_ns)
        diffs = {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
        identical = True
        from gpu_anchor.client.mapping import torch_dtype
        objs = client.objects()
        for name, info in objs.items():
            kind = ("param" if name.startswith("model.") else
                    "exp_avg_sq" if name.endswith(".exp_avg_sq") else "exp_avg" if name.endswith(".exp_avg") else None)
            if kind is None:
                continue
            mine = client.lookup(name, info.shape, torch_dtype(info.dtype))
            theirs = ref.lookup(name, info.shape, torch_dtype(info.dtype))
            identical &= bool(torch.equal(mine, theirs))
            diffs[kind] = max(diffs[kind], float((mine.float() - theirs.float()).abs().max()))
        os.write(fd, ("compare " + json.dumps({"max_abs_diff": diffs, "bit_identical": identical}) + "\n").encode())
    os.close(fd)


def _parse(log: str) -> dict:
    losses, resumes, compare, lending, in_place = {}, [], None, None, None
    for line in log.splitlines():
        head, _, rest = line.partition(" ")
        if head == "lending":
            lent, evicted = (int(f.split("=")[1]) for f in rest.split())
            lending = {"lent_bytes_last_step": lent, "evicted_bytes": evicted}
        elif head == "resumed":
            f = rest.split()
            resumes.append({"completed_steps": int(f[0]), "construct_s": float(f[1])})
            chunks = int(f[3])
        elif head == "compare":
            compare = json.loads(rest)
        elif head == "in_place":
            in_place = int(rest)
        else:
            s, v = int(head), float(rest)
            losses.setdefault(s, []).append(v)
    return {"losses": losses, "resumes": resumes, "compare": compare, "chunks": chunks, "lending": lending,
            "in_place_final_worker": in_place}


def schedule(n: int) -> list[str]:
    """Ten kills: the five phases twice, at first / middle / last chunks, steps 2..19."""
    mid, last = n // 2, n - 1
    return ["before_update@2:0", f"mid_chunk@4:{mid}", f"after_update@6:{last}", f"after_commit@8:{mid}",
            "between_steps@10", f"before_update@12:{last}", "mid_chunk@14:0", f"after_update@16:{mid}",
            f"after_commit@18:{last}", "between_steps@19"]  # noqa: E501


@contextlib.contextmanager
def _daemon(device: str):
    """A daemon for ``device`` on a private socket directory, for this process and its forks."""
    from gpu_anchor.client import control
    tmp = tempfile.mkdtemp(prefix="ga-train-gpu-")
    os.environ["GPU_ANCHOR_SOCKET_DIR"] = os.path.join(tmp, "sock")
    os.makedirs(os.environ["GPU_ANCHOR_SOCKET_DIR"], mode=0o700)
    sock = os.path.join(os.environ["GPU_ANCHOR_SOCKET_DIR"], device.replace(":", "") + ".sock")
    daemon = control.start(device, sock)
    try:
        yield tmp
    finally:
        control.stop(device, sock)
        daemon.wait(timeout=30)


def every_chunk(device: str, lend_grad_bytes: int | None = None, grads_in_place: bool | None = None) -> dict:
    """The ``--every-chunk`` campaign (module docstring); returns its result.  ``lend_grad_bytes``:
    the killed run lends its gradient buffers (the MLP's saved tensors are a few KiB, so any size
    is lent), the reference neither lends nor writes in place; so with ``grads_in_place``.  None:
    the optimizer's automatic choice (``_expected`` says what it is)."""
    import dataclasses

    import gpu_anchor
    from gpu_anchor.testing import campaign as C
    from gpu_anchor.train import grad_lending
    n = C.num_chunks(C.CampaignConfig())
    ref_cfg = C.CampaignConfig(steps=n + 3, progress="device", device=device)
    ref_cfg = dataclasses.replace(ref_cfg, lend_grad_bytes=0, grads_in_place=False)
    cfg = dataclasses.replace(ref_cfg, lend_grad_bytes=lend_grad_bytes, grads_in_place=grads_in_place)
    lends, in_place = _expected(lend_grad_bytes, device), _expected(grads_in_place, device)
    if lends:
        grad_lending.MIN_BYTES = 256
    specs = [f"{ph}@{1 + c}:{c}" for c in range(n) for ph in ("before_update", "mid_chunk", "after_update",
                                                               "after_commit")]
    with _daemon(device) as tmp:
        C.prewarm(cfg)        # for a CUDA campaign: no backward, no step here (runtime.fork refuses after CUDA)
        ref = C.run("every-chunk-ref", ref_cfg, os.path.join(tmp, "ref.log"))
        run = C.run("every-chunk-run", cfg, os.path.join(tmp, "run.log"), faults_seq=specs)
        ref_losses, ref_done = C.trajectory(ref.log)
        losses, done = C.trajectory(run.log)      # raises if a replayed step logged other bits
        differ = C.compare(gpu_anchor.connect(device, namespace="every-chunk-ref"),
                           gpu_anchor.connect(device, namespace="every-chunk-run"))
    updates = [line for line in ref.log.splitlines() + run.log.splitlines() if line.startswith("updates ")]
    out = {"test": "train_gpu_every_chunk", "device": device, "chunks": n, "steps": cfg.steps,
           "kill_specs": specs, "kills": run.kills, "losses_bit_identical": losses == ref_losses,
           "done_identical": done == ref_done, "objects_differing": differ, "final_workers_updates": updates}
    fused = all(u.endswith(" copy=0") and " fused=0 " not in u for u in updates) and bool(updates)
    lent = [int(line.split()[1].removeprefix("lent_total=")) for line in run.log.splitlines() if line.startswith("lending ")]
    out["lend_grad_bytes"], out["lent_bytes_final_worker"] = lend_grad_bytes, (lent[-1] if lent else None)
    written = [int(line.split()[1].removeprefix("in_place=")) for line in run.log.splitlines()
               if line.startswith("grads in_place=")]
    out["grads_in_place"], out["in_place_final_worker"] = grads_in_place, (written[-1] if written else None)
    out["ok"] = bool(run.kills == len(specs) and losses == ref_losses and done == ref_done and not differ
                     and (fused or device == "cpu")       # on a CPU every step saves by copies
                     and (not lends or (lent and lent[-1] > 0))
                     and (not in_place or (written and written[-1] > 0)))
    return out


def _expected(setting, device: str) -> bool:
    """Whether a run with this ``lend_grad_bytes`` / ``grads_in_place`` lends / writes in place:
    None is the optimizer's automatic choice, on for a CUDA device (one process here)."""
    return bool(setting) if setting is not None else device.startswith("cuda")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=22)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--chunk-bytes", type=int, default=None)
    ap.add_argument("--every-chunk", action="store_true", help="the MLP killed at every chunk, bit for bit")
    ap.add_argument("--lend-grad-bytes", type=int, default=None, metavar="N",
                    help="StepProtocolConfig.lend_grad_bytes of the runs (default: the automatic choice)")
    ap.add_argument("--grads-in-place", action=argparse.BooleanOptionalAction, default=None,
                    help="StepProtocolConfig.grads_in_place of the runs (default: the automatic choice)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")   # in case anything asks: no cuInit here
    if args.every_chunk:
        return _report(every_chunk(args.device, args.lend_grad_bytes, args.grads_in_place), args.out)
    if args.tiny:
        args.batch, args.seq = 2, 32
    import torch  # noqa: F401  (imported before fork on purpose)
    import transformers  # noqa: F401

    torch.set_num_threads(1)   # no OpenMP team before fork (libgomp is not fork-safe)
    build(True, "cpu")         # resolve transformers' lazy imports once, here, not in every worker
    a = dict(device=args.device, tiny=args.tiny, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr,
             chunk_bytes=args.chunk_bytes, lend_grad_bytes=args.lend_grad_bytes, grads_in_place=args.grads_in_place)
    out = {"test": "train_gpu_faults", "model": "llama3.2-1b" + (" (tiny)" if args.tiny else ""),
           "device": args.device, "dtype": "bfloat16", "optimizer": "AdamW", **a}
    with _daemon(args.device) as tmp:
        t0 = time.perf_counter()
        ref_log = os.path.join(tmp, "ref.log")
        code = _wait(_child(worker, "ref", a, ref_log, None, unsafe_ok=None))
        if code != 0:
            raise RuntimeError(f"fault-free run failed ({code})")
        out["fault_free_wall_s"] = time.perf_counter() - t0
        ref = _parse(open(ref_log).read())
        specs = schedule(ref["chunks"])
        run_log = os.path.join(tmp, "run.log")
        t0 = time.perf_counter()
        codes = []
        for spec in specs:
            codes.append(_wait(_child(worker, "run", a, run_log, spec, unsafe_ok=None)))
        codes.append(_wait(_child(worker, "run", a, run_log, None, "ref", unsafe_ok=None)))
        out["faulted_wall_s"] = time.perf_counter() - t0
    run = _parse(open(run_log).read())
    kills = sum(c == -signal.SIGKILL for c in codes[:-1])
    ref_l = {s: v[0] for s, v in ref["losses"].items()}
    replays_equal = all(len(set(v)) == 1 for v in run["losses"].values())
    run_l = {s: v[-1] for s, v in run["losses"].items()}
    diffs = [abs(run_l[s] - ref_l[s]) for s in sorted(ref_l) if s in run_l]
    out.update({
        "chunks": ref["chunks"], "kill_specs": specs, "kills": kills, "final_exit": codes[-1],
        "losses_fault_free": [ref_l[s] for s in sorted(ref_l)],
        "losses_faulted": [run_l.get(s) for s in sorted(ref_l)],
        "all_steps_present": sorted(run_l) == sorted(ref_l) == list(range(args.steps)),
        "max_step_loss_diff": max(diffs) if diffs else None,
        "losses_bit_identical": run_l == ref_l,
        "replayed_iterations_identical": replays_equal,
        "state_compare": run["compare"],
        "recoveries": run["resumes"],
        "lending": run["lending"],
        "in_place_final_worker": run["in_place_final_worker"],
    })
    out["ok"] = bool(kills == len(specs) and codes[-1] == 0 and out["all_steps_present"]
                     and (not _expected(args.lend_grad_bytes, args.device)
                          or bool(run["lending"] and run["lending"]["lent_bytes_last_step"]))
                     and (not _expected(args.grads_in_place, args.device) or bool(run["in_place_final_worker"])))
    return _report(out, args.out)


def _report(out: dict, path: str | None) -> int:
    text = json.dumps(out, indent=1)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)
    return 0 if out.get("ok") else 1


if __name__ == "__main__":
    from gpu_anchor import runtime
    runtime.exit_path(lambda: sys.exit(main()))    # skips the ~1 s teardown of torch and transformers
