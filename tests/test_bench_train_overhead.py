"""``bench train_overhead --profile`` on this CPU machine: the toy run profiles each mode, sorts
device (here aten) time into kinds of kernel and reports the anchored step's difference per kind.
No timing is asserted."""
import gc
import json
from pathlib import Path

import pytest

from bench import train_overhead as T

CUDA_NAMES = {   # kernel names as torch.profiler reports them on the H200
    "adam_ring": "fused Adam + undo (Triton)",
    "adam_undo": "fused Adam + undo (Triton)",          # its name before the undo ring
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "FusedAdamMathFunctor<c10::BFloat16, 4, (at::native::ADAM_MODE)1, false>>": "optimizer (torch)",
    "nvjet_tst_192x192_64x4_1x2_h_bz_coopA_NNT": "matmul",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>": "attention",
    "void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda()#3}::operator()() const::{lambda(c10::BFloat16)#1}>": "copies",
    "Memcpy DtoD (Device -> Device)": "copies",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>>": "fills and zeroing",
    "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>": T.kind("x"),
}


@pytest.mark.parametrize("name", list(CUDA_NAMES))
def test_kernel_kinds(name):
    assert T.kind(name) == CUDA_NAMES[name]


def test_profile_of_the_tiny_run_adds_up(tmp_path):
    args = ["--tiny", "--steps", "2", "--warmup", "1", "--rounds", "1", "--out", str(tmp_path)]
    assert T.main(args) == 0 and T.main(args + ["--profile", "2"]) == 0
    unprofiled = json.loads((tmp_path / "train_overhead_tiny.json").read_text())
    r = json.loads((tmp_path / "train_overhead_profile_tiny.json").read_text())
    p = r["profile"]
    assert set(p) == {"plain", "anchored", "anchored_minus_plain_ms"}      # no fused twins on a CPU
    for mode in ("plain", "anchored"):
        assert p[mode]["busy_ms_per_step"] == pytest.approx(sum(p[mode]["by_kind_ms"].values()))
        assert p[mode]["busy_ms_per_step"] > 0 and p[mode]["wall_ms_per_step"] > 0
        assert p[mode]["top"] and all(t["kind"] == T.kind(t["name"]) for t in p[mode]["top"])
    d = p["anchored_minus_plain_ms"]
    assert d["busy"] == pytest.approx(p["anchored"]["busy_ms_per_step"] - p["plain"]["busy_ms_per_step"])
    assert d["matmul"] == pytest.approx(p["anchored"]["by_kind_ms"].get("matmul", 0)
                                        - p["plain"]["by_kind_ms"].get("matmul", 0))
    # the profiled steps do not count in the timed figures' protocol statistics
    assert r["commits_per_step"] == unprofiled["commits_per_step"] > 0
    assert d["kernels"] == p["anchored"]["kernels_per_step"] - p["plain"]["kernels_per_step"]
    assert p["anchored"]["kernels_per_step"] > p["plain"]["kernels_per_step"] > 0   # + the undo copies
    text = T.render(r)
    assert "| kind | plain | anchored | anchored minus plain |" in text and "| busy (sum) |" in text
    assert "| kernels a step |" in text
    # the garbage collector's time in the timed windows, per mode, beside the mean step
    assert set(unprofiled["gc_ms_per_step"]) == set(unprofiled["gc_full_passes"]) == {"plain", "anchored"}
    for mode, windows in unprofiled["gc_full_passes_windows"].items():      # by window, as the steps
        assert len(windows) == len(unprofiled[f"step_s_{mode}_windows"]) == len(unprofiled["gc_ms_windows"][mode])
        assert sum(windows) == unprofiled["gc_full_passes"][mode]
    assert set(unprofiled["step_s_mean"]) == {"plain", "anchored"} and "step_overhead_vs_fastest_plain_mean_pct" in unprofiled
    assert "garbage collector" in T.render(unprofiled) and "The host, by window" in T.render(unprofiled)
    # the setup's garbage is collected before the first timed window; the allocator's counts are CUDA's
    assert unprofiled["gc_collected_before_rounds"] is True and "allocator_windows" not in unprofiled
    for mode, h in unprofiled["host_windows"].items():      # the host's side, by window
        assert len(h["host_fwd_ms"]) == len(h["host_bwd_ms"]) == len(unprofiled[f"step_s_{mode}_windows"])
        assert all(x > 0 for x in h["host_fwd_ms"] + h["host_bwd_ms"])
        assert h["host_lead_ms_min"] == h["host_lead_ms_median"] == [None]     # no device to lead on a CPU


def test_host_forward_times_each_mode_with_the_device_idle(tmp_path):
    args = ["--tiny", "--steps", "1", "--warmup", "1", "--rounds", "1", "--host-forward", "3", "--out", str(tmp_path)]
    assert T.main(args) == 0
    r = json.loads((tmp_path / "train_overhead_hostfwd_tiny.json").read_text())
    assert set(r["host_forward_ms"]) == {"plain", "anchored"}
    assert all(len(v) == 3 and min(v) > 0 for v in r["host_forward_ms"].values())
    assert "The forward's own host time" in T.render(r)
    prof = r["host_forward_profile_anchored"]          # the anchored forward's Python, by own time
    assert prof and [e["own_ms_per_step"] for e in prof] == sorted((e["own_ms_per_step"] for e in prof), reverse=True)
    assert prof[0]["own_ms_per_step"] > 0 and all(e["calls_per_step"] > 0 and e["cum_ms_per_step"] >= e["own_ms_per_step"] for e in prof)
    assert any(e["function"].startswith("module.py:") for e in prof)     # nn.Module's own calls are in it
    assert "Where the anchored forward's host time goes" in T.render(r)
    for timed in ("host_step_ms", "host_backward_ms"):
        assert set(r[timed]) == {"plain", "anchored"} and all(len(v) == 3 and min(v) > 0 for v in r[timed].values())
    assert "The host's own time a step" in T.render(r)
    steps = r["host_step_profile_anchored"]              # ... and step()'s, apart
    assert steps and not any("modeling_llama" in e["function"] for e in steps)     # no forward in it
    assert "`step()`'s own host time" in T.render(r) and "Where the anchored `step()`'s host time goes" in T.render(r)
    with pytest.raises(SystemExit):
        T.main(["--tiny", "--host-forward", "-1", "--out", str(tmp_path)])


def test_allocator_counts_by_window_are_rendered():
    assert T._allocator_counts("cpu") == dict.fromkeys(T._ALLOCATOR_COUNTS, 0)
    counts = {"num_device_alloc": [3, 0], "num_device_free": [1, 0], "num_alloc_retries": [1, 0],
              "num_sync_all_streams": [1, 0]}
    stored = Path(__file__).parent.parent / "bench" / "results" / "train_overhead_short_lendall_shipped_1.json"
    r = json.loads(stored.read_text())
    r["allocator_windows"] = {"plain": counts, "anchored": counts}
    text = T.render(r)
    assert "calls to the driver" in text and "plain 3/1/1, 0/0/0; anchored 3/1/1, 0/0/0" in text


def test_gc_clock_counts_passes_by_generation():
    clock = T._GcClock()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        clock.close()
    assert clock.passes[0] >= 1 and clock.passes[2] >= 1 and clock.ms[2] > 0
    assert clock._tick not in gc.callbacks


class _Avg:      # one row of ``torch.profiler.profile.key_averages()``, as much of it as by_kernel reads
    def __init__(self, key, us, count, annotation=False):
        self.key, self.count, self.is_user_annotation = key, count, annotation
        self.device_type, self.self_device_time_total = "DeviceType.CUDA", us


class _Prof:
    def __init__(self, rows):
        self.rows = rows

    def key_averages(self):
        return self.rows


def test_device_annotations_are_not_counted_as_kernels():
    """torch draws ``Optimizer.step#AdamW.step`` on the device timeline over the kernels the step
    launched (H200, 2026-12-03: 6.46 ms beside the 6.36 ms of its one kernel): not a kernel."""
    from bench.step_profile import by_kernel
    rows = by_kernel(_Prof([_Avg("Optimizer.step#AdamW.step", 6460.0, 1, annotation=True),
                            _Avg("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 6360.0, 60),
                            _Avg("Memcpy DtoD (Device -> Device)", 0.0, 3)]), steps=1, cuda=True)
    assert rows == [("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 6.36, 60.0)]


def test_profile_refuses_a_negative_count(tmp_path, capsys):
    with pytest.raises(SystemExit):
        T.main(["--tiny", "--profile", "-1", "--out", str(tmp_path)])
    assert "--profile" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_train_peak_finds_the_blocks_alive_at_the_peak():
    """``bench train_peak``'s analysis of an allocator trace: the peak is the largest total above
    the start, the blocks alive there are grouped by the Python line that made them, and a
    block without one is the backward engine's."""
    from bench.train_peak import BACKWARD, analyse
    fr = lambda line: [{"filename": "/x/torch/autograd/graph.py", "line": 1, "name": "hook"},  # noqa: E731
                       {"filename": "/x/model.py", "line": line, "name": "forward"}]
    mib = 2**20
    trace = [{"action": "alloc", "addr": 1, "size": 100 * mib, "frames": fr(10)},
             {"action": "alloc", "addr": 2, "size": 300 * mib, "frames": fr(20)},
             {"action": "free_completed", "addr": 1, "size": 100 * mib},
             {"action": "alloc", "addr": 3, "size": 250 * mib, "frames": []},
             {"action": "alloc", "addr": 4, "size": 50 * mib, "frames": fr(20)},
             {"action": "free_completed", "addr": 3, "size": 250 * mib},
             {"action": "alloc", "addr": 5, "size": 200 * mib, "frames": fr(30)}]
    r = analyse(trace)
    assert r["peak_bytes"] == 600 * mib and r["peak_event"] == 4 and r["alive_blocks"] == 3
    assert r["alive_by_site_mib"] == {"model.py:20:forward": 350.0, BACKWARD: 250.0}
    assert [b["site"] for b in r["largest_alive_mib"]] == ["model.py:20:forward", BACKWARD, "model.py:20:forward"]
    assert analyse([])["peak_bytes"] == 0


def test_no_l2_hints_is_recorded_and_set_back(tmp_path):
    from gpu_anchor.train import fused_adam
    args = ["--tiny", "--steps", "1", "--warmup", "1", "--rounds", "1", "--no-l2-hints", "--out", str(tmp_path)]
    assert T.main(args) == 0
    r = json.loads((tmp_path / "train_overhead_nohints_tiny.json").read_text())
    assert r["l2_hints"] is False and fused_adam.L2_HINTS is True
