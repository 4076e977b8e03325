"""``fork``: the one way this project forks; ``after_fork_in_child`` and ``exit_path`` for
children it did not fork itself (torch-free; see the package docstring)."""
from __future__ import annotations

import ctypes
import faulthandler
import gc
import os
import signal
import sys

from .threads import foreign_threads


class ForkUnsafe(RuntimeError):
    """A thread other than the caller runs: the child would inherit its locks held."""


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Die with ``sig`` when the parent exits (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def cuda_initialised() -> bool:
    """Whether this process has initialised CUDA through torch (never initialises it)."""
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.cuda.is_initialized())
    except Exception:
        return False


def check_fork_safe(unsafe_ok: str | None = None) -> None:
    """Raise ``ForkUnsafe`` if a foreign thread runs, or if this process has initialised CUDA.
    ``unsafe_ok``: the caller's reason why forking past the threads is safe anyway (a test
    driver in a busy pytest process whose children touch none of those threads' state); it
    does not cover CUDA, which no child of such a process can use: its first CUDA call fails
    with "CUDA error: initialization error", and torch's optimizers make one even for CPU
    tensors (``step()`` asks whether a graph is being captured)."""
    if cuda_initialised():
        raise ForkUnsafe("refusing to fork: this process has initialised CUDA, and a forked child's first CUDA "
                         "call (torch's optimizers make one even for CPU tensors) fails with 'CUDA error: "
                         "initialization error'; fork from a process that has not touched CUDA (a fork server "
                         "started first), or start the child with subprocess")
    if unsafe_ok:
        return
    bad = foreign_threads()
    if bad:
        raise ForkUnsafe(f"refusing to fork while other threads run: {', '.join(bad)}; fork from a process "
                         "that started none (a fork server started before any thread pool)")


def install_stack_dumps() -> None:
    """A process that hangs or aborts says where: every thread's Python stack on SIGABRT,
    SIGSEGV, SIGBUS, SIGILL, SIGFPE (to stderr), and on SIGUSR1 without dying
    (``kill -USR1 <pid>``: a hung collective)."""
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def after_fork_in_child(*, new_process_group: bool = False, die_with_parent: bool = True,
                        parent_pid: int | None = None, sigint_raises: bool = False,
                        torch_threads: int | None = None) -> None:
    """Everything a forked child sets up before it runs anything else (see the package docstring)."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler if sigint_raises else signal.SIG_DFL)
    if new_process_group:
        os.setpgid(0, 0)
    if die_with_parent:
        set_pdeathsig()
        if parent_pid is not None and os.getppid() != parent_pid:
            os._exit(1)          # the parent died before the death signal was armed
    install_stack_dumps()
    torch = sys.modules.get("torch")
    if torch is not None:
        # torch's CPU thread pool does not survive fork: rebuild it now, on the child's only
        # thread.  Left to the first op, the autograd engine's device threads rebuilt it at
        # once at the first backward and aborted ('Invalid thread pool!', seen on 2 H200s).
        torch.set_num_threads(torch_threads or torch.get_num_threads())


def exit_path(main) -> None:
    """Run ``main()`` as the child's whole life and exit like ``python`` would; never returns.

    The exit status is 0 when ``main`` returns, SystemExit's code, or 1 after printing the
    traceback of any other exception.  What ``main`` returned, or the exception,
    is held until ``os._exit``: a script's globals (and an exception's frames) hold anchored
    tensors, and dropping them before the end would free those objects in the daemon."""
    code, keep = 1, None
    try:
        keep = main()
        code = 0
    except SystemExit as e:
        keep = e
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException as e:
        keep = e
        import traceback
        traceback.print_exc()
        code = 1
    # a normal interpreter exit: non-daemon threads, then atexit, then flush
    try:
        import threading
        threading._shutdown()
    except Exception:
        pass
    try:
        import atexit
        atexit._run_exitfuncs()
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def fork(main, *, new_process_group: bool = False, die_with_parent: bool = True, sigint_raises: bool = False,
         torch_threads: int | None = None, unsafe_ok: str | None = None, before_main=None) -> int:
    """Fork a child that runs ``main()`` through ``exit_path``; returns its pid.

    Raises ``ForkUnsafe`` if another thread runs (``unsafe_ok``: see ``check_fork_safe``).
    ``before_main``: called in the child right after ``after_fork_in_child`` (close the
    parent's sockets, ...).  The parent's objects are frozen out of the child's garbage
    collector (``gc.freeze``); the parent's own collector is unchanged afterwards."""
    check_fork_safe(unsafe_ok)
    parent = os.getpid()
    gc.freeze()
    try:
        pid = os.fork()
    except BaseException:
        gc.unfreeze()
        raise
    if pid == 0:  # pragma: no cover - runs in the child
        def child():
            after_fork_in_child(new_process_group=new_process_group, die_with_parent=die_with_parent,
                                parent_pid=parent, sigint_raises=sigint_raises, torch_threads=torch_threads)
            if before_main is not None:
                before_main()
            return main()
        exit_path(child)
    gc.unfreeze()
    return pid
