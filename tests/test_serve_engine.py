"""The engine on CPU: equal to HF ``generate``; survives SIGKILLs at every phase.

Kill campaigns fork engine incarnations from a forkserver that imported torch +
transformers but ran no torch op (forking this interpreter, which has run parallel
regions, can hang the child in GNU OpenMP).  The test plays the frontend's part of the protocol: it keeps every
request's delivered tokens, re-sends the requests an engine did not restore, and drops
replayed tokens by index — checking that each replayed token equals the delivered one.
Size knob: ``GPU_ANCHOR_SERVE_KILLS`` (default 40 kills; the HTTP campaign adds 60 more).
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from gpu_anchor.serve.engine import Engine, EngineConfig
from gpu_anchor.serve.engine_config import PHASES
from gpu_anchor.serve.sequence import SamplingParams
from gpu_anchor.testing.tiny import make_tiny_model
from forkserver_context import forkserver_context

KILLS = int(os.environ.get("GPU_ANCHOR_SERVE_KILLS", "40"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {f: make_tiny_model(str(d / f), f, seed=i) for i, f in enumerate(("llama", "qwen3", "qwen2", "mistral"))}


def _prompts(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral"])
def test_greedy_equals_hf_generate(models, family):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(models[family])
    prompts = _prompts(5, seed=1)
    ref = [hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    # small chunks + small blocks: chunked prefill, mixed prefill/decode batches, many blocks
    eng = Engine(EngineConfig(model=models[family], anchor=False, block_size=4, num_blocks=200,
                              max_batched_tokens=13))
    out = eng.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert out == ref


def test_a_sliding_window_shorter_than_the_context_is_refused(tmp_path):
    """Mistral v0.1's 4 096-token window: served only where the context fits in it."""
    from gpu_anchor.serve.model_runner import check_window
    model = make_tiny_model(str(tmp_path / "m"), "mistral", sliding_window=64)
    with pytest.raises(ValueError, match="--max-model-len 64 or less"):
        Engine(EngineConfig(model=model, anchor=False, num_blocks=32, max_model_len=128))
    check_window(Engine(EngineConfig(model=model, anchor=False, num_blocks=32, max_model_len=64)).mc, 64)


def test_sampling_is_a_function_of_seed_and_index(models):
    eng = Engine(EngineConfig(model=models["llama"], anchor=False, num_blocks=128, max_batched_tokens=64))
    prompts = _prompts(4, seed=2)
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, ignore_eos=True)
              for i in range(4)]
    together = eng.generate(prompts, params)
    alone = [eng.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert together == alone
    other = eng.generate(prompts[:1], [SamplingParams(**dict(params[0].to_dict(), seed=7))])[0]
    assert other != together[0]
    greedy = eng.generate(prompts[:1], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert greedy != together[0]


# ---------------------------------------------------------------- crash campaigns
class Client:
    """The frontend's side of the protocol, in-process."""

    def __init__(self, requests):
        self.requests = requests                  # rid -> (prompt, params)
        self.out = {rid: [] for rid in requests}
        self.done = {}
        self.mismatch = 0

    def apply(self, rid, i, ids, fin):
        if rid in self.done:
            return
        for j, t in enumerate(ids):
            k = i + j
            if k < len(self.out[rid]):
                self.mismatch += self.out[rid][k] != t
            elif k == len(self.out[rid]):
                self.out[rid].append(t)
        if fin:
            self.done[rid] = fin

    def prompt_logprobs(self, held):
        pass

    def pending(self, restored):
        return [rid for rid in self.requests if rid not in self.done and rid not in restored]


def _incarnation(cfg, client, conn):
    """Engine process body: restore, replay, re-add, step until done (or killed)."""
    eng = Engine(cfg)
    msgs = [("hello", ([s.rid for s in eng.restored], eng.recovery_notes))]
    msgs += [("ev", (s.rid, 0, s.output_ids, None)) for s in eng.restored]
    for rid in client.pending({s.rid for s in eng.restored}):
        prompt, params = client.requests[rid]
        msgs += [("ev", e) for e in eng.add_request(rid, prompt, SamplingParams(**params.to_dict()), client.out[rid])]
    conn.send(msgs)
    while eng.has_work():
        events = eng.step()
        conn.send([("plp", eng.take_prompt_logprobs(events))] + [("ev", e) for e in events])
    conn.send([("exit", None)])


def _ctx():
    return forkserver_context(["gpu_anchor.serve.preload"])


def _run(cfg, client, fault=None):
    ctx = _ctx()
    a, b = ctx.Pipe()
    p = ctx.Process(target=_incarnation, args=(EngineConfig(**dict(cfg.__dict__, fault=fault)), client, b))
    p.start()
    b.close()
    notes = []
    while True:
        try:
            batch = a.recv()
        except EOFError:
            break
        for kind, x in batch:
            if kind == "ev":
                client.apply(*x)
            elif kind == "plp":
                client.prompt_logprobs(x)
            elif kind == "hello":
                notes += x[1]
    p.join()
    return p.exitcode, notes


def _requests(n_greedy, n_sampled, max_tokens):
    prompts = _prompts(n_greedy + n_sampled, seed=5, lo=5, hi=50)
    reqs = {}
    for i, p in enumerate(prompts):
        # one greedy and one sampled request with penalties: their logits depend on every token so far
        pen = ({"repetition_penalty": 1.3, "frequency_penalty": 0.4} if i == 1 else
               {"presence_penalty": 0.6} if i == n_greedy + 1 else {})
        sp = (SamplingParams(max_tokens=max_tokens, ignore_eos=True, **pen) if i < n_greedy else
              SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=1000 + i, ignore_eos=True, **pen))
        reqs[f"r{i}"] = (p, sp)
    return reqs


def test_sigkill_campaign_matches_fault_free(models, host_daemon):
    sock = host_daemon[0]
    base = EngineConfig(model=models["qwen3"], dtype="float64", block_size=4, num_blocks=300,
                        max_batched_tokens=24, max_num_seqs=16, socket=sock, namespace="campaign", cpu_threads=1)
    reqs = _requests(6, 6, max_tokens=48)
    ref = Client(reqs)
    code, _ = _run(EngineConfig(**dict(base.__dict__, namespace="reference")), ref)
    assert code == 0 and len(ref.done) == len(reqs)

    kill_waves(base, reqs, ref, random.Random(42), KILLS, last_step=2)


def kill_waves(cfg, reqs, ref, rng, kills_wanted: int, last_step: int) -> None:
    """Waves of ``reqs`` through engines SIGKILLed at random phases of their first
    ``last_step + 1`` steps until ``kills_wanted`` kills: each wave's streams equal the fault-free
    run's (``ref``), no replayed token differs, and every phase was hit."""
    kills = {ph: 0 for ph in PHASES}
    wave = 0
    while sum(kills.values()) < kills_wanted:
        client = Client({f"w{wave}-{rid}": v for rid, v in reqs.items()})
        while len(client.done) < len(reqs):
            fault = (rng.randint(0, last_step), rng.choice(PHASES)) if sum(kills.values()) < kills_wanted else None
            code, _ = _run(cfg, client, fault)
            if code == -9:
                kills[fault[1]] += 1
            else:
                assert code == 0
        assert client.mismatch == 0
        assert [client.out[f"w{wave}-{rid}"] for rid in reqs] == [ref.out[rid] for rid in reqs]
        wave += 1
    assert all(kills.values()), kills                  # every phase was hit


class PromptLogprobClient(Client):
    """``Client``, keeping the prompt log-probabilities that come with a first token; a first
    token without them (a replay, a restore in mid-prefill) is not taken, and the request is
    not done until it comes with them: as the frontend, which then re-adds the request from
    the start (``readd(from_start=True)``, tested below); here the next incarnation adds it
    afresh."""

    def __init__(self, requests):
        super().__init__(requests)
        self.plps = {}
        self.refused = 0          # first tokens that came without them

    def prompt_logprobs(self, held):
        for rid, lps in held:
            self.plps.setdefault(rid, lps)

    def apply(self, rid, i, ids, fin):
        if self.requests[rid][1].prompt_logprobs is not None and rid not in self.plps:
            self.refused += i == 0 and bool(ids)
            return                              # not taken: the request starts over
        super().apply(rid, i, ids, fin)


def test_prompt_logprobs_whole_after_sigkills_at_every_phase(models, host_daemon):
    """Prompt log-probabilities gathered over a chunked prefill reach the client whole, or the
    request starts over: SIGKILLed at every phase of the first steps (mid-prefill among them),
    each request ends with the fault-free run's tokens and prompt log-probabilities, exactly, and
    those equal transformers' forward (to float32's log-softmax)."""
    from transformers import AutoModelForCausalLM
    sock = host_daemon[0]
    base = EngineConfig(model=models["qwen3"], dtype="float64", block_size=4, num_blocks=300, max_batched_tokens=13,
                        max_num_seqs=8, socket=sock, namespace="plp", cpu_threads=1)
    prompts = _prompts(5, seed=8, lo=20, hi=45)
    reqs = {f"p{i}": (p, SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=2 if i % 2 == 0 else None,
                                         temperature=0.7 if i == 2 else 0.0, seed=5))
            for i, p in enumerate(prompts)}
    ref = PromptLogprobClient(reqs)
    assert _run(EngineConfig(**dict(base.__dict__, namespace="plp-reference")), ref)[0] == 0
    assert sorted(ref.plps) == ["p0", "p2", "p4"] and len(ref.done) == 5
    hf = AutoModelForCausalLM.from_pretrained(models["qwen3"], dtype=torch.float64)
    for rid in ref.plps:
        p = reqs[rid][0]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p])).logits[0], dim=-1)
        assert len(ref.plps[rid]) == len(p) - 1
        assert max(abs(ref.plps[rid][k - 1][0] - lp[k - 1, p[k]].item()) for k in range(1, len(p))) < 1e-5
        # vLLM's rank: 1 + the other tokens at least as likely
        assert [e[2] for e in ref.plps[rid]] == [int((lp[k - 1] >= lp[k - 1, p[k]]).sum()) for k in range(1, len(p))]
    kills = refused = 0
    for step in range(4):
        for phase in PHASES:
            client = PromptLogprobClient(reqs)
            fault = (step, phase)
            while len(client.done) < len(reqs):
                code, _ = _run(EngineConfig(**dict(base.__dict__, namespace=f"plp-{step}-{phase}")), client, fault)
                kills += code == -9
                assert code in (0, -9)
                fault = None
            assert client.out == ref.out and client.plps == ref.plps and client.mismatch == 0, (step, phase)
            refused += client.refused
    assert kills >= 4 * len(PHASES) - 4, kills
    assert refused > 0            # some first tokens came replayed or after a restore in mid-prefill


def test_readd_from_start_sends_the_prompt_logprobs_again(models):
    """The frontend's way back when a first token came without the prompt's log-probabilities:
    ``readd(..., [], from_start=True)`` computes the whole prompt again, and the first token
    comes again (the same one) with them, equal to the first time's."""
    eng = Engine(EngineConfig(model=models["llama"], anchor=False, block_size=4, num_blocks=100, max_batched_tokens=7))
    prompt = _prompts(1, seed=9, lo=20, hi=20)[0]
    sp = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1)

    def first_token():
        """Step until the first token: (it, what take_prompt_logprobs gave with it)."""
        while True:
            events = eng.step()
            held = eng.take_prompt_logprobs(events)
            firsts = [ids[0] for _, i, ids, _ in events if i == 0 and ids]
            if firsts:
                return firsts[0], held
    eng.add_request("r", prompt, sp)
    first = first_token()
    assert first[1] and first[1][0][0] == "r" and len(first[1][0][1]) == len(prompt) - 1
    assert eng.readd("r", prompt, SamplingParams(**sp.to_dict()), [], from_start=True) == []
    assert first_token() == first


def _kv_lost_midway(model, sock, namespace, reqs, lost):
    """A fault-free reference run; then an engine that commits six steps and is killed, and
    the KV object ``lost`` freed behind the next engine's back.  Returns (config, reference,
    client)."""
    import gpu_anchor
    base = EngineConfig(model=model, dtype="float64", block_size=4, num_blocks=100, max_batched_tokens=16,
                        socket=sock, namespace=namespace, cpu_threads=1)
    ref = Client(reqs)
    _run(EngineConfig(**dict(base.__dict__, namespace=namespace + "-ref")), ref)
    client = Client(reqs)
    assert _run(base, client, fault=(6, "after_commit"))[0] == -9
    gpu_anchor.connect("cpu", namespace=namespace, socket=sock).free(lost)
    return base, ref, client


def test_lost_kv_falls_back_to_prefill(models, host_daemon):
    """KV freed behind the engine's back (or a layout change): the engine says so and
    recomputes; answers stay identical."""
    base, ref, client = _kv_lost_midway(models["llama"], host_daemon[0], "fallback", _requests(2, 2, max_tokens=24),
                                        "kv_cache[0]")
    code, notes = _run(base, client, fault=(3, "mid_decode"))
    assert code == -9 and any("KV cache memory is new" in n for n in notes)
    code, notes = _run(EngineConfig(**dict(base.__dict__, num_blocks=90)), client)
    assert code == 0 and any("layout" in n for n in notes)
    assert client.mismatch == 0 and client.out == ref.out


def _bind_and_die(cfg):
    """An engine that found new KV memory and died before its restore committed anything."""
    from gpu_anchor.serve.model_runner import load_config
    from gpu_anchor.serve.state import bind_state
    st = bind_state(cfg, load_config(cfg.model), torch.float64, torch.device("cpu"))
    assert "KV cache memory is new" in st.kv_problem()
    os.kill(os.getpid(), 9)


def test_new_kv_is_never_trusted_after_a_crash_before_the_restore(models, host_daemon):
    """The KV memory is lost; the next engine dies between its bind (which made the memory
    again) and its restore's commit.  The one after finds the memory "matched" and must still
    not trust it: the first engine deleted the layout record before touching anything."""
    base, ref, client = _kv_lost_midway(models["qwen3"], host_daemon[0], "crash-at-bind",
                                        _requests(2, 1, max_tokens=20), "kv_cache[1]")
    p = _ctx().Process(target=_bind_and_die, args=(base,))
    p.start()
    p.join()
    assert p.exitcode == -9
    code, notes = _run(base, client)
    assert code == 0 and any("no layout record" in n and "recomputing" in n for n in notes), notes
    assert client.mismatch == 0 and client.out == ref.out


def test_restart_does_not_reload_weights(models, host_daemon, tmp_path):
    sock = host_daemon[0]
    cfg = EngineConfig(model=models["llama"], socket=sock, namespace="reuse", num_blocks=32)
    e1 = Engine(cfg)
    assert e1.weights_loaded
    w = e1.model.w["model.embed_tokens.weight"]
    with torch.no_grad():
        w[0, 0] = 12345.0          # a marker only anchored memory can carry into the next engine
    ctx = _ctx()
    q = ctx.Queue()
    p = ctx.Process(target=_rebind, args=(cfg, q))
    p.start()
    assert q.get(timeout=60) == (False, 12345.0)
    p.join()


def test_a_restored_request_that_wants_logprobs_resumes_one_token_back(models, host_daemon):
    """Its last committed token may never have reached the client, and the journal keeps no
    log-probabilities: the next engine samples it again with them in its first step (the KV
    before it stands: no prefill), so the frontend never waits for a resync.  Others resume
    where the journal says."""
    cfg = EngineConfig(model=models["llama"], socket=host_daemon[0], namespace="lp-resume", num_blocks=32)
    e1 = Engine(cfg)
    prompt = _prompts(1, seed=4)[0]
    sp = [SamplingParams(max_tokens=30, ignore_eos=True, logprobs=lp) for lp in (0, None)]
    for rid, p in zip(("lp", "plain"), sp):
        e1.add_request(rid, prompt, p)
    for _ in range(6):
        e1.step()
    e1.flush()
    held = {s.rid: list(s.output_ids) for s in e1.scheduler.seqs.values()}
    q = _ctx().Queue()
    p = _ctx().Process(target=_resume, args=(cfg, q))
    p.start()
    restored, first = q.get(timeout=60)
    p.join()
    n = len(held["lp"])
    assert restored["lp"] == (held["lp"][:-1], len(prompt) + n - 2) and restored["plain"][0] == held["plain"]
    ev = {e[0]: e for e in first}
    assert ev["lp"][1:3] == (n - 1, [held["lp"][-1]]) and [x[:2] for x in ev["lp"][4]] == [["lp", n - 1]]
    assert ev["plain"][1] == len(held["plain"]) and ev["plain"][4] == []   # published by the first step itself


def _resume(cfg, q):
    eng = Engine(cfg)
    restored = {s.rid: (list(s.output_ids), s.num_computed) for s in eng.restored}
    events = eng.step()
    q.put((restored, [(rid, i, ids, fin, eng.take_logprobs([(rid, i, ids, fin)])) for rid, i, ids, fin in events]))


def _rebind(cfg, q):
    e2 = Engine(cfg)
    q.put((e2.weights_loaded, float(e2.model.w["model.embed_tokens.weight"][0, 0])))


def test_readd_adopts_the_delivered_history(models):
    """What the frontend does when a replayed token differs from a delivered one."""
    eng = Engine(EngineConfig(model=models["llama"], anchor=False, num_blocks=64, max_batched_tokens=16))
    prompt = _prompts(1, seed=8)[0]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    eng.add_request("r", prompt, SamplingParams(**sp.to_dict()))
    for _ in range(4):
        eng.step()
    delivered = [7, 8, 9]
    got = {"r": list(delivered)}
    assert eng.readd("r", prompt, SamplingParams(**sp.to_dict()), delivered) == []
    while eng.has_work():
        for rid, i, ids, _ in eng.step():
            assert i == len(got[rid])
            got[rid] += ids
    fresh = Engine(EngineConfig(model=models["llama"], anchor=False, num_blocks=64))
    fresh.add_request("x", prompt, SamplingParams(**sp.to_dict()), delivered)
    out = list(delivered)
    while fresh.has_work():
        out += [t for _, _, ids, _ in fresh.step() for t in ids]
    assert got["r"] == out and len(out) == 12


def test_readd_keeps_the_kv_of_the_shared_history_and_the_journal_follows(models):
    """After a take-over, a request that wants log-probabilities gets the token replayed from
    the journal (which keeps none) sampled again: the engine keeps the KV of what the client
    has and feeds its last token again — a decode step, not a prefill.  After a mismatch, it
    keeps the KV up to the first differing token.  Either way the journal's output segments
    are rewritten from there (here across the 64-token segment boundary)."""
    from gpu_anchor.serve import commit as C
    from test_serve_bookkeeping import LocalJournal
    cfg = EngineConfig(model=models["llama"], anchor=False, num_blocks=64, max_batched_tokens=64)
    prompts = _prompts(2, seed=9)
    sp = SamplingParams(max_tokens=80, ignore_eos=True)
    ref = Engine(cfg).generate(prompts, sp)
    eng = Engine(cfg)
    eng.committer.journal = journal = LocalJournal()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(**sp.to_dict()))
    got = {"r0": [], "r1": []}

    def publish(events):
        for rid, i, ids, _ in events:
            got[rid][i:] = ids

    def readd(out):
        assert eng.readd("r0", prompts[0], SamplingParams(**sp.to_dict()), out) == []
        got["r0"] = list(out)
    while len(got["r0"]) < 60:
        publish(eng.step())
    seq = eng.scheduler.seqs["r0"]
    assert len(seq.output_ids) > len(got["r0"])        # the engine is ahead of what was published
    readd(got["r0"])
    assert seq.output_ids == got["r0"] and seq.num_computed == len(prompts[0]) + 59 and not seq.in_prefill
    while len(got["r0"]) < 66:
        publish(eng.step())
    assert got["r0"] == ref[0][:len(got["r0"])]
    # the client's token 62 differs: KV up to it stands, the rest is recomputed from its tokens
    readd(got["r0"][:62] + [(got["r0"][62] + 1) % 300] + got["r0"][63:66])
    assert seq.num_computed == len(prompts[0]) + 62 and seq.in_prefill
    publish(eng.step())          # a recovery's first step only decodes (r1): r0's remainder waits a step
    assert len(got["r0"]) == 66
    publish(eng.step())
    publish(eng.flush())
    held = {s.rid: s.output_ids for s in C.read_sequences(journal)[0]}
    assert held["r0"] == got["r0"] and len(got["r0"]) == 67 and held["r1"] == got["r1"]
    while eng.has_work():
        publish(eng.step())
    alone = Engine(cfg)
    alone.add_request("x", prompts[0], SamplingParams(**sp.to_dict()), got["r0"][:66])
    tail = []
    while alone.has_work():
        tail += [t for _, _, ids, _ in alone.step() for t in ids]
    assert got["r0"] == got["r0"][:66] + tail and got["r1"] == ref[1]
