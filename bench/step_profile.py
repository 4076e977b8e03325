"""Where a benchmark's steps spend device time: a ``torch.profiler`` window over some steps,
each step marked, summarised per step.

    prof = StepProfile("cuda:0")
    with prof:
        for k in range(n):
            with prof.step("window"):
                train_step(); torch.cuda.synchronize()
    prof.summary()   # [{"label", "wall_ms", "kernel_busy_ms", "kernels", "memcpy_ms": {kind: ms}}, ...]

Per step (the host range of its mark): ``kernel_busy_ms`` is the union of the device kernels'
intervals that fall inside it (so kernels overlapping on two streams count once), ``memcpy_ms``
the copies' time by kind (``DtoH``, ``HtoD``, ``DtoD``, as the profiler names them).  The steps
must end with a device synchronisation, as the benchmarks' timed steps do, so a step's device
work lies inside its host range.  Profiling slows a step down: a profiled step is for where the
time goes, never for how much there is.  A helper module, not a scenario.

``by_kernel`` / ``by_category``: a whole profiled window's device time per kernel (on a CPU the
aten ops' self time), per step, and summed into a benchmark's categories.
"""
from __future__ import annotations

import contextlib

MARK = "bench_step:"
# kernel-name patterns the benchmarks' profiles share (CUDA kernel names; aten op names on a CPU)
MATMUL = r"gemm|cutlass|nvjet|xmma|sm90|sm80|cublas|\baten::(mm|addmm|bmm|linear|matmul)\b"
ATTENTION = r"flash|fmha|efficient_attention|scaled_dot_product|cudnn"


class StepProfile:
    def __init__(self, device: str) -> None:
        import torch
        acts = [torch.profiler.ProfilerActivity.CPU]
        if str(device).startswith("cuda"):
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=acts)
        self._n = 0

    def __enter__(self) -> "StepProfile":
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)

    @contextlib.contextmanager
    def step(self, label: str):
        import torch
        self._n += 1
        with torch.profiler.record_function(f"{MARK}{self._n}:{label}"):
            yield

    def summary(self) -> list[dict]:
        from torch.autograd import DeviceType
        events = list(self._prof.events())
        # a mark is recorded twice, on the host and as a device-side annotation: keep the host's
        marks = sorted((e for e in events if e.name.startswith(MARK) and e.device_type == DeviceType.CPU),
                       key=lambda e: e.time_range.start)
        device = [e for e in events if e.device_type == DeviceType.CUDA]
        out = []
        for m in marks:
            t0, t1 = m.time_range.start, m.time_range.end
            inside = [e for e in device if t0 <= e.time_range.start and e.time_range.end <= t1]
            copies: dict[str, float] = {}
            spans = []
            for e in inside:
                if e.name.startswith("Memcpy") or e.name.startswith("Memset"):
                    kind = next((k for k in ("DtoH", "HtoD", "DtoD", "Memset") if k in e.name), "other")
                    copies[kind] = copies.get(kind, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
                else:
                    spans.append((e.time_range.start, e.time_range.end))
            out.append({"label": m.name[len(MARK):].split(":", 1)[1], "wall_ms": (t1 - t0) / 1e3,
                        "kernel_busy_ms": _union(spans) / 1e3, "kernels": len(spans),
                        "memcpy_ms": {k: round(v, 3) for k, v in sorted(copies.items())}})
        return out


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def by_kernel(prof, steps: int, cuda: bool) -> list[tuple[str, float, float]]:
    """``[(kernel, ms per step, calls per step)]`` of a finished ``torch.profiler.profile``,
    largest first: device kernels' self time (on a CPU run, the aten ops' self CPU time).
    The device-side copies of ``record_function`` ranges (torch draws ``Optimizer.step#...``
    over the kernels it launched) are left out: counted, they would count those kernels twice."""
    rows = []
    for e in prof.key_averages():
        if cuda:
            if not str(getattr(e, "device_type", "")).endswith("CUDA"):
                continue
            if getattr(e, "is_user_annotation", False):
                continue     # a record_function range drawn on the device timeline, not a kernel
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        else:
            us = e.self_cpu_time_total
            if not e.key.startswith("aten::"):
                continue
        if us > 0:
            rows.append((e.key, us / max(steps, 1) / 1e3, e.count / max(steps, 1)))
    return sorted(rows, key=lambda r: -r[1])


def first_match(name: str, table, default: str) -> str:
    """The category of the first ``(category, regex)`` of ``table`` that ``name`` matches
    (case-insensitive), else ``default``."""
    import re
    return next((cat for cat, pat in table if re.search(pat, name, re.IGNORECASE)), default)


def by_category(rows, categorize) -> dict[str, float]:
    """``by_kernel``'s rows summed by ``categorize(name)``, largest first."""
    cats: dict[str, float] = {}
    for name, ms, _ in rows:
        cats[categorize(name)] = cats.get(categorize(name), 0.0) + ms
    return dict(sorted(cats.items(), key=lambda kv: -kv[1]))
