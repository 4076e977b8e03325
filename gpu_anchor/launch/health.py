"""What the supervisor checks after a worker leaves (torch-free).

- daemons: does each answer, and is it the same instance the job bound its state in?
- device: NVML (``pynvml``/``nvidia-ml-py``) where installed; otherwise unknown.
- journal: the job's contract keys (see ``STEP_KEY``/``INCONSISTENT_KEY``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from gpu_anchor import errors
from gpu_anchor.client.channel import Channel

from gpu_anchor.journal_keys import INCONSISTENT_KEY, STEP_KEY  # the journal contract (docs/supervisor.md)


@dataclass
class DaemonView:
    alive: bool
    instance: str | None = None
    pid: int | None = None


def probe_daemon(device: str, socket_path: str, timeout: float = 2.0) -> DaemonView:
    try:
        ch = Channel(device, socket_path, timeout=timeout)
    except errors.AnchorError:
        return DaemonView(False)
    except OSError:
        return DaemonView(False)
    try:
        return DaemonView(True, ch.hello.get("instance"), ch.hello.get("pid"))
    finally:
        ch.close()


def read_namespace(device: str, socket_path: str, namespace: str, timeout: float = 5.0) -> dict | None:
    """``{"objects": n, "step": int|None, "inconsistent": str|None}`` or None if the daemon is gone."""
    try:
        ch = Channel(device, socket_path, timeout=timeout)
    except (errors.AnchorError, OSError):
        return None
    try:
        from gpu_anchor import protocol
        reply, blob, _ = ch.request({"op": "journal_get", "namespace": namespace,
                                     "keys": [STEP_KEY, INCONSISTENT_KEY]})
        values = protocol.unpack_blobs(reply["values"], blob)
        objs = ch.request({"op": "list", "namespace": namespace})[0]["objects"]
    except (errors.AnchorError, OSError):
        return None
    finally:
        ch.close()
    step = values.get(STEP_KEY)
    bad = values.get(INCONSISTENT_KEY)
    return {"objects": len(objs), "step": int(step) if step else None,
            "inconsistent": bad.decode(errors="replace") if bad is not None else None}


def journal_problem(views: list[dict | None]) -> str:
    """Empty string if the job's namespace views (all devices) are consistent, else why not."""
    for v in views:
        if v is None:
            return "daemon did not answer the journal read"
        if v["inconsistent"] is not None:
            return f"the job marked its state inconsistent: {v['inconsistent']}"
    steps = [v["step"] for v in views if v["step"] is not None]
    if steps and sum(v["objects"] for v in views) == 0:
        # the journal may live on another daemon than the tensors, so only "nothing anywhere" counts
        return f"journal says step {max(steps)} is committed but no objects are anchored"
    return ""


class DeviceHealth:
    """NVML-based health of the job's GPUs; ``check()`` -> (healthy: bool|None, problem)."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices
        self._nvml = None
        self._baseline: dict[int, int] = {}
        if not indices:
            return
        try:
            import pynvml  # from nvidia-ml-py; optional
            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:
            self._nvml = None
            return
        for i in indices:
            try:
                self._baseline[i] = self._ecc(i)
            except Exception:
                self._baseline[i] = 0  # already unreachable: check() will say so

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def _handle(self, i: int):
        """NVML handle of CUDA device ``i`` (CUDA_VISIBLE_DEVICES renumbers; NVML does not)."""
        nv = self._nvml
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if i < len(visible):
            v = visible[i]
            return nv.nvmlDeviceGetHandleByIndex(int(v)) if v.isdigit() else nv.nvmlDeviceGetHandleByUUID(v)
        return nv.nvmlDeviceGetHandleByIndex(i)

    def _ecc(self, i: int) -> int:
        nv = self._nvml
        h = self._handle(i)
        try:
            return int(nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
        except nv.NVMLError:
            return 0  # ECC not supported/enabled

    def check(self) -> tuple[bool | None, str]:
        if not self.indices:
            return True, ""  # host-only job: nothing to go wrong but the host itself
        if self._nvml is None:
            return None, "NVML unavailable"
        nv = self._nvml
        for i in self.indices:
            try:
                h = self._handle(i)
                nv.nvmlDeviceGetMemoryInfo(h)
                ecc = self._ecc(i)
            except Exception as e:  # GPU fell off the bus, driver gone, ...
                return False, f"GPU {i}: NVML query failed ({e})"
            if ecc > self._baseline.get(i, 0):
                return False, f"GPU {i}: {ecc - self._baseline.get(i, 0)} new uncorrectable ECC error(s)"
            try:
                pending = nv.nvmlDeviceGetRetiredPagesPendingStatus(h)
                if pending == nv.NVML_FEATURE_ENABLED:
                    return False, f"GPU {i}: retired pages pending (needs a reset)"
            except Exception:
                pass
        return True, ""


class ProbedDeviceHealth:
    """``DeviceHealth`` asked in a child process, for a supervisor that forks its engines itself.

    NVML starts threads of its own (on an H200: a driver thread and a jemalloc one), and
    ``gpu_anchor.runtime`` rightly refuses to fork while foreign threads run; so ``serve``'s
    supervisor keeps NVML in a long-lived child (``python -m gpu_anchor.launch.health``,
    started with fork+exec, which threads do not endanger) and asks it over a pipe: one line
    each way per check, milliseconds."""

    def __init__(self, indices: list[int]) -> None:
        import json
        import subprocess
        import sys
        self.indices = indices
        self._proc = None
        self._json = json
        if indices:
            self._proc = subprocess.Popen([sys.executable, "-m", "gpu_anchor.launch.health", *map(str, indices)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def check(self) -> tuple[bool | None, str]:
        if self._proc is None:
            return True, ""
        try:
            self._proc.stdin.write("check\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
            healthy, problem = self._json.loads(line)
            return healthy, problem
        except (OSError, ValueError) as e:
            return None, f"NVML probe unavailable ({e})"

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _probe_main(argv: list[str]) -> int:
    import json
    import sys
    h = DeviceHealth([int(a) for a in argv])
    for line in sys.stdin:
        if line.strip() == "check":
            sys.stdout.write(json.dumps(list(h.check())) + "\n")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(_probe_main(sys.argv[1:]))
