"""The daemon's bookkeeping as plain Python: arena packing, registry decisions, journal commits."""
from __future__ import annotations

import random

import pytest

from gpu_anchor.daemon.arena import ALIGN, Arena
from gpu_anchor.daemon.journal import Journal, JournalError, VersionMismatch
from gpu_anchor.daemon.registry import ConflictError, OutOfMemory, Registry

MiB = 1 << 20
GRAN = 2 * MiB


class FakeBackend:
    """Counts live segments so tests can see leaks; can be told to run out of memory."""

    def __init__(self, capacity: int = 1 << 40) -> None:
        self.live: dict[int, int] = {}
        self.capacity = capacity
        self._next = 0

    def create(self, size: int) -> int:
        if sum(self.live.values()) + size > self.capacity:
            raise MemoryError("fake backend full")
        self._next += 1
        self.live[self._next] = size
        return self._next

    def release(self, handle: int) -> None:
        del self.live[handle]


def make_registry(capacity: int = 1 << 40):
    be = FakeBackend(capacity)
    return Registry(Arena(be.create, be.release, GRAN)), be


def llm_tensor_set(layers=16, hidden=2048, inter=8192, vocab=128256, kv=512):
    """(name, dtype, shape) of a Llama-3.2-1B-like model in bf16: big matrices and tiny norms."""
    out = [("embed", "bfloat16", [vocab, hidden])]
    for i in range(layers):
        p = f"layers[{i}]"
        out += [(f"{p}.q", "bfloat16", [hidden, hidden]), (f"{p}.k", "bfloat16", [kv, hidden]),
                (f"{p}.v", "bfloat16", [kv, hidden]), (f"{p}.o", "bfloat16", [hidden, hidden]),
                (f"{p}.gate", "bfloat16", [inter, hidden]), (f"{p}.up", "bfloat16", [inter, hidden]),
                (f"{p}.down", "bfloat16", [hidden, inter]),
                (f"{p}.in_norm", "bfloat16", [hidden]), (f"{p}.post_norm", "bfloat16", [hidden])]
    out.append(("norm", "bfloat16", [hidden]))
    return out


def as_requests(specs):
    return [{"name": n, "dtype": d, "shape": s} for n, d, s in specs]


def test_llm_shaped_set_costs_under_one_percent_and_few_segments():
    reg, be = make_registry()
    specs = llm_tensor_set()
    # add a few hundred odd-sized small tensors (biases, scales) too
    specs += [(f"extra[{i}]", "float32", [random.Random(i).randint(1, 5000)]) for i in range(300)]
    reg.bind("job", as_requests(specs))
    used = reg.object_bytes()
    reserved = reg.arena.reserved_bytes()
    assert reserved == sum(be.live.values())
    assert (reserved - used) / used <= 0.01, (reserved, used)
    assert len(reg.arena.segments) <= 4  # ~2.5 GB packed into 1 GiB segments


def test_many_small_objects_pack_into_few_segments():
    reg, _ = make_registry()
    reg.bind("job", as_requests([(f"norm{i}", "float32", [1024]) for i in range(1000)]))
    assert len(reg.arena.segments) == 1  # 1000 × 4 KiB = 4000 KiB → one 4 MiB segment
    reg.bind("job", as_requests([(f"late{i}", "float32", [10]) for i in range(40)]))
    assert len(reg.arena.segments) == 1  # later small objects fill the rounding slack


def test_odd_sized_large_tensors_waste_under_one_percent():
    reg, _ = make_registry()
    # 1600×1600 fp32 = 9.77 MiB: one segment each would round every one up to 10 MiB
    reg.bind("job", as_requests([(f"w{i}", "float32", [1600, 1600]) for i in range(40)]
                                + [(f"b{i}", "float32", [1600]) for i in range(40)]))
    used, reserved = reg.object_bytes(), reg.arena.reserved_bytes()
    assert (reserved - used) / used <= 0.01 and len(reg.arena.segments) == 1


def test_match_create_conflict_and_batch_atomicity():
    reg, be = make_registry()
    (status, a), = reg.bind("job", as_requests([("a", "float32", [4, 4])]))
    assert status == "created"
    (status, a2), = reg.bind("job", as_requests([("a", "float32", [4, 4])]))
    assert status == "matched" and a2 is a
    before = dict(be.live)
    with pytest.raises(ConflictError) as e:
        reg.bind("job", as_requests([("b", "float32", [8]), ("a", "bfloat16", [16])]))
    assert "'a'" in str(e.value) and "float32[4, 4]" in str(e.value) and "bfloat16[16]" in str(e.value)
    assert "b" not in reg.namespaces["job"].objects and be.live == before  # nothing changed
    (status, a3), = reg.bind("job", as_requests([("a", "bfloat16", [16])]), policy="replace")
    assert status == "created" and a3.generation > a.generation
    (status, none), = reg.bind("job", as_requests([("zz", "float32", [1])]), policy="lookup")
    assert status == "missing" and none is None and "zz" not in reg.namespaces["job"].objects


def test_out_of_memory_mid_batch_rolls_back():
    reg, be = make_registry(capacity=8 * MiB)
    reg.bind("job", as_requests([("keep", "float32", [MiB // 4])]))
    before = dict(be.live)
    with pytest.raises(OutOfMemory):
        reg.bind("job", as_requests([("x", "float32", [MiB]), ("y", "float32", [4 * MiB])]))
    assert be.live == before and set(reg.namespaces["job"].objects) == {"keep"}


def test_free_with_generation_spares_a_recreated_object():
    reg, _ = make_registry()
    (_, old), = reg.bind("job", as_requests([("a", "float32", [4])]))
    reg.bind("job", as_requests([("a", "float32", [8])]), policy="replace")
    assert reg.free("job", [["a", old.generation]]) == []  # a late free of the old incarnation
    assert "a" in reg.namespaces["job"].objects
    assert reg.free("job", ["a"]) == ["a"]


def test_object_table_version_changes_with_the_table_and_never_repeats():
    reg, _ = make_registry(capacity=8 * MiB)
    seen = [reg.namespace("job").version]

    def changed():
        v = reg.namespaces["job"].version
        assert v not in seen, "a new table gets a version never seen before"
        seen.append(v)

    def same():
        assert reg.namespaces["job"].version == seen[-1]
    reg.bind("job", as_requests([("a", "float32", [4])]))
    changed()
    reg.bind("job", as_requests([("a", "float32", [4])]))  # matched
    same()
    reg.bind("job", as_requests([("zz", "float32", [1])]), policy="lookup")  # missing
    same()
    with pytest.raises(OutOfMemory):  # rolled back: nothing changed
        reg.bind("job", as_requests([("x", "float32", [4 * MiB])]))
    same()
    reg.bind("job", as_requests([("a", "float32", [8])]), policy="replace")
    changed()
    assert reg.free("job", ["nope"]) == []
    same()
    reg.free("job", ["a"])
    changed()
    reg.drop("job")
    reg.namespace("job")  # re-created after the drop: still a version never used
    changed()


def test_random_alloc_free_returns_every_segment():
    reg, be = make_registry()
    rng = random.Random(0)
    live = set()
    for i in range(5000):
        if live and rng.random() < 0.45:
            name = rng.choice(sorted(live))
            reg.free("job", [name])
            live.discard(name)
        else:
            size = rng.choice([1, 7, 300, 4096, 70_000, 600_000, 3_000_000])
            reg.bind("job", as_requests([(f"t{i}", "uint8", [size])]))
            live.add(f"t{i}")
        if i % 500 == 0:  # invariant: extents never overlap and stay inside their segment
            for seg in reg.arena.segments.values():
                spans = sorted(seg.free + [(o.offset, Arena.footprint(o.nbytes))
                                           for o in reg.namespaces["job"].objects.values() if o.segment == seg.id])
                pos = 0
                for off, length in spans:
                    assert off == pos and off % ALIGN == 0
                    pos = off + length
                assert pos == seg.size
    reg.free("job", sorted(live))
    assert be.live == {} and reg.arena.segments == {}


def test_drop_namespace_frees_all_and_journal():
    reg, be = make_registry()
    reg.bind("a", as_requests([("x", "float32", [100])]))
    reg.bind("b", as_requests([("x", "float32", [100])]))
    reg.namespace("a").journal.commit({"k": b"v"})
    assert reg.drop("a") == 1
    assert "a" not in reg.namespaces and len(be.live) == 1


@pytest.mark.parametrize("bad", [
    [{"name": "", "dtype": "float32", "shape": [1]}],
    [{"name": "x", "dtype": "float33", "shape": [1]}],
    [{"name": "x", "dtype": "float32", "shape": [-1]}],
    [{"name": "x", "dtype": "float32", "shape": "12"}],
    [{"name": "x", "dtype": "float32", "shape": [True]}],
    [{"name": "x", "dtype": "float32", "shape": [1]}, {"name": "x", "dtype": "float32", "shape": [1]}],
    ["x"], "x",
])
def test_bad_requests_are_rejected_before_any_change(bad):
    reg, be = make_registry()
    with pytest.raises(ValueError):
        reg.bind("job", bad)
    assert be.live == {}


def test_journal_atomic_commit_versions_and_limits():
    j = Journal()
    assert j.commit({"cursor": b"0", "step": b"1"}) == 1
    assert j.commit({"cursor": b"1"}, deletes=["step"], expect_version=1) == 2
    assert j.get() == {"cursor": b"1"}
    with pytest.raises(VersionMismatch):
        j.commit({"cursor": b"9"}, expect_version=1)
    with pytest.raises(JournalError):
        j.commit({"": b"x"})
    assert j.get() == {"cursor": b"1"} and j.version == 2
    assert j.get(prefix="cur") == {"cursor": b"1"} and j.get(keys=["nope"]) == {}
