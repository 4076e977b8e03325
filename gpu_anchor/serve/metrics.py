"""The frontend's Prometheus metrics, written with ``prometheus_client`` (torch-free).

vLLM's names where vLLM has the metric (``vllm:`` prefix, a ``model_name`` label), so its
dashboards and alerts work unchanged; ``gpu_anchor_serve_*`` for what is ours (engine
restarts, recovery times, replayed and mismatched tokens).  Request latencies are measured
where the client sees them: in the frontend, from a request's arrival to the tokens'
arrival from the engine — so an engine crash shows up as the inter-token gap it causes.
Running / waiting / KV-cache usage are the engine scheduler's own counts (its ``load``
messages); while no engine is connected every open request counts as waiting.
"""
from __future__ import annotations

import time

try:
    import prometheus_client as prom
except ImportError as e:      # the serve extra brings it
    raise ImportError("gpu-anchor serve needs prometheus_client: pip install 'gpu-anchor[serve]'") from e

prom.disable_created_metrics()   # no *_created series: vLLM's scrape output has none either

# Bucket edges in seconds: fine at the low end (a token every few ms), long tails for queues.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0,
                300.0, 1200.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
RECOVERY_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = prom.CollectorRegistry()
        m, lab = [model_name], ["model_name"]

        def counter(name, doc, labels=()):
            c = prom.Counter(name, doc, lab + list(labels), registry=r)
            return c if labels else c.labels(*m)

        def gauge(name, doc, labels=()):
            g = prom.Gauge(name, doc, lab + list(labels), registry=r)
            return g if labels else g.labels(*m)

        def hist(name, doc, buckets):
            return prom.Histogram(name, doc, lab, buckets=buckets, registry=r).labels(*m)

        self.model = model_name
        # --- vLLM's names
        self.running = gauge("vllm:num_requests_running", "Requests the engine is running (holding KV cache).")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for the engine (queued or preempted; "
                                                          "all open requests while no engine is connected).")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache's blocks in use (0-1).")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found computed in the prefix cache.")
        self.num_preemptions = counter("vllm:num_preemptions", "Requests preempted (KV dropped, recomputed later).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of the requests received.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated and delivered to clients.")
        self.success = counter("vllm:request_success", "Requests finished, by finish reason (abort: the client "
                                                       "went away).", ["finished_reason"])
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS)
        self.gen_len = hist("vllm:request_generation_tokens", "Tokens generated per finished request.",
                            TOKEN_BUCKETS)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Request arrival to its first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between two tokens of a request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request arrival to its last token.", E2E_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Per finished request: first to last token "
                                                                       "over the tokens after the first.", ITL_BUCKETS)
        self.lora_info = prom.Gauge("vllm:lora_requests_info", "The LoRA adapters of the running and the waiting "
                                    "requests and the slots (--max-loras), as labels; the value is when they were "
                                    "last set.", ["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
                                    registry=r)
        # --- ours
        p = "gpu_anchor_serve_"
        self.lora_swaps = counter(p + "lora_swaps", "LoRA adapters put in a slot from the host (more served than "
                                                    "--max-loras), by the engines of this server.")
        self.lora_reads = counter(p + "lora_reads", "LoRA adapters read again from their files (beyond "
                                                    "--max-cpu-loras), by the engines of this server.")
        self.lora_read_wait = counter(p + "lora_read_wait_seconds", "Seconds steps waited for those reads (a "
                                                                    "read ahead of its requests' step costs none).")
        self.requests = counter(p + "requests", "Requests accepted.")
        self.finished = counter(p + "requests_finished", "Requests that finished (not aborted).")
        self.open = gauge(p + "requests_open", "Requests with an open client connection.")
        self.generated = counter(p + "generated_tokens", "Tokens delivered to clients.")
        self.replayed = counter(p + "replayed_tokens", "Tokens a restarted engine replayed that clients already "
                                                       "had (dropped after comparison).")
        self.mismatch = counter(p + "token_mismatch", "Replayed tokens that differed from the delivered one "
                                                      "(the engine is made to continue from the delivered tokens).")
        self.engine_up = gauge(p + "engine_up", "1 while an engine is connected and serving.")
        self.engine_loading = gauge(p + "engine_loading", "1 while an engine is starting up (see /health).")
        self.restarts = counter(p + "engine_restarts", "Engines that connected after the first one.")
        self.down = hist(p + "engine_recovery_seconds", "Engine lost -> the next engine connected and serving.",
                         RECOVERY_BUCKETS)
        self.stream_gap = hist(p + "recovery_stream_gap_seconds", "Engine lost -> the next token of each request "
                                                                  "that was open then.", RECOVERY_BUCKETS)
        self.last_recovery = gauge(p + "last_recovery_seconds", "Breakdown of the last engine start, by phase.",
                                   ["phase"])
        # destructive failures: the daemon died, or the anchored state was unusable (namespace dropped,
        # marked inconsistent): the next engine loads the weights and recomputes every open request
        self.state_recoveries = counter(p + "state_recoveries", "Engine restarts that found no usable anchored "
                                                                "state (weights loaded again, open requests "
                                                                "recomputed from their tokens).")
        self.state_down = hist(p + "state_recovery_seconds", "For those restarts: engine lost -> the next engine "
                                                             "connected and serving.", RECOVERY_BUCKETS)
        self.state_stream_gap = hist(p + "state_recovery_stream_gap_seconds", "For those restarts: engine lost "
                                     "-> the next token of each request open then (includes recomputing its KV).",
                                     RECOVERY_BUCKETS)
        self.failed = gauge(p + "failed", "1 once the server gave up (crash loop) or is stopping: /health is 503 "
                                          "and requests get 503.")

    def set_load(self, running: int, waiting: int, kv_used: int, kv_total: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_used / kv_total if kv_total else 0.0)

    def set_lora(self, running: list, waiting: list, slots: int) -> None:
        """vLLM's ``vllm:lora_requests_info``: one series, the adapters as comma-separated labels."""
        self.lora_info.clear()
        self.lora_info.labels(",".join(running), str(slots), ",".join(waiting)).set(time.time())

    def set_last_recovery(self, timings: dict) -> None:
        self.last_recovery.clear()
        for k, v in timings.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.endswith("_at"):   # not wall stamps
                self.last_recovery.labels(self.model, k).set(v)

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The scrape body and its content type (text or OpenMetrics, as the scraper asks)."""
        encoder, content_type = prom.exposition.choose_encoder(accept or "")
        return encoder(self.registry), content_type
