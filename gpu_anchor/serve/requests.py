"""The engine's requests: admission, a client's history taken back (``readd``), abort, what
is held (a part of ``engine.Engine``, which mixes this in).

Fields of the engine they use: ``scheduler``, ``committer``, ``commits``, ``run_ahead``, ``lora_slots``,
``model.lora``, ``state.weights``, ``cfg``, ``blocks``,
``mc`` (the model config), ``_arrivals``, ``_added`` (sequences the next commit records),
``_gone`` (rids it deletes), ``failures`` (requests ended by the engine, not yet told),
``_urgent`` (the next step lands its commit at once),
``_logprobs`` (log-probabilities of tokens not yet published), ``_prompt_lps`` (prompt
log-probabilities, gathered chunk by chunk and sent with the first token, whole or not at all:
a first token without them, a replay or after a restore in mid-prefill, makes the frontend
re-add the request ``from_start``).
"""
from __future__ import annotations

import logging
import random

from . import commit as C
from . import lora, lora_slots, prefix_cache
from .sampling import token_logprobs
from .sequence import SamplingParams, Sequence, Status

log = logging.getLogger("gpu_anchor.serve")


class Requests:
    def add_request(self, rid: str, prompt_ids, params: SamplingParams, output_ids=()) -> list[tuple]:
        """Queue a request (``output_ids``: tokens a client already received, to continue
        after them).  Returns events if it is already complete."""
        if params.seed is None and not params.greedy:
            params.seed = random.getrandbits(62)
        self._check_ids(list(prompt_ids) + list(output_ids) + [t for t, _ in params.logit_bias])
        served = self.model.lora.served if self.model.lora is not None else {}
        if params.lora is not None and params.lora not in served:
            raise ValueError(f"LoRA adapter {params.lora!r} is not served here (served: "
                             f"{', '.join(served) or 'none'})")
        seq = Sequence(rid, [int(t) for t in prompt_ids], params, output_ids=[int(t) for t in output_ids],
                       arrival=self._arrivals)
        reason = self.scheduler.stop_reason(seq) if seq.output_ids else None
        if reason:
            return [(rid, len(seq.output_ids), [], reason)]
        self.scheduler.add(seq)
        self._added.append(seq)
        if params.prompt_logprobs is not None and not seq.output_ids:
            self._prompt_lps[rid] = (len(seq.prompt_ids), {})
        self._urgent |= bool(seq.output_ids)     # a request resumed after a recovery
        self._arrivals += 1
        return []

    def _check_ids(self, ids) -> None:
        # the vocabulary size read once: a transformers config attribute costs ~1 µs a read
        # (~40 ms per take-over of 64 long streams when it was read per token)
        v = self.mc.vocab_size
        bad = next((t for t in ids if not 0 <= int(t) < v), None)
        if bad is not None:
            raise ValueError(f"token id {bad} outside the vocabulary (size {v})")

    def readd(self, rid: str, prompt_ids, params: SamplingParams, output_ids, from_start: bool = False) -> list[tuple]:
        """Replace a request's history with the tokens the client actually received (after a
        replay disagreed with them, or brought a token without the log-probabilities its
        request wants).  A running request keeps the KV of the history both share and
        recomputes only from where they part (``_rewind``): the usual case, one undelivered
        token replayed from the journal, costs one decode step.  Otherwise its KV is dropped
        and recomputed.  ``from_start``: the whole prompt is computed again (its log-probabilities
        did not reach the client)."""
        self.commits.drop_unpublished(rid)
        self._logprobs.pop(rid, None)
        self._prompt_lps.pop(rid, None)
        seq = self.scheduler.seqs.get(rid)
        if seq is not None and seq.status is Status.RUNNING and seq.prompt_ids == [int(t) for t in prompt_ids]:
            if params.prompt_logprobs is not None and not output_ids:
                self._prompt_lps[rid] = (len(seq.prompt_ids), {})
            return self._rewind(seq, [int(t) for t in output_ids], from_start)
        if self.scheduler.abort(rid) is not None:
            self.committer.forget(rid)
        return self.add_request(rid, prompt_ids, params, output_ids)

    def _rewind(self, seq: Sequence, out: list[int], from_start: bool = False) -> list[tuple]:
        self._check_ids(out)
        common = 0
        for a, b in zip(seq.output_ids, out):
            if a != b:
                break
            common += 1
        p = len(seq.prompt_ids)
        # KV at position i depends on tokens 0..i only: it stands while those are the same.
        # At least the last token is fed again, so the step samples the next one.
        # With prefix caching, never over a block another request shares (it starts before it).
        seq.num_computed = prefix_cache.forget_from(
            self.blocks, seq, 0 if from_start else min(seq.num_computed, p + common, p + len(out) - 1))
        # a new list: a snapshot in flight keeps the old one (its outputs are a prefix length)
        seq.output_ids = out
        if self.run_ahead is not None:
            self.run_ahead.forget(seq)      # its row launched ahead continues the old history
        self.committer.rewind(seq.rid, common)
        self._added.append(seq)     # the next commit records it, scheduled or not
        self._urgent = True
        reason = self.scheduler.stop_reason(seq) if out else None
        if reason:              # the client has every token already (it was the last one)
            self.abort(seq.rid)
            return [(seq.rid, len(out), [], reason)]
        return []

    def load_lora_adapter(self, name: str, path: str, inplace: bool = False) -> None:
        """vLLM's ``/v1/load_lora_adapter``: serve the peft adapter at ``path`` as ``name`` from the
        next step on (``runtime_lora`` only).  ``inplace`` (vLLM's ``load_inplace``): an adapter
        loaded while serving under that name is replaced in its slot, and the requests using it
        go on with the new weights (as in vLLM: an RL trainer's policy update); their journal
        records then name the new digest.  Its journal record lands before this returns.
        Raises ``lora.AdapterError`` naming what is wrong; nothing changes then."""
        ads = self.model.lora
        if ads is None or not self.cfg.runtime_lora:
            raise lora.AdapterError(f"loading LoRA adapters while serving needs --enable-lora and "
                                    f"{lora.RUNTIME_ENV}=True")
        if name in ads.served and not inplace:
            raise lora.AdapterError(f"LoRA adapter {name!r} is already loaded")
        if name in ads.served and not ads.served[name][2]:
            raise lora.AdapterError(f"LoRA adapter {name!r} was given at start (--lora-modules) and is not replaced "
                                    "in place; start the server with the new path, or load it under another name")
        adapter = lora.read_for(self.cfg, self.mc, self.state.weights, name, path, 0)
        if name in ads.served:
            ads.replace(adapter)
        else:
            ads.serve(adapter, runtime=True)
        prefix_cache.adapter_loaded(self.blocks, name, adapter.digest)
        self.commits.write_now({C.LORA + name: ads.record(name)})
        self._adapters_to_ranks()

    def unload_lora_adapter(self, name: str) -> None:
        """vLLM's ``/v1/unload_lora_adapter``; refused while a request uses the adapter."""
        ads = self.model.lora
        if ads is None or name not in ads.served:
            raise lora.AdapterError(f"LoRA adapter {name!r} is not loaded")
        users = sorted(s.rid for s in self.scheduler.seqs.values() if s.params.lora == name)
        if users:
            raise lora.AdapterError(f"LoRA adapter {name!r} is in use by {len(users)} request(s) ({', '.join(users[:3])}"
                                    f"{', ...' if len(users) > 3 else ''}); unload it when they are done")
        ads.remove(name)
        self.blocks.adapter_tags.pop(name, None)
        self.commits.write_now({}, [C.LORA + name])
        self._adapters_to_ranks()

    def _adapters_to_ranks(self) -> None:
        """The other ranks of a tensor-parallel group follow the adapters loaded while serving
        (``lora_slots.follow_table``), before the next step's plan reaches them."""
        if self.tp is not None:
            self.tp.send({"t": "lora", "adapters": lora_slots.runtime_table(self.model.lora)})

    def _fetch_adapters(self, work: list) -> list:
        """Read again the parked adapters of ``work`` whose tensors the host dropped
        (``--max-cpu-loras``: ``lora_slots.Adapters.fetch``).  A request whose adapter cannot be
        served (its files gone or changed) is ended with the reason (``failures``) and left out."""
        ads = self.model.lora
        stats = ads.host.stats
        reads, waited = stats["reads"], stats["wait_s"]
        failed = ads.fetch({w.seq.params.lora for w in work if w.seq.params.lora is not None})
        if stats["reads"] > reads:
            log.info("LoRA adapter(s) read again from their files (%d read in all, %d ahead of their step; the "
                     "host keeps %d of %d; this step waited %.1f ms for them)", stats["reads"],
                     stats["read_ahead"], len(ads.host), ads.host_capacity, (stats["wait_s"] - waited) * 1e3)
        if not failed:
            return work
        for w in work:
            why = failed.get(w.seq.params.lora)
            if why is not None:
                log.warning("request %s: %s", w.seq.rid, why)
                self.abort(w.seq.rid)
                self.failures.append((w.seq.rid, why))
        self._added += self.scheduler.preempted     # journaled even if no step runs now
        return [w for w in work if w.seq.params.lora not in failed]

    def _adapters_in_slots(self, work: list) -> None:
        """Put the adapters of ``work`` in slots (``lora_slots.Adapters.make_resident``); the slots
        are written on this stream, after the steps already enqueued, which use no adapter moved."""
        names = sorted({w.seq.params.lora for w in work if w.seq.params.lora is not None})
        if names:
            ads = self.model.lora      # the running requests' adapters matter only when one must move
            pinned = self.scheduler.running_adapters() if any(n not in ads.slots for n in names) else set()
            moved = ads.make_resident(names, pinned)
            if moved:
                log.info("LoRA adapter(s) %s put in a slot (%d parked)", ", ".join(moved), len(ads.parked))

    def sync_lora_adapters(self, table) -> list[tuple[str, str]]:
        """The frontend's adapters loaded while serving, ``[(name, path)]`` in load order, sent to
        a new engine: the ones it restored from the journal stay, the others are loaded, and
        any it restored that the frontend had unloaded since (the unload's record had not
        landed) go.  Returns ``[(name, error)]`` for those that could not be loaded."""
        ads = self.model.lora
        want = dict(table)
        failed = []
        if ads is not None:
            for name, (path, _, runtime) in list(ads.served.items()):
                if runtime and want.get(name) != path:
                    try:
                        self.unload_lora_adapter(name)
                    except lora.AdapterError as e:
                        log.warning("%s", e)
        for name, path in want.items():
            if ads is not None and name in ads.served:
                continue
            try:
                self.load_lora_adapter(name, path)
            except Exception as e:      # noqa: BLE001 — a bad adapter file must not take the engine down
                failed.append((name, lora.describe_failure(name, e)))
        return failed

    def abort(self, rid: str) -> None:
        if self.scheduler.abort(rid) is not None:
            self._gone.append(rid)
        self.commits.drop_unpublished(rid)
        self._logprobs.pop(rid, None)
        self._prompt_lps.pop(rid, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def load(self) -> dict:
        """What the scheduler holds now: requests running (holding KV) and waiting, and the
        KV blocks in use (blocks released by a step count until its commit lands; cached ones,
        free to reuse, do not), and the prefix cache's prompt tokens looked up and found; with
        LoRA adapters, those of the running and the waiting requests, the slots, the swaps, the
        adapters read again from their files and the seconds steps waited for such reads."""
        seqs = self.scheduler.seqs.values()
        running = sum(s.status is Status.RUNNING for s in seqs)
        out = {"running": running, "waiting": len(self.scheduler.seqs) - running,
               "kv_blocks_used": self.blocks.num_blocks - self.blocks.num_free, "kv_blocks": self.blocks.num_blocks,
               "preemptions": self.scheduler.preemptions, "prefix_queries": self.scheduler.prefix_queries,
               "prefix_hits": self.scheduler.prefix_hits}
        ads = self.model.lora
        if ads is not None:
            waiting = {s.params.lora for s in seqs if s.status is not Status.RUNNING and s.params.lora is not None}
            out["lora"] = {"running": sorted(self.scheduler.running_adapters()), "waiting": sorted(waiting),
                           "max": ads.capacity, "swaps": ads.stats["swaps"], "reads": ads.host.stats["reads"],
                           "read_wait_s": ads.host.stats["wait_s"]}
        return out

    def _hold_prompt_logprobs(self, la, live) -> None:
        """The prompt log-probabilities of a completed step's prompt rows (``la.plp``), held per
        request until its first token is published."""
        logits, parts = la.plp
        rows, chosen, ks, where, r0 = [], [], [], [], 0
        for w, first, count in parts:
            if la.current(w, live):
                rows += range(r0, r0 + count)
                chosen += w.seq.prompt_ids[first + 1:first + 1 + count]
                ks += [w.seq.params.prompt_logprobs] * count
                where.append((w.seq, first, count))
            r0 += count
        if not rows:
            return
        lps = iter(token_logprobs(logits[rows], chosen, ks, ranks=True))
        for seq, first, count in where:
            held = self._prompt_lps.setdefault(seq.rid, (len(seq.prompt_ids), {}))[1]
            for p in range(first + 1, first + 1 + count):
                held[p] = next(lps)

    def take_prompt_logprobs(self, events) -> list[list]:
        """For the requests whose first token is in ``events``: their prompt log-probabilities,
        if every one is held, as ``[[rid, [[logprob, [[id, logprob], ...], rank], ...]], ...]``
        (prompt tokens 1..n-1).  Whatever is held for a request with a token in ``events`` is forgotten."""
        out = []
        for rid, i, ids, _ in events:
            held = self._prompt_lps.pop(rid, None) if ids else None
            if held is not None and i == 0 and len(held[1]) == held[0] - 1:
                out.append([rid, [list(held[1][p]) for p in range(1, held[0])]])
        return out

    def take_cached_tokens(self, events) -> list[list]:
        """``[[rid, n], ...]``: the prompt tokens that requests whose first token (or end) is in
        ``events`` found computed by prefix caching, when any (forgotten here)."""
        out = []
        held = self.scheduler.cached_tokens
        for rid, i, ids, fin in events:
            if i == 0 and (ids or fin) and rid in held:
                out.append([rid, held.pop(rid)])
        return out

    def take_logprobs(self, events) -> list[list]:
        """The log-probabilities of the tokens in ``events`` (published ones), as
        ``[[rid, index, logprob, [[id, logprob], ...]], ...]``; they are forgotten here."""
        out = []
        for rid, i, ids, _ in events:
            held = self._logprobs.get(rid)
            if held is None:
                continue
            for k in range(i, i + len(ids)):
                if k in held:
                    lp, top = held.pop(k)
                    out.append([rid, k, lp, top])
            if not held:
                del self._logprobs[rid]
        return out
