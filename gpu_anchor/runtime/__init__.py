"""The process runtime: the one way gpu-anchor forks a worker, an engine or a standby.

    pid = runtime.fork(lambda: serve(), new_process_group=True)   # parent: the child's pid
    sb = runtime.Standby(prepare, run)                            # a pre-started process
    runtime.wait_exit(pid, timeout)                               # sleep on a pidfd until it exits
    runtime.wait_any(pids, timeout)                               # the first of several to exit

What every fork here does, in one place (docs/runtime.md):

- **before**: refuse to fork while a thread other than the caller runs — a Python thread, or
  a native thread no library stops for the fork (``threads.foreign_threads``: a lock it holds,
  or a pool's bookkeeping, would be copied into a child that lacks the thread), or once torch
  initialised CUDA here (the child could make no CUDA call, and torch's optimizers make one) — then
  ``gc.freeze()``: what the parent built is never collected or finalised in the child;
- **in the child** (``after_fork_in_child``): default signal dispositions, a new process group
  if asked, ``PR_SET_PDEATHSIG`` (it dies with its parent), faulthandler on (SIGABRT, SIGSEGV,
  ... print every thread's stack; SIGUSR1 prints them and goes on), torch's CPU thread pool
  rebuilt on the child's only thread before anything else can start one;
- **exit path** (``exit_path``): exit status as ``python`` would give it (SystemExit codes,
  traceback and 1 on an exception), then non-daemon threads, atexit and stdio flush, then
  ``os._exit`` — never the parent's finalisers, never a return into the parent's stack.

Torch-free: torch is touched only if the process already imported it.
"""
from .fork import ForkUnsafe, after_fork_in_child, exit_path, fork, install_stack_dumps, set_pdeathsig
from .standby import Standby, wait_any, wait_exit
from .threads import foreign_threads, os_threads

__all__ = ["ForkUnsafe", "Standby", "after_fork_in_child", "exit_path", "foreign_threads", "fork", "install_stack_dumps",
           "os_threads",
           "set_pdeathsig", "wait_any", "wait_exit"]
