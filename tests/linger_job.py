"""examples/demo_train.py, whose first worker dies the way a SIGKILLed worker with a slow
teardown does: at step ``LINGER_AT_STEP`` its main thread ends (the kernel releases the robust
mutexes it holds, as at the start of a SIGKILL's teardown) while the process lives on until
the next generation's worker has started its user code (it writes ``LINGER_MARK``), then the
process is SIGKILLed.  With early start the successor must run up to its start gate while the
old process lives, and send no request past ``hello`` before it has exited."""
from __future__ import annotations

import ctypes
import os
import platform
import signal
import sys
import threading
import time

from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import demo_train  # noqa: E402

SYS_EXIT = {"x86_64": 60, "aarch64": 93}[platform.machine()]   # exit(2): this thread only
MARK, AT = os.environ["LINGER_MARK"], int(os.environ["LINGER_AT_STEP"])
FIRST = os.environ.get("GPU_ANCHOR_RESTART_COUNT", "0") == "0"
if not FIRST:
    with open(f"{MARK}.{os.environ['GPU_ANCHOR_RESTART_COUNT']}", "w") as f:
        f.write(f"{os.getpid()} {time.time()}")
steps = 0


def linger() -> None:
    deadline = time.monotonic() + 120
    while not os.path.exists(f"{MARK}.1") and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)
    with open(f"{MARK}.old", "w") as f:
        f.write(f"{os.getpid()} {time.time()}")
    os.kill(os.getpid(), signal.SIGKILL)


def after_step(opt, args, kwargs) -> None:
    global steps
    steps += 1
    if FIRST and steps == AT:
        threading.Thread(target=linger).start()
        ctypes.CDLL(None).syscall(SYS_EXIT, 0)     # ctypes lets go of the GIL first


register_optimizer_step_post_hook(after_step)
sys.exit(demo_train.main())
