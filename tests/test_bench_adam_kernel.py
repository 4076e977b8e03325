"""``bench adam_kernel`` on this CPU machine: the smoke size runs the torch variants and says why
the kernel did not run; ``--graph`` (CUDA-graph replays), a chunk count below 1 and a register
cap that is not an integer from 16 to 255 refuse
with an error that says why, and write nothing."""
from __future__ import annotations

import json

import pytest

from bench import adam_kernel


@pytest.mark.parametrize("argv, says", [
    (["--tiny", "--graph"], "--graph needs a CUDA device"),
    (["--tiny", "--chunks", "0"], "--chunks must be >= 1"),
    (["--tiny", "--registers", "64,x"], "--registers takes integers"),
    (["--tiny", "--registers", "8"], "each cap must be from 16 to 255"),
])
def test_refuses_with_a_reason(argv, says, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        adam_kernel.main([*argv, "--out", str(tmp_path)])
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_tiny_runs_the_torch_variants_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert adam_kernel.main(["--tiny", "--reps", "2", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "adam_kernel_tiny.json").read_text())
    assert r["cuda_graph"] is False and r["chunks"] == 2
    assert set(r["ms"]) == {"torch_foreach_adamw", "undo_copy_only"}
    assert r["kernel_unavailable"]
