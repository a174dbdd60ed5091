"""Prometheus metrics of one server: request counts, token counts, latencies, engine state."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Match

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EngineStatsCollector(Collector):
    """Reads the loaded engines' stats at scrape time, so gauges are never stale.

    A server of several models labels each series with its model; the series of a model go
    when it is unloaded."""

    def __init__(self, models) -> None:
        self.models = models  # a ModelRegistry

    def collect(self) -> Iterator[Metric]:
        labels = ["model"] if self.models.loads_on_demand else []
        families: dict[str, Metric] = {}
        for model in self.models.loaded():
            for name, documentation, kind, value in self._values(model.service.engine):
                if name not in families:
                    families[name] = kind(name, documentation, labels=labels)
                families[name].add_metric([model.name] if labels else [], value)
        yield from families.values()

    @staticmethod
    def _values(engine) -> Iterator[tuple]:
        """(name, documentation, metric family class, value) of each of the engine's stats."""
        stats = engine.get_stats()
        checks, proposed, accepted = (
            stats.speculative_steps,
            stats.proposed_tokens,
            stats.accepted_tokens,
        )
        gauges = {
            "astrai_requests_running": ("Requests being generated", stats.running),
            "astrai_requests_waiting": ("Requests waiting for admission", stats.waiting),
            "astrai_kv_pages_total": ("KV cache pages in the pool", stats.pages_total),
            "astrai_kv_pages_free": ("KV cache pages free", stats.pages_free),
            "astrai_kv_pages_owned": ("KV cache pages owned by requests", stats.pages_owned),
            "astrai_kv_pages_cached": (
                "KV cache pages held by the prefix cache",
                stats.pages_cached,
            ),
            "astrai_prefix_cache_hit_rate": (
                "Fraction of prompt tokens served from the prefix cache",
                stats.prefix_hit_rate,
            ),
            "astrai_speculative_acceptance_rate": (
                "Fraction of guessed tokens kept",
                accepted / proposed if proposed else 0.0,
            ),
            "astrai_speculative_mean_accepted_length": (
                "Guessed tokens kept per check (each check also yields the model's own token)",
                accepted / checks if checks else 0.0,
            ),
        }
        counters = {
            "astrai_preemptions": ("Requests preempted for KV memory", stats.preemptions),
            "astrai_speculative_steps": (
                "Decode rows that carried guessed tokens for the model to check",
                checks,
            ),
            "astrai_speculative_proposed_tokens": ("Guessed tokens the model checked", proposed),
            "astrai_speculative_accepted_tokens": ("Guessed tokens the model kept", accepted),
        }
        for name, (documentation, value) in gauges.items():
            yield name, documentation, GaugeMetricFamily, value
        for name, (documentation, value) in counters.items():
            yield name, documentation, CounterMetricFamily, value


class ServerMetrics:
    """The metrics of one app, in a registry of its own so several apps can live in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "astrai_http_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "astrai_prompt_tokens", "Prompt tokens of accepted requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "astrai_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "astrai_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "astrai_inter_token_latency_seconds",
            "Seconds between successive streamed outputs of one sample",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def watch(self, models) -> None:
        """Report the stats of models' loaded engines (a ModelRegistry's) at every scrape."""
        self.registry.register(EngineStatsCollector(models))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware counting HTTP requests by route and final status code."""

    def __init__(self, app, metrics: ServerMetrics, routes: list) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_note_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            endpoint = self._endpoint(scope)
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def _endpoint(self, scope) -> str:
        """The route's path template; paths no route serves share one label."""
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route.path
        return "other"
