"""Prometheus metrics under `specbuild:`, named like vLLM's (dashboards and AIPerf read those names): requests and
tokens, TTFT / inter-token / request latency histograms, and the speculative-decoding counters (drafts, draft
tokens, accepted tokens, accepted tokens per draft position), and the memory of what drafters learn from
traffic and of the KV cache, each against its bound."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "specbuild:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


class Metrics:
    """One server's metrics (its own registry). `running`/`waiting` are read from the scheduler at each scrape,
    `learnt` (bytes held, bound) from the engine's drafters that learn from traffic, `kv` (bytes held, bound) from
    the scheduler's KV slots."""

    def __init__(self, running=lambda: 0, waiting=lambda: 0, learnt=lambda: (0, 0), kv=lambda: (0, 0)):
        self.registry = registry = CollectorRegistry()

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, labels, registry=registry)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=registry)

        self.success = counter("request_success", "Requests finished, by finish reason.", ["finished_reason"])
        self.cancelled = counter("request_cancelled", "Requests cancelled (client gone or server stopping).")
        self.errors = counter("request_errors", "Requests answered with an error, by HTTP status.", ["status"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's token steps.", ITL_BUCKETS)
        self.latency = histogram("e2e_request_latency_seconds", "Request latency, arrival to end.", LATENCY_BUCKETS)
        self.drafts = counter("spec_decode_num_drafts", "Decode steps that verified drafts.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.", ["position"]
        )
        Gauge(PREFIX + "num_requests_running", "Requests holding a KV slot.", registry=registry).set_function(running)
        Gauge(PREFIX + "num_requests_waiting", "Requests queued for a slot.", registry=registry).set_function(waiting)
        memory = Gauge(PREFIX + "draft_memory_bytes", "Bytes held by what the drafters learnt from traffic, every "
                       "tenant's (0: the engine's mode learns nothing).", registry=registry)  # fmt: skip
        memory.set_function(lambda: learnt()[0])
        bound = Gauge(PREFIX + "draft_memory_bound_bytes", "The most draft_memory_bytes may be (its pools' bounds).",
                      registry=registry)  # fmt: skip
        bound.set_function(lambda: learnt()[1])
        kv_doc = "Bytes of the KV slots' caches held: positions written (resident pages), up to each slot's longest."
        Gauge(PREFIX + "kv_cache_bytes", kv_doc, registry=registry).set_function(lambda: kv()[0])
        kv_bound_doc = "The most kv_cache_bytes may be (every slot at max_seq_len)."
        Gauge(PREFIX + "kv_cache_bound_bytes", kv_bound_doc, registry=registry).set_function(lambda: kv()[1])

    def steps(self, handle, seen: int) -> int:
        """Count the speculative steps of `handle` after the first `seen`; returns how many are counted now."""
        drafted, accepted = handle.drafted_per_step, handle.accepted_per_step
        done = min(len(drafted), len(accepted))
        for draft, tokens in zip(drafted[seen:done], accepted[seen:done]):
            if draft == 0:
                continue
            hits = min(tokens - 1, draft)
            self.drafts.inc()
            self.draft_tokens.inc(draft)
            self.accepted_tokens.inc(hits)
            for position in range(hits):
                self.accepted_per_pos.labels(position=str(position)).inc()
        return max(done, seen)

    def finished(self, handle, finish_reason: str | None) -> None:
        """A request's end: its tokens and latencies (finish_reason None: cancelled, or failed)."""
        self.prompt_tokens.inc(len(handle.request.ids))
        self.generation_tokens.inc(len(handle.output_ids))
        if finish_reason is not None:
            self.success.labels(finished_reason=finish_reason).inc()
        elif handle.stop_reason == "cancelled":
            self.cancelled.inc()
        if handle.first_token_at is not None:
            self.ttft.observe(handle.first_token_at)
        step_times = sorted(set(handle.token_times))
        for before, after in zip(step_times, step_times[1:]):
            self.itl.observe(after - before)
        if handle.finished_at is not None:
            self.latency.observe(handle.finished_at)

    def error(self, status: int) -> None:
        self.errors.labels(status=str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST
