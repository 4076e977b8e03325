"""Two "nodes" on localhost under ``gpu-anchor torchrun`` (c10d rendezvous), one
worker SIGKILLed: torch elastic restarts the group, the workers reattach to
their anchored state and finish bit-identical to a fault-free run."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import torch

from gpu_anchor.client.channel import Channel
from gpu_anchor.client import control

from launch_reference import DEMO, ROOT, STEPS


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _journal_versions(sock_dir: str) -> int:
    try:
        ch = Channel("cpu", os.path.join(sock_dir, "cpu.sock"), timeout=2)
    except Exception:
        return 0
    try:
        nss = ch.request({"op": "status"})[0]["namespaces"]
        return max([ns["journal_version"] for ns in nss.values()] or [0])
    finally:
        ch.close()


def _worker_pids(tag: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if b"gpu_anchor.launch.worker" in cmd and tag.encode() in cmd:
            out.append(int(pid))
    return out


def test_two_nodes_c10d_one_worker_killed(reference, tmp_path):
    env0 = {**os.environ, "PYTHONPATH": ROOT}
    port = _port()
    nodes = []
    for n in range(2):
        sock = tmp_path / f"node{n}"
        cmd = [sys.executable, "-m", "gpu_anchor.launch.cli", "torchrun", "--device-type", "cpu",
               "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"t{port}", "--max-restarts", "5",
               "--monitor-interval", "0.1", DEMO, "--steps", str(STEPS), "--step-sleep", "0.02",
               "--out", f"node{n}.pt"]
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env={**env0, "GPU_ANCHOR_SOCKET_DIR": str(sock)},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    try:
        deadline = time.monotonic() + 120
        while _journal_versions(str(tmp_path / "node1")) < 20:
            assert time.monotonic() < deadline, "node 1 never made progress"
            assert all(p.poll() is None for p in nodes)
            time.sleep(0.1)
        victims = _worker_pids("node1.pt")
        assert len(victims) == 1
        os.kill(victims[0], signal.SIGKILL)
        outs = [p.communicate(timeout=240) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for n in range(2):
            for pid in _worker_pids(f"node{n}.pt"):
                os.kill(pid, signal.SIGKILL)
        for n in range(2):
            for device, path in control.discover(str(tmp_path / f"node{n}")).items():
                control.stop(device, path)
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-4000:]
    stdout = "".join(o for o, _ in outs)
    assert "resuming at step" in stdout and "resuming at step 0" not in stdout  # reattached, not from scratch
    result = [tmp_path / f"node{n}.pt" for n in range(2) if (tmp_path / f"node{n}.pt").exists()]
    assert len(result) == 1  # written by rank 0, on one of the nodes
    assert torch.equal(torch.load(result[0]), reference[2])  # the same 2-rank job under `gpu-anchor run`
    from gpu_anchor.launch import jobstate         # each node's job record, as `gpu-anchor status` reads it
    for n in range(2):
        jobs = jobstate.load_all(str(tmp_path / f"node{n}" / "jobs"))
        assert [(j["kind"], j["state"], j["result"]) for j in jobs] == [("torchrun", "done", "success")], jobs
