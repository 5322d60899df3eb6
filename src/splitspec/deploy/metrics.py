"""The server's Prometheus figures, in a registry of their own (a second server in one process keeps
its names): what people ask of every runtime — speed of prefill and decode, time to first token, how
much of the draft is accepted, how long checks wait for the residual — and the engine's load at the
moment of the scrape (queue, K/V memory, actor restarts)."""

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("splitspec_requests", "HTTP requests", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("splitspec_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "splitspec_cached_prompt_tokens", "prompt tokens whose K/V were reused", registry=r
        )
        self.completion_tokens = Counter("splitspec_completion_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "splitspec_time_to_first_token_seconds", "request to first token", buckets=_SECONDS, registry=r
        )
        self.latency = Histogram("splitspec_request_seconds", "request to last token", buckets=_SECONDS, registry=r)
        gauges = {
            "prefill_tok_s": "prefill tokens per second of the last request",
            "decode_tok_s": "decode tokens per second of the last request",
            "tokens_per_check": "tokens per check of the last request",
            "acceptance_rate": "accepted / drafted tokens of the last request",
            "residual_wait_ms": "mean ms a check of the last request waited for the residual",
            "queue_depth": "requests waiting to join the batch",
            "live_sequences": "sequences in the batch",
            "kv_bytes": "K/V memory held (live, waiting, kept prefixes)",
            "actor_restarts": "CPU actor losses the engine recovered from",
        }
        self.gauges = {k: Gauge(f"splitspec_{k}", help, registry=r) for k, help in gauges.items()}

    def record(self, n_prompt: int, n_completion: int, summary: dict[str, Any]) -> None:
        """One finished request's figures (its summary from the engine)."""
        g = self.gauges
        self.prompt_tokens.inc(n_prompt)
        self.cached_tokens.inc(summary.get("reused_prompt_tokens", 0))
        self.completion_tokens.inc(n_completion)
        self.ttft.observe(summary.get("ttft_s", 0.0))
        self.latency.observe(summary.get("generate_s", 0.0))
        prefilled, prefill_s = n_prompt - summary.get("reused_prompt_tokens", 0), summary.get("prefill_ms", 0) / 1e3
        if prefill_s > 0:
            g["prefill_tok_s"].set(prefilled / prefill_s)
        decode_s = summary.get("generate_s", 0.0) - summary.get("ttft_s", 0.0)
        if n_completion > 1 and decode_s > 0:  # the first token comes from the prefill
            g["decode_tok_s"].set((n_completion - 1) / decode_s)
        if summary.get("checks"):
            g["tokens_per_check"].set(summary["tokens_per_check"])
            g["residual_wait_ms"].set(summary.get("residual_wait_ms", 0.0))
            if summary.get("drafted"):
                g["acceptance_rate"].set(summary["accepted"] / summary["drafted"])

    def render(self, load: dict[str, int]) -> bytes:
        """The text a scraper reads, with the engine's ``load`` (``EngineService.load``) as of now."""
        for key, gauge in (("waiting", "queue_depth"), ("live", "live_sequences"), ("kv_bytes", "kv_bytes")):
            self.gauges[gauge].set(load[key])
        self.gauges["actor_restarts"].set(load["recoveries"])
        return generate_latest(self.registry)
