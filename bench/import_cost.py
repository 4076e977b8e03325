"""What ``import gpu_anchor`` costs a restarted worker: fresh interpreters, ``import torch`` alone
against ``import torch, gpu_anchor, gpu_anchor.scope, gpu_anchor.train``, alternating, n each.

    python -m bench import_cost            # n = 3
    python -m bench import_cost --tiny     # n = 1

Goal (issue 16): ≤ 0.3 s over ``import torch`` (the scope once imported ``torch._dynamo``, ~2.5 s).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from bench.common import write_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = {"torch": "import torch", "gpu_anchor": "import torch, gpu_anchor, gpu_anchor.scope, gpu_anchor.train"}


def _time(code: str) -> float:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="one round")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    n = 1 if a.tiny else a.repeat
    runs = {k: [] for k in PROGRAMS}
    for _ in range(n):
        for k, code in PROGRAMS.items():
            runs[k].append(round(_time(code), 3))
    extra = [g - t for g, t in zip(runs["gpu_anchor"], runs["torch"])]
    result = {"runs_s": runs, "n": n,
              "torch_s": {"min": min(runs["torch"]), "median": statistics.median(runs["torch"]), "max": max(runs["torch"])},
              "gpu_anchor_s": {"min": min(runs["gpu_anchor"]), "median": statistics.median(runs["gpu_anchor"]),
                               "max": max(runs["gpu_anchor"])},
              "extra_s_median": statistics.median(extra), "goal_s": 0.3}
    result["goal_met"] = result["extra_s_median"] <= 0.3
    print(write_result("import_cost" + ("_tiny" if a.tiny else ""), result, a.out))
    print(f"import torch {result['torch_s']}; + gpu_anchor {result['gpu_anchor_s']}; extra (median of pairs) "
          f"{result['extra_s_median']:+.3f} s")
    return 0


def title(r: dict) -> str:
    return "Import cost of gpu_anchor in a fresh worker"


def render(r: dict) -> str:
    t, g = r["torch_s"], r["gpu_anchor_s"]
    return (f"| program | median | min – max | n |\n| --- | --- | --- | --- |\n"
            f"| `import torch` | {t['median']:.2f} s | {t['min']:.2f} – {t['max']:.2f} s | {r['n']} |\n"
            f"| `import torch, gpu_anchor, gpu_anchor.scope, gpu_anchor.train` | {g['median']:.2f} s | "
            f"{g['min']:.2f} – {g['max']:.2f} s | {r['n']} |\n\n"
            f"Extra over `import torch` (median of the alternating pairs): {r['extra_s_median']:+.2f} s; "
            f"goal ≤ {r['goal_s']} s: {'met' if r['goal_met'] else 'MISSED'}.")
