"""``gpu-anchor run`` checkpoint and restore modes, end to end with real daemons: the
default concurrent checkpoint (the job runs on while it copies) restored on demand after
a daemon SIGKILL, and the stop-the-world mode; each run bit-identical to a fault-free one."""
from __future__ import annotations

import pytest
import torch

from test_launch_supervisor import job, result, run


@pytest.mark.parametrize("modes", [["--restore-mode", "on_demand"],
                                   pytest.param(["--checkpoint-mode", "stop-the-world"], marks=pytest.mark.slow)],
                         ids=["concurrent+on_demand", "stw+full"])
def test_daemon_killed_restores_a_checkpoint_taken_in_each_mode(reference, clean_daemons, tmp_path, modes):
    run(str(tmp_path), ["--checkpoint-dir", "ckpt", "--checkpoint-every", "10", "--checkpoint-keep", "1000",
                        "--chaos-kills", "1", "--chaos-target", "daemon", "--chaos-kill-every", "0.6", *modes],
        ["--out", "r.pt", "--step-sleep", "0.01"])
    rs = job(clean_daemons)["restarts"]
    assert len(rs) == 1 and (rs[0]["action"], rs[0]["kind"]) == ("restore", "destructive")
    assert torch.equal(result(tmp_path / "r.pt"), reference[1])
