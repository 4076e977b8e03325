"""``tests/preloaded.py`` runs a command as ``subprocess`` would: the same output, exit status,
``sys.argv``, ``sys.path``, working directory and environment as a cold interpreter's, for a
script, a module and code; signals and timeouts as ``subprocess``'s; cold where it must be."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import preloaded

PROBE = ("import json, os, sys; import torch\n"
         "print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], 'cwd': os.getcwd(), 'x': os.environ.get('PROBE_X'),"
         " 'threads': torch.get_num_threads(), 'main': __name__}))\n"
         "sys.stderr.write('to stderr\\n')\n"
         "sys.exit(int(os.environ.get('PROBE_RC', '0')))\n")

pytestmark = pytest.mark.skipif(os.environ.get("GPU_ANCHOR_TEST_COLD") == "1" or preloaded._cuda_build(),
                                reason="preloaded.py runs every command cold here (its docstring says when)")


def _both(cmd, **kw):
    cold = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
    warm = preloaded.run(cmd, timeout=120, **kw)
    return cold, warm


@pytest.mark.parametrize("form", ["path", "module", "code"])
def test_it_runs_as_a_cold_interpreter_does(tmp_path, form):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    target = {"path": [str(tmp_path / "probe_mod.py")], "module": ["-m", "probe_mod"], "code": ["-c", PROBE]}[form]
    env = {**os.environ, "PROBE_X": "given", "PROBE_RC": "3", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.path.dirname(os.path.dirname(__file__))])}
    cold, warm = _both([sys.executable, *target, "a", "b"], env=env, cwd=tmp_path)
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr) == \
        (3, cold.stdout, "to stderr\n")
    assert '"threads": 1' in warm.stdout and '"main": "__main__"' in warm.stdout
    assert type(preloaded._servers[preloaded.TORCH]).__name__ == "_Server"       # it did run warm


def test_exceptions_signals_and_timeouts_as_subprocess_reports_them():
    raised = preloaded.run([sys.executable, "-c", "raise ValueError('named')"], timeout=60)
    assert raised.returncode == 1 and "ValueError: named" in raised.stderr
    killed = preloaded.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], timeout=60)
    assert killed.returncode == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        preloaded.run([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], timeout=3)


def test_popen_pipes_signals_and_keyboard_interrupt(tmp_path):
    code = ("import sys, time\nprint('up', flush=True)\ntry:\n    time.sleep(60)\n"
            "except KeyboardInterrupt:\n    print('interrupted', flush=True)\n    sys.exit(7)\n")
    p = preloaded.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout.readline() == "up\n" and p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    p.send_signal(signal.SIGINT)
    assert p.wait(60) == 7 and p.stdout.read() == "interrupted\n"
    with open(tmp_path / "log", "wb") as log:
        q = preloaded.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.DEVNULL, stderr=log)
        time.sleep(0.2)
        q.terminate()
        assert q.wait(60) == -signal.SIGTERM


def test_what_the_preloaded_modules_read_at_import_runs_cold():
    env = {**os.environ, "PYTHONWARNINGS": "error::DeprecationWarning"}
    assert not preloaded._server(preloaded.TORCH).fits(env)
    out = preloaded.run([sys.executable, "-c", "import sys; print(sys.warnoptions)"], env=env, timeout=60)
    assert out.stdout.strip() == "['error::DeprecationWarning']"
    assert isinstance(preloaded.Popen([sys.executable, "-c", "pass"], env=env), subprocess.Popen)


def test_a_server_started_from_a_thread_outlives_it():
    """PR_SET_PDEATHSIG follows the thread that started a process: the server watches the test
    process instead, so one first used from a test's helper thread still serves afterwards."""
    import threading
    preload = ("torch", "json")
    done = []
    t = threading.Thread(target=lambda: done.append(preloaded.run([sys.executable, "-c", "print(1)"], timeout=120,
                                                                   preload=preload)))
    t.start()
    t.join()
    assert done[0].stdout == "1\n"
    server = preloaded._servers[preload]
    time.sleep(0.5)
    again = preloaded.run([sys.executable, "-c", "print(2)"], timeout=60, preload=preload)
    assert again.stdout == "2\n" and preloaded._servers[preload] is server and server.proc.poll() is None
