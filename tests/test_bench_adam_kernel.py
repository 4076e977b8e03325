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
    (["--tiny", "--variants", "1000x8"], "--variants takes BxP[xW][nh][rR]"),
    (["--tiny", "--variants", "1024x8x3"], "--variants takes BxP[xW][nh][rR]"),
    (["--tiny", "--variants", "1024x8nhr300"], "--variants takes BxP[xW][nh][rR]"),
    (["--tiny", "--variants", "1024x8,"], "--variants takes BxP[xW][nh][rR]"),
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


def test_variant_specs_name_block_programs_warps_hints_and_registers():
    assert adam_kernel.parse_variants("1024x8, 2048x3x8nhr80,512x4nh") == [
        (1024, 8, 4, True, None), (2048, 3, 8, False, 80), (512, 4, 4, False, None)]
    assert adam_kernel.variant(2048, 3, 80, 8, False) == "anchored_ring_block2048_pps3_w8_nohints_regs80"
    assert adam_kernel.variant(1024, 8, 64) == "anchored_ring_block1024_pps8_regs64"
