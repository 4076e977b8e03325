"""The daemons of one job on one node (torch-free).

One daemon per local device the job uses plus the host daemon (``gpu-anchor serve``: only
its engine's daemon, at the socket it was given).  A daemon that already answers is reused
(and left running at the end: it is not ours); daemons we started are stopped at the end of
the job unless ``keep`` — or unless another job's namespace holds objects there by then.
Namespaces separate jobs that share daemons.
"""
from __future__ import annotations

import os
import sys

from gpu_anchor.client import control
from gpu_anchor.paths import default_socket, normalize_device

from . import health


class JobDaemons:
    def __init__(self, devices: list[str], namespace: str, keep: bool = False, log=print,
                 paths: dict[str, str] | None = None, host: bool = True) -> None:
        # host daemon (training): host-side state (CPU tensors, per-rank namespaces) lives there
        devs = (["cpu"] if host else []) + [normalize_device(d) for d in devices
                                             if not host or normalize_device(d) != "cpu"]
        self.devices = list(dict.fromkeys(devs))
        self.namespace = namespace
        self.keep = keep
        self.log = log
        self.paths = {d: (paths or {}).get(d) or default_socket(d) for d in self.devices}
        self.started: dict[str, tuple[str, object]] = {}   # socket path -> (device, Popen) of daemons we started
        self.instances: dict[str, str] = {}      # device -> instance id the job's state lives in

    def ensure(self) -> None:
        """Start what does not answer; remember every daemon's instance id."""
        for d in self.devices:
            view = health.probe_daemon(d, self.paths[d])
            if view.alive:
                self.log(f"daemon {d}: reusing pid {view.pid} at {self.paths[d]}")
            else:
                self.start(d)
                view = health.probe_daemon(d, self.paths[d])
            self.instances[d] = view.instance

    def start(self, device: str) -> None:
        proc = control.start(device, self.paths[device])
        self.started[self.paths[device]] = (device, proc)
        self.log(f"daemon {device}: started pid {proc.pid} at {self.paths[device]}")

    def follow(self, device: str, path: str) -> None:
        """The job's state moved to ``device``'s daemon at ``path`` (a serving engine migrated):
        watch that one from now on; daemons started earlier are still ours to stop."""
        self.devices, self.paths = [device], {device: path}
        self.instances = {device: health.probe_daemon(device, path).instance}

    def check(self) -> tuple[bool, bool, list[str]]:
        """(all alive, all the same instances as bound, problems)."""
        alive, same, problems = True, True, []
        for d in self.devices:
            view = health.probe_daemon(d, self.paths[d])
            if not view.alive:
                alive = False
                problems.append(f"{d} not answering")
            elif view.instance != self.instances.get(d):
                same = False
                problems.append(f"{d} is a new instance")
        return alive, same, problems

    def seem_alive(self) -> bool:
        """Cheap, without asking them: no daemon this job started has exited.  (A daemon we
        did not start counts as alive; ``check`` asks them all.)"""
        return all(proc.poll() is None for _, proc in self.started.values())

    def replace_dead(self) -> list[str]:
        """Fresh daemons for those that died or were replaced; drops this job's namespaces
        in the survivors' places too, so a restore starts from nothing.  Returns devices restarted."""
        fresh = []
        for d in self.devices:
            view = health.probe_daemon(d, self.paths[d])
            if not view.alive:
                self._reap(d)
                self.start(d)
                fresh.append(d)
                view = health.probe_daemon(d, self.paths[d])
            self.instances[d] = view.instance
        return fresh

    def drop_namespace(self) -> tuple[int, int]:
        """Free the job's namespaces in every daemon that answers; ``(objects, bytes)`` freed."""
        from gpu_anchor.client.channel import Channel
        objects = nbytes = 0
        for d in self.devices:
            try:
                ch = Channel(d, self.paths[d], timeout=10.0)
            except Exception:
                continue
            try:
                names = ch.request({"op": "status"})[0]["namespaces"]
                for ns, info in names.items():
                    if self._ours(ns):
                        objects += ch.request({"op": "drop", "namespace": ns})[0]["freed"]
                        nbytes += info["object_bytes"]
            finally:
                ch.close()
        return objects, nbytes

    def _ours(self, ns: str) -> bool:
        return ns == self.namespace or ns.startswith(self.namespace + "/")

    def namespaces_of(self, device: str, world_size: int, ranks: list[int]) -> list[str]:
        """The namespaces the job's local ranks use on ``device`` (host daemon: one per rank)."""
        if device == "cpu" and world_size > 1:
            return [f"{self.namespace}/rank{r}" for r in ranks]
        return [self.namespace]

    def _reap(self, device: str) -> None:
        _, proc = self.started.pop(self.paths[device], (None, None))
        if proc is not None:
            try:
                proc.wait(timeout=0)
            except Exception:
                pass

    def stop(self) -> list[str]:
        """Stop the daemons we started, except one where another job's namespace holds objects
        now (its state is not ours to end).  Returns one phrase per daemon, for the log."""
        if self.keep:
            self.log("daemons left running: anchored state stays for the next run")
            return []
        said = []
        for path, (d, proc) in list(self.started.items()):
            others = self._others(d, path)
            if others:
                said.append(f"left the daemon it started at {path} (pid {proc.pid}) running: "
                            f"namespace(s) {', '.join(others)} of other jobs live there")
                continue
            control.stop(d, path)
            try:
                proc.wait(timeout=10)
            except Exception:
                proc.kill()
            said.append(f"stopped the daemon it started at {path} (pid {proc.pid})")
        self.started.clear()
        return said

    def _others(self, device: str, path: str) -> list[str]:
        from gpu_anchor.client.channel import Channel
        try:
            ch = Channel(device, path, timeout=10.0)
        except Exception:
            return []
        try:
            names = ch.request({"op": "status"})[0]["namespaces"]
        except Exception:
            return []
        finally:
            ch.close()
        return sorted(ns for ns, info in names.items() if info["objects"] and not self._ours(ns))


def local_devices(kind: str, nproc: int) -> list[str]:
    """Devices of the local ranks: ``cuda:LOCAL_RANK`` on GPUs, else the host."""
    if kind == "auto":
        kind = "cuda" if _have_gpus() else "cpu"
    if kind == "cpu":
        return []
    if kind != "cuda":
        raise ValueError(f"--device-type must be auto, cuda or cpu, got {kind!r}")
    return [f"cuda:{r}" for r in range(nproc)]


def _have_gpus() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl")) and sys.platform == "linux"
