"""Prometheus metrics of the engine service (``/metrics``), through prometheus_client: every
request the engine thread runs, page and API alike, is counted when it ends."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest

from unimax.service import EngineService, RequestHandle


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, service: EngineService):
        self.registry = registry = CollectorRegistry()  # per app: tests start several
        self.requests = Counter("unimax_requests", "Requests the engine ran, by mode and outcome",
                                ["mode", "outcome"], registry=registry)
        self.generated = Counter("unimax_generated_tokens", "Tokens generated", ["mode"],
                                 registry=registry)
        self.prefilled = Counter("unimax_prefilled_tokens", "Prompt tokens prefilled (kept "
                                 "states make this less than the prompts' length)",
                                 registry=registry)
        self.reused = Counter("unimax_reused_tokens", "Prompt tokens taken from kept states",
                              registry=registry)
        self.decode = Gauge("unimax_decode_tokens_per_second", "Decode speed of the latest "
                            "reply, by mode", ["mode"], registry=registry)
        self.prefill = Gauge("unimax_prefill_tokens_per_second", "Prefill speed of the latest "
                             "reply", registry=registry)
        self.acceptance = Gauge("unimax_acceptance_rate", "Accepted / drafted tokens of the "
                                "latest verified reply", registry=registry)
        self.bridge = Gauge("unimax_bridge_seconds", "The latest bridge (exact state into the "
                            "decode engine)", registry=registry)
        self.ttft = Gauge("unimax_time_to_first_token_seconds", "The latest reply's time to "
                          "first token", registry=registry)
        queue_length = Gauge("unimax_queue_length", "Requests waiting for the engine thread",
                             registry=registry)
        queue_length.set_function(lambda: len(service.pending))
        service.listeners.append(self.observe)

    def observe(self, handle: RequestHandle) -> None:
        """Called on the engine thread when a request ends."""
        kind, data = handle.outcome or ("error", {})
        outcome = data.get("stopped", "finished") if kind == "done" else "error"
        if outcome == "cancelled" and handle.cancel_reason == "stop":
            outcome = "stop"  # the API ended it at a stop string or a finished call
        self.requests.labels(handle.mode, outcome).inc()
        stats = data.get("stats") or {}
        if not stats:
            return
        # the mode that ran: a logprobs request runs on the exact model ("exact") whatever mode
        # it named, and its speed is not that mode's
        served = stats.get("mode") or handle.mode
        self.generated.labels(served).inc(stats.get("generated_tokens") or 0)
        self.prefilled.inc(stats.get("prefilled_tokens") or 0)
        self.reused.inc(stats.get("reused_tokens") or 0)
        for gauge, key, scale in ((self.prefill, "prefill_tok_s", 1), (self.bridge, "bridge_ms",
                                  1e-3), (self.ttft, "ttft_ms", 1e-3)):
            if stats.get(key) is not None:
                gauge.set(stats[key] * scale)
        if stats.get("decode_tok_s") is not None:
            self.decode.labels(served).set(stats["decode_tok_s"])
        if stats.get("acceptance_rate") is not None:
            self.acceptance.set(stats["acceptance_rate"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
