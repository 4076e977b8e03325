"""When can a successor know that a SIGKILLed engine is dead? (the floor of a hot takeover)

    python -m bench takeover_detect --device cuda:0            # H200: 16 GiB anchored, 4 GiB private
    python -m bench takeover_detect --tiny                     # CPU smoke size

A child maps ``--anchored-gib`` of anchored memory from a private daemon (as an engine maps
its weights and KV cache), allocates ``--private-gib`` of its own, and keeps the GPU busy
replaying a CUDA graph of matmuls, as a decoding engine does.  It holds two sockets to this
process: one opened before CUDA was initialised (a low descriptor number) and one after.  This
process SIGKILLs it mid-work and timestamps, from the kill:

- ``early_eof`` / ``late_eof``: each socket's end of file, which a frontend or a standby
  waiting on the engine's connection would see;
- ``exit``: the process's pidfd readable (the process has finished exiting: a zombie);
- ``reaped``: ``waitpid`` returned (what ``detect`` of the serving recovery benchmark waits for);
- ``private_freed``: this process sees the child's private device memory free again (the
  CUDA context torn down; CUDA only);
- ``fence``: the child's step fence (``gpu_anchor.serve.step_fence``) says its last launched
  work has finished on the device: what a hot takeover started at ``late_eof`` waits for;
- ``successor_step``: when this process, a successor with its own CUDA context and a captured
  graph, has replayed one step and synchronised, started at ``fence`` — does the dead
  context's teardown hold other processes' work back?  (``successor_step_alone_ms``: the same
  replay with nothing dying, for comparison.)

The kernel closes descriptors in ``exit_files`` after ``exit_mm`` has unmapped the address
space, and the NVIDIA driver tears the context down when its device files close, so the order
of these events, not only their sum, decides what a takeover can start from.
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import default_device, private_daemon, write_result

GiB = 1 << 30
EVENTS = ("early_eof", "late_eof", "fence", "successor_step", "exit", "reaped", "private_freed")


def _child(device: str, ns: str, early_fd: int, late_path: str, anchored: int, private: int, fence=None) -> None:
    import torch

    import gpu_anchor
    from gpu_anchor.serve.step_fence import StepFence
    fence = StepFence(_page(fence))
    c = gpu_anchor.connect(device, namespace=ns)
    n = max(1, anchored // GiB)
    held = c.bind([(f"obj[{i}]", (anchored // n,), torch.uint8) for i in range(n)])
    for b in held:
        b.tensor.fill_(1)
    mine = torch.ones(private, dtype=torch.uint8, device=device)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16 if device != "cpu" else torch.float32)
    work = lambda: [a @ a for _ in range(20)]      # noqa: E731
    replay = work
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        work()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            work()
        replay = g.replay
        fence.register_device()
    stream = torch.cuda.current_stream().cuda_stream if device.startswith("cuda") else None
    late = socket.socket(socket.AF_UNIX)
    late.connect(late_path)
    os.write(early_fd, b"r")
    late.sendall(b"ready %d %d" % (early_fd, late.fileno()))
    while True:            # busy, as a decoding engine is, until the kill
        fence.launching()
        replay()
        fence.launched_all(stream)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    del mine, held


def _page(path: str):
    import mmap

    from gpu_anchor.serve.step_fence import PAGE
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, PAGE)
    finally:
        os.close(fd)


class _Successor:
    """A process with its own CUDA context and a captured graph, as a hot standby has."""

    def __init__(self, device: str) -> None:
        import torch
        self.torch = torch
        self.a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
        self.a @ self.a             # cuBLAS's handle and workspace exist before the capture
        torch.cuda.synchronize()
        self.g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.g):
            for _ in range(4):
                self.a @ self.a
        self.step()
        self.alone_ms = round(min(self.step() for _ in range(5)) * 1e3, 3)

    def step(self) -> float:
        t = time.perf_counter()
        self.g.replay()
        self.torch.cuda.synchronize()
        return time.perf_counter() - t


def _free_bytes(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    import torch
    return torch.cuda.mem_get_info(torch.device(device))[0]


def trial(device: str, ns: str, anchored: int, private: int, successor=None, timeout: float = 60.0) -> dict:
    from gpu_anchor.serve.step_fence import PAGE, StepFence
    early, child_end = socket.socketpair()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory() as d, tempfile.NamedTemporaryFile(dir=shm, prefix="gpu-anchor-fence-") as pf:
        pf.truncate(PAGE)
        fence = StepFence(_page(pf.name))
        path = os.path.join(d, "late")
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(path)
        srv.listen(1)
        code = ("import sys; from bench.takeover_detect import _child; "
                f"_child({device!r}, {ns!r}, {child_end.fileno()}, {path!r}, {anchored}, {private}, {pf.name!r})")
        proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child_end.fileno()])
        child_end.close()
        srv.settimeout(timeout)
        late, _ = srv.accept()
        fds = late.recv(64).split()[1:]
        early.recv(1)
    time.sleep(0.5)                       # mid-work: the graph replays back to back
    before = _free_bytes(device)
    pidfd = os.pidfd_open(proc.pid)
    seen: dict[str, float] = {}
    watch = {early.fileno(): "early_eof", late.fileno(): "late_eof", pidfd: "exit"}
    t0 = time.perf_counter()
    os.kill(proc.pid, signal.SIGKILL)
    while time.perf_counter() - t0 < timeout:
        ready, _, _ = select.select(list(watch), [], [], 0.0005)
        now = time.perf_counter()
        for fd in ready:
            seen[watch.pop(fd)] = now - t0
        if "fence" not in seen and "late_eof" in seen:
            if fence.quiet():
                seen["fence"] = time.perf_counter() - t0
                if successor is not None:
                    successor.step()
                    seen["successor_step"] = time.perf_counter() - t0
        if before is not None and "private_freed" not in seen and _free_bytes(device) >= before + 0.9 * private:
            seen["private_freed"] = time.perf_counter() - t0
        if not watch and (before is None or "private_freed" in seen) and "fence" in seen:
            break
    proc.wait()
    seen["reaped"] = time.perf_counter() - t0
    os.close(pidfd)
    early.close()
    late.close()
    return {"ms": {k: round(v * 1e3, 3) for k, v in seen.items()},
            "fds": {"early": int(fds[0]), "late": int(fds[1])}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench takeover_detect", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--anchored-gib", type=float, default=16.0)
    ap.add_argument("--private-gib", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="smoke size: CPU, 64 MiB anchored, 2 trials")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = "cpu" if a.tiny else default_device(a.device)
    anchored = (64 << 20) if a.tiny else int(a.anchored_gib * GiB)
    private = (16 << 20) if a.tiny else int(a.private_gib * GiB)
    repeat = 2 if a.tiny else a.repeat
    trials = []
    successor = _Successor(device) if device.startswith("cuda") else None
    with private_daemon(device):
        for i in range(repeat):
            trials.append(trial(device, f"detect-{os.getpid()}-{i}", anchored, private, successor))
            print(f"[bench] trial {i}: {trials[-1]['ms']}", flush=True)
    summary = {}
    for k in EVENTS:
        vals = [t["ms"][k] for t in trials if k in t["ms"]]
        if vals:
            summary[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
    result = {"benchmark": "takeover_detect", "device": device, "anchored_bytes": anchored,
              "private_bytes": private, "trials": trials, "summary": summary,
              "successor_step_alone_ms": successor.alone_ms if successor is not None else None,
              "command": "python -m bench takeover_detect " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(write_result("takeover_detect" + ("_tiny" if a.tiny else ""), result, a.out))
    return 0


def title(result: dict) -> str:
    return f"Hot takeover: when a SIGKILLed engine's death can be seen ({result['device']})"


def render(result: dict) -> str:
    lines = [f"A child maps {result['anchored_bytes'] / GiB:.1f} GiB of anchored memory, holds "
             f"{result['private_bytes'] / GiB:.1f} GiB of its own and replays a CUDA graph of matmuls when it is "
             "SIGKILLed; milliseconds from the kill, over " + f"{len(result['trials'])} trials.", "",
             "| event | median | min | max | what a successor could wait on |", "| --- | --- | --- | --- | --- |"]
    what = {"early_eof": "a socket the engine opened before CUDA initialisation",
            "late_eof": "a socket the engine opened after CUDA initialisation",
            "exit": "the engine's pidfd (the process finished exiting)",
            "reaped": "`waitpid` (today's detection)",
            "private_freed": "the engine's own device memory free again (its CUDA context gone)",
            "fence": "the engine's step fence: its last launched step finished on the device (after `late_eof`)",
            "successor_step": "another process's graph step, started at `fence`, finished"}
    for k in EVENTS:
        s = result["summary"].get(k)
        if s:
            lines.append(f"| {k} | {s['median']:.1f} ms | {s['min']:.1f} ms | {s['max']:.1f} ms | {what[k]} |")
    if result.get("successor_step_alone_ms") is not None:
        lines += ["", f"The successor's graph step alone (nothing dying): {result['successor_step_alone_ms']:.2f} ms."]
    return "\n".join(lines)
