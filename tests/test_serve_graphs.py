"""The decode-graph path's bookkeeping and the split, deferred commit, on the CPU.

On the CPU ``cuda_graphs=True`` runs the exact padded static-buffer path of
``cuda_graphs.py`` without capturing (padding rows with slot -1, fixed-width block
tables, the fault hook between the two layer segments); it must equal the eager path
token for token, and survive SIGKILLs like it.  The capture itself is tested on a GPU
(tests/test_serve_gpu.py).
"""
from __future__ import annotations

import random

import pytest

from gpu_anchor.serve import commit as C
from gpu_anchor.serve.cuda_graphs import batch_sizes
from gpu_anchor.serve.engine import Engine, EngineConfig
from gpu_anchor.serve.engine_config import PHASES
from gpu_anchor.serve.sequence import SamplingParams, Sequence, Status, pack_ints, request_record, state_record
from gpu_anchor.testing.tiny import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("graph-models") / "qwen3"), "qwen3", seed=3)


def test_batch_sizes():
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_sizes(12) == [1, 2, 4, 8, 12]
    assert batch_sizes(1) == [1]


def test_padded_static_path_equals_eager(model):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(3, 40))] for _ in range(11)]
    outs, engines = {}, {}
    for graphs in (False, True):
        eng = Engine(EngineConfig(model=model, dtype="float64", block_size=4, num_blocks=256, max_num_seqs=12,
                                  max_batched_tokens=64, anchor=False, cuda_graphs=graphs))
        outs[graphs] = eng.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
        engines[graphs] = eng
    assert outs[True] == outs[False]
    assert engines[True].step_counts["graph"] > 20 and engines[False].step_counts["graph"] == 0
    assert engines[False].graphs is None


def graph_campaign(base: EngineConfig, reqs, seed: int, n_kills: int, n_mid: int) -> dict:
    """Kill engines of config ``base`` (graph decode on) at random steps and phases,
    ``mid_decode`` (between the two layer graphs) first, until every request is done; the
    tokens must equal a fault-free eager run's.  Returns the kills per phase."""
    from test_serve_engine import Client, _run
    ref = Client(reqs)
    code, _ = _run(EngineConfig(**dict(base.__dict__, namespace=base.namespace + "-ref", cuda_graphs=False)), ref)
    assert code == 0 and len(ref.done) == len(reqs)
    rng = random.Random(seed)
    client = Client(reqs)
    kills = {ph: 0 for ph in PHASES}
    while len(client.done) < len(reqs):
        fault = None
        if sum(kills.values()) < n_kills:
            fault = (rng.randint(1, 3), "mid_decode" if kills["mid_decode"] < n_mid else rng.choice(PHASES))
        code, _ = _run(base, client, fault)
        if code == -9:
            kills[fault[1]] += 1
        else:
            assert code == 0
    assert client.mismatch == 0 and client.out == ref.out
    return kills


def test_sigkill_with_graph_path_matches_eager_fault_free(model, host_daemon):
    from test_serve_engine import _requests
    base = EngineConfig(model=model, dtype="float64", block_size=4, num_blocks=300, max_batched_tokens=24,
                        max_num_seqs=16, socket=host_daemon[0], namespace="graph-campaign", cpu_threads=1,
                        cuda_graphs=True, graph_after_steps=0)
    kills = graph_campaign(base, _requests(4, 4, max_tokens=40), seed=5, n_kills=10, n_mid=1)
    assert kills["mid_decode"] >= 1 and sum(kills.values()) >= 8, kills


class _Journal:
    def __init__(self):
        self.kv = {}

    def commit(self, puts, deletes=()):
        for k in deletes:
            self.kv.pop(k, None)
        self.kv.update(puts)

    def get_many(self, prefix=""):
        return {k: v for k, v in self.kv.items() if k.startswith(prefix)}


def _seq(rid, n_out=0):
    s = Sequence(rid, [5, 6, 7], SamplingParams(max_tokens=200), output_ids=list(range(10, 10 + n_out)))
    s.status, s.block_table, s.num_computed = Status.RUNNING, [3, 4], 3 + n_out - 1 if n_out else 2
    return s


def test_snapshot_is_immune_to_later_changes_and_recovers_exactly():
    j = _Journal()
    c = C.Committer(j)
    a, b = _seq("a", 70), _seq("b")
    c.commit([a, b])
    snap = c.snapshot([a], ["b"])
    want = (a.num_computed, list(a.block_table), list(a.output_ids))
    # the next step moves on before the snapshot is encoded: a is preempted (table cleared)
    # and re-admitted, b's records go
    a.block_table.clear()
    a.block_table += [9]
    a.output_ids.append(99)
    c.apply(*c.build(snap))
    seqs, problems = C.read_sequences(j)
    assert not problems and [s.rid for s in seqs] == ["a"]
    assert (seqs[0].num_computed, seqs[0].block_table, seqs[0].output_ids) == want
    a2 = seqs[0]
    c2 = C.Committer(j)
    c2.adopt(seqs)
    c2.commit([a2])                  # first commit after adopt rewrites st + bt (format upgrade)
    a2.output_ids.append(1)
    a2.num_computed += 1
    puts, deletes = c2.prepare([a2])
    assert sorted(puts) == ["serve/out/a/1", "serve/st/a"] and not deletes
    assert len(puts["serve/st/a"]) == 12
    assert c2.prepare([a2]) is None          # nothing changed: nothing to write


def test_reads_the_single_record_format():
    """Journals written before the table got its own record: state + table in one."""
    j = _Journal()
    s = _seq("old", 5)
    j.commit({"serve/req/old": request_record(s),
              "serve/st/old": state_record(s) + pack_ints(s.block_table),
              "serve/out/old/0": pack_ints(s.output_ids)})
    seqs, problems = C.read_sequences(j)
    assert not problems
    assert (seqs[0].block_table, seqs[0].num_computed, seqs[0].output_ids) == ([3, 4], s.num_computed, s.output_ids)
