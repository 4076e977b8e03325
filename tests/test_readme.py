"""Every code block in README.md runs, exactly as written, in README order.

Blocks are extracted from the file: ``bash`` blocks run with ``bash -e``, ``python`` blocks
with the test's interpreter (a block whose first line is ``# NAME.py`` is saved as that file
first, so later blocks can run it); ``text`` blocks are not code.  Any other fence fails the
test, so nothing escapes it.  They run in a fresh directory, with this checkout first on
``PYTHONPATH``, the venv's scripts first on ``PATH`` and a private daemon directory.

One exception, said here rather than hidden: the first block's ``make test`` would run this
very suite from inside it, so it is checked with ``make -n test`` (the target exists and
builds the venv); ``make demo`` runs for real.  A ``# NAME.py`` block that a later block runs
(``timeout -s KILL 6 python train.py || python train.py``) is only saved: its first run is the
later block's, so the kill there can land in the middle of training.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.S | re.M)


def blocks() -> list[tuple[str, str]]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return [(m.group(1), m.group(2)) for m in FENCE.finditer(f.read())]


def test_every_fence_is_labelled():
    kinds = {k for k, _ in blocks()}
    assert kinds <= {"bash", "python", "text"}, f"label README's code blocks bash, python or text: {kinds}"


def test_readme_blocks_run_as_written(tmp_path):
    pytest.importorskip("transformers")
    sock = tmp_path / "sock"
    sock.mkdir(mode=0o700)
    env = {**os.environ, "GPU_ANCHOR_SOCKET_DIR": str(sock),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    env.pop("GPU_ANCHOR_SOCKET", None)
    work = tmp_path / "work"
    work.mkdir()
    ran = []
    try:
        for i, (kind, code) in enumerate(blocks()):
            if kind == "text":
                continue
            if kind == "bash" and re.search(r"^make (demo|test)", code, re.M):
                for line in code.splitlines():
                    target = line.split("#")[0].split()
                    if target[:1] != ["make"]:
                        continue
                    cmd = ["make", "-C", ROOT, "-n", *target[1:]] if "test" in target else \
                          ["make", "-C", ROOT, *target[1:]]
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                    assert out.returncode == 0, f"README block {i}: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
                    ran.append(" ".join(target))
                continue
            if kind == "python":
                first = code.splitlines()[0].strip()
                name = first[2:].strip() if re.fullmatch(r"# [\w.-]+\.py", first) else f"readme_block_{i}.py"
                (work / name).write_text(code)
                if any(f"python {name}" in later for _, later in blocks()[i + 1:]):
                    continue          # a file a later block runs (and kills): its first run is that block's
                cmd = [sys.executable, name]
            else:
                cmd = ["bash", "-e", "-c", code]
            out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, f"README block {i} ({kind}) failed:\n{code}\n--- stdout\n" \
                                        f"{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}"
            ran.append(kind)
            if "|| python train.py" in code:
                assert "done at step 100" in out.stdout, out.stdout[-2000:]
    finally:
        subprocess.run([sys.executable, "-m", "gpu_anchor.cli", "stop"], env=env, capture_output=True, timeout=60)
    assert "make demo" in ran and "python" in ran and ran.count("bash") >= 4, ran
