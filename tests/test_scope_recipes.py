"""Interception + recipes without a daemon: every placeholder's replayed contents, and the
generator state afterwards, equal a run without gpu-anchor (same seed), bit for bit."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from gpu_anchor.scope.interception import ScopeMode, suspended
from gpu_anchor.scope.placeholders import Placeholder, real_view


def _replay_all(mode: ScopeMode, values):
    """Evaluate every placeholder in ``values`` (a flat list) as the exit path would."""
    stores = {id(v._ga_store): v._ga_store for v in values if isinstance(v, Placeholder)}
    out = mode.recorder.evaluate({s: None for s in stores.values()}, advance_pending=True)
    return [real_view(out[v._ga_store], v._ga_meta) if isinstance(v, Placeholder) else v for v in values]


def _check(build, anchored=lambda d: d == "cpu"):
    """Run ``build`` natively and under a ScopeMode; compare results and the RNG afterwards."""
    torch.manual_seed(1234)
    ref = build()
    ref_after = torch.rand(8)
    torch.manual_seed(1234)
    mode = ScopeMode(anchored)
    with mode:
        got = build()
    mode.got = got
    real = _replay_all(mode, got)
    after = torch.rand(8)
    for r, g in zip(ref, real):
        assert r.shape == g.shape and r.dtype == g.dtype and r.stride() == g.stride()
        assert torch.equal(r, g), (r, g)
    assert torch.equal(ref_after, after), "generator state after the scope differs"
    return mode


def test_factories_are_bit_identical():
    def build():
        t = torch.empty(3, 5)
        return [torch.zeros(3, 4), torch.ones(2, dtype=torch.int32), torch.full((2, 3), 7.5),
                torch.rand(17, 3), torch.randn(33), torch.randn(5, dtype=torch.float64),
                torch.randint(3, 9, (4, 4)), torch.randint(5, (6,)), torch.rand(4, dtype=torch.bfloat16),
                torch.zeros_like(t), torch.ones_like(t), torch.full_like(t, 2.0), torch.rand_like(t),
                torch.randn_like(t), torch.randint_like(t, 10), t.new_zeros(2, 2), t.new_ones(3),
                t.new_full((2,), 4.0), torch.arange(10), torch.linspace(0, 1, 7), torch.eye(3),
                torch.tensor([1.5, 2.5]), torch.tensor([[1, 2], [3, 4]])]
    mode = _check(build)
    assert all(isinstance(g, Placeholder) for g in mode.got)


def test_nn_init_and_modules():
    def build():
        lin, emb, ln = nn.Linear(6, 4), nn.Embedding(9, 4, padding_idx=2), nn.LayerNorm(4)
        conv = nn.Conv2d(2, 3, 3)
        w = [torch.empty(5, 7) for _ in range(8)]
        nn.init.xavier_uniform_(w[0]); nn.init.xavier_normal_(w[1]); nn.init.kaiming_normal_(w[2])
        nn.init.trunc_normal_(w[3], std=0.02); nn.init.orthogonal_(w[4]); nn.init.eye_(w[5])
        nn.init.constant_(w[6], 0.3); nn.init.sparse_(w[7], 0.5)
        return [*lin.parameters(), *emb.parameters(), *ln.parameters(), *conv.parameters(), *w]
    _check(build)


def test_views_copies_and_inplace_chains():
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)   # real, made outside the scope

    def build():
        a = torch.zeros(4, 6)
        a[1:3].normal_()              # in-place on a view
        a.t()[0].fill_(5)             # strided view
        b = src.clone()               # copy-type: buffered at interception
        c = src.to(torch.float64) * 2 + 1
        d = torch.randn(4, 6).mul_(3).add_(a)   # reads another placeholder
        e = b[1]                      # a view kept alive
        return [a, b, c, d, e]
    mode = _check(build)
    assert mode.eager_evaluations == 0


def test_real_source_is_held_by_reference_and_copied_before_a_write():
    src = torch.ones(3)
    torch.manual_seed(0)
    mode = ScopeMode(lambda d: d == "cpu")
    with mode:
        x = torch.empty(3)
        x.copy_(src)                  # held by reference: no copy made here
        assert not mode._held or all(h.t is src for hs in mode._held.values() for h in hs)
        src.fill_(9)                  # a later write in the block: the mode copies the source first
        y = torch.empty(3)
        y.copy_(src)
    assert torch.equal(_replay_all(mode, [x, y])[0], torch.ones(3))
    assert torch.equal(_replay_all(mode, [x, y])[1], torch.full((3,), 9.0))


def test_a_write_the_dispatcher_never_saw_is_refused_at_replay():
    src = torch.ones(3)
    mode = ScopeMode(lambda d: d == "cpu")
    with mode:
        x = torch.empty(3)
        x.copy_(src)
    src.fill_(9)                      # outside the mode: only the version counter shows it
    with pytest.raises(RuntimeError, match="modified in place"):
        _replay_all(mode, [x])


def test_eager_read_returns_true_values_and_keeps_rng():
    def build():
        w = torch.randn(4, 4)
        s = torch.tensor(float(w.sum()))     # .item(): forces an evaluation inside the scope
        v = torch.randn(3)
        return [w, s, v]
    mode = _check(build)
    assert mode.eager_evaluations >= 1


def test_native_random_op_interleaved_and_reseed_inside_scope():
    def build():
        a = torch.randn(20)
        with suspended():
            r = torch.rand(5)                # native: must see the generator after ``a``
        b = torch.randn(7)
        torch.manual_seed(99)                # reseeding inside the scope
        c = torch.rand(6)
        return [a, r, b, c]
    _check(build)


def test_non_anchored_device_is_untouched():
    def build():
        return [torch.randn(3), nn.Linear(2, 2).weight]
    mode = _check(build, anchored=lambda d: False)
    assert not mode.stores


def test_dead_temporaries_still_consume_rng():
    def build():
        torch.randn(100)                     # dies inside the scope
        return [torch.rand(3)]
    _check(build)


def test_parameter_placeholder_keeps_metadata():
    mode = ScopeMode(lambda d: True)
    with mode:
        lin = nn.Linear(3, 5)
    w = lin.weight
    assert isinstance(w, nn.Parameter) and isinstance(w, Placeholder)
    assert w.shape == (5, 3) and w.requires_grad and w.device.type == "cpu" and w.is_contiguous()
    with pytest.raises(RuntimeError, match="outside its managed_scope"):
        w + 1
