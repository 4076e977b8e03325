"""``python -m bench NAME [args]`` runs bench/NAME.py's ``main(argv)``; ``python -m bench list``."""
from __future__ import annotations

import importlib
import os
import pkgutil
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# parts of a scenario or of the report (serve_decode of serve_throughput; scoreboard is the report's target table; cublaslt is decode_gemm's ctypes binding; the *_report modules render a scenario's results; gpu_clock samples the SM clock for checkpoint_stall; checkpoint_restore is its restore and migration rows)
NOT_SCENARIOS = {"common", "report", "__main__", "protocol", "figures", "serve_decode", "serve_throughput_report", "train_overhead_report", "gpu_clock", "step_profile", "checkpoint_restore",
                 "checkpoint_stall_report", "cublaslt", "scoreboard"}


def scenarios() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([HERE]) if m.name not in NOT_SCENARIOS)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("usage: python -m bench NAME [args]   (NAME: " + ", ".join(scenarios() + ["report", "figures"]) + ")")
        return 0
    name, rest = argv[0], argv[1:]
    # `timeout` sends SIGTERM: unwind, so every scenario's finally stops its daemons and workers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if name == "figures":
        return importlib.import_module("bench.figures").main(rest) or 0
    if name != "report" and name not in scenarios():
        print(f"unknown benchmark {name!r}; known: {', '.join(scenarios())}", file=sys.stderr)
        return 2
    return importlib.import_module(f"bench.{name}").main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
