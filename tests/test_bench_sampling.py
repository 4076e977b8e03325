"""``bench sampling`` on this CPU machine: the toy run times every kind of sampling and the
sorted top-p mask, renders, and refuses bad input.  No timing is asserted."""
import json

import pytest

from bench import sampling as B


def test_tiny_run_covers_every_kind_and_renders(tmp_path):
    assert B.main(["--tiny", "--rows", "2,3", "--reps", "2", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "sampling_tiny.json").read_text())
    assert r["vocab"] == 1000 and r["rows"] == [2, 3] and r["top_p_kernel"] is False
    assert set(r["sample_ms"]) == {f"{k}/{b}" for k in B.KINDS for b in (2, 3)}
    assert all(0 < m["min"] <= m["median"] <= m["max"] and m["n"] == 2 for m in r["sample_ms"].values())
    assert set(r["top_p_mask_ms"]) == {"sorted/2", "sorted/3"}       # no kernel without CUDA
    assert set(r["draw_ms"]) == {"tensor ops/2", "tensor ops/3"} and r["launch_shapes_ms"] == {}
    text = B.render(r)
    assert "| top-k 50 + top-p 0.95 |" in text and "| sorted |" in text and "No CUDA/Triton here" in text


@pytest.mark.parametrize("bad", [["--rows", "0"], ["--rows", "a,b"], ["--reps", "0"], ["--launches", "100x4"],
                                 ["--launches", "4096"], ["--launches", "4096x3"]])
def test_bad_arguments_are_refused(bad, tmp_path, capsys):
    with pytest.raises(SystemExit):
        B.main(["--tiny", "--out", str(tmp_path)] + bad)
    err = capsys.readouterr().err
    assert "--r" in err or "--launches" in err
    assert not list(tmp_path.iterdir())
