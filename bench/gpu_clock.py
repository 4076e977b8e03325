"""The GPU's SM clock, power and clock-event reasons over a benchmark, sampled through NVML.

A step of a long GPU-bound loop on the H200 is not one number: in the same process, with
nothing else on the GPU, the 12 GB MLP's step took either ~198 ms or ~225 ms, in runs of
several steps.  This sampler records what the GPU's clock did meanwhile, so a result can say
whether a slow step ran at a lower clock (in that run it did not: 1 980 MHz throughout, no
clock-event reason set).

    clock = ClockSampler.start("cuda:0")       # None when NVML or the device is not there
    ...
    clock.mean_between(t0, t1)                 # perf_counter() bounds -> {"sm_mhz", "power_w", "reasons"}
    clock.stop()

NVML through ``ctypes`` (``libnvidia-ml.so.1`` ships with the driver), so nothing to install;
the device is matched by PCI bus id, which is what ``CUDA_VISIBLE_DEVICES`` renumbers.
"""
from __future__ import annotations

import ctypes
import statistics
import threading
import time

# nvmlClocksEventReasons bits (nvml.h); the ones a benchmark can see
REASONS = {0x1: "idle", 0x2: "app clocks setting", 0x4: "power cap", 0x8: "hw slowdown",
           0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake", 0x100: "display clocks"}


def describe(mask: int) -> list[str]:
    return [name for bit, name in REASONS.items() if mask & bit]


class ClockSampler:
    def __init__(self, lib, handle, period_s: float) -> None:
        self._lib, self._handle, self.period_s = lib, handle, period_s
        self.samples: list[tuple[float, int, float, int]] = []   # (perf_counter, SM MHz, W, reasons)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-gpu-clock", daemon=True)

    @classmethod
    def start(cls, device: str, period_s: float = 0.01) -> "ClockSampler | None":
        """A running sampler for ``device`` (``cuda:N``), or None off CUDA or without NVML."""
        if not str(device).startswith("cuda"):
            return None
        try:
            import torch
            props = torch.cuda.get_device_properties(torch.device(device))
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0".encode()
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return None
            handle = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByPciBusId_v2(ctypes.c_char_p(bus), ctypes.byref(handle)) != 0:
                return None
            s = cls(lib, handle, period_s)
            s._read()  # fails here, not in the thread, if the calls are missing
        except (OSError, AttributeError, RuntimeError, AssertionError):  # no NVML, no CUDA build
            return None
        s._thread.start()
        return s

    def _read(self) -> tuple[int, float, int]:
        mhz, mw, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        self._lib.nvmlDeviceGetClockInfo(self._handle, 1, ctypes.byref(mhz))          # NVML_CLOCK_SM
        self._lib.nvmlDeviceGetPowerUsage(self._handle, ctypes.byref(mw))
        self._lib.nvmlDeviceGetCurrentClocksThrottleReasons(self._handle, ctypes.byref(reasons))
        return mhz.value, mw.value / 1e3, reasons.value

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            t = time.perf_counter()
            self.samples.append((t, *self._read()))

    def mean_between(self, t0: float, t1: float) -> dict | None:
        """Mean SM clock and power of the samples taken in [t0, t1], and the OR of their reasons."""
        xs = [s for s in self.samples if t0 <= s[0] <= t1]
        if not xs:
            return None
        mask = 0
        for s in xs:
            mask |= s[3]
        return {"sm_mhz": sum(s[1] for s in xs) / len(xs), "power_w": sum(s[2] for s in xs) / len(xs),
                "reasons": mask, "n": len(xs)}

    def summarize(self, spans: list[tuple[str, float, float]], reps: list[dict]) -> dict:
        """``spans``: (kind, start, end) of timed steps; the ``"plain"`` ones with their mean SM clock,
        power and reasons, the reasons seen, the correlation of step time with clock; each
        repetition in ``reps`` with ``bounds`` ({part: (start, end)}) gets its parts' ``clock``."""
        steps = []
        for what, t0, t1 in spans:
            c = self.mean_between(t0, t1)
            if what == "plain" and c:
                steps.append((t1 - t0, c["sm_mhz"], c["power_w"], c["reasons"]))
        for r in reps:
            if "bounds" in r:
                r["clock"] = {k: self.mean_between(*b) for k, b in r["bounds"].items()}
        mask = 0
        for s in steps:
            mask |= s[3]
        varied = len({s[0] for s in steps}) > 1 and len({s[1] for s in steps}) > 1
        return {"plain_steps": steps, "reasons_seen": describe(mask),
                "correlation": statistics.correlation([s[0] for s in steps], [s[1] for s in steps]) if varied else None}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
