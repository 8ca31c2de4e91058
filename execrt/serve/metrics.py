"""The server's Prometheus metrics (prefix ``execrt:``), one registry per app.

Counters and histograms the HTTP side observes as requests finish; gauges and the engine's
own counters (retractions, prefix-cache hits) read from ``EngineClient.stats()`` at scrape time.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from execrt.engine.client import EngineStats

P = "execrt:"
#: Seconds; from 1 ms (ITL of a small model) to minutes (a long request under load).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip


class _EngineCollector(Collector):
    """Gauges and engine-side counters, read when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:  # still loading
            return
        yield GaugeMetricFamily(
            P + "num_requests_running",
            "Requests being served (decoding, or part way through a chunked prefill).",
            value=s.requests_running,
        )
        yield GaugeMetricFamily(
            P + "num_requests_waiting", "Requests queued for admission.", value=s.requests_waiting
        )
        yield GaugeMetricFamily(
            P + "kv_cache_usage_perc",
            "Fraction of KV-cache slots held by requests (1 = full).",
            value=s.kv_usage,
        )
        yield CounterMetricFamily(
            P + "num_retractions",
            "Running requests retracted (re-queued) to make KV room.",
            value=s.retractions,
        )
        steps = CounterMetricFamily(
            P + "engine_steps",
            "Engine steps by kind: extend (prefill; the running requests wait) or decode.",
            labels=["kind"],
        )
        steps.add_metric(["extend"], s.extend_steps)
        steps.add_metric(["decode"], s.steps - s.extend_steps)
        yield steps
        yield CounterMetricFamily(
            P + "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
            value=s.prefix_hit_tokens,
        )  # fmt: skip
        yield CounterMetricFamily(
            P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            value=s.prefix_query_tokens,
        )  # fmt: skip


class FastHistogram(Collector):
    """A histogram without labels for observations many times a millisecond: a bucket count
    per observation (bisect), the cumulative counts built when Prometheus scrapes. One thread
    observes (the event loop's); a scrape reads a moment's counts."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe_all(self, values: Sequence[float]) -> None:
        counts, bounds = self.counts, self.bounds
        for v in values:
            counts[bisect_left(bounds, v)] += 1  # the first bound >= v: Prometheus' "le"
        self.sum += sum(values)

    def collect(self) -> Iterator[Metric]:
        cumulative, total = [], 0
        labels = (*map(floatToGoString, self.bounds), "+Inf")
        for bound, count in zip(labels, self.counts, strict=True):
            total += count
            cumulative.append((bound, total))
        yield HistogramMetricFamily(self.name, self.doc, buckets=cumulative, sum_value=self.sum)


class Metrics:
    """Every metric of one server."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(
            P + "request_success",
            "Finished choices by finish reason (stop, length, abort: the client went away, error).",
            ["finished_reason"],
            registry=r,
        )
        self.ttft = self._latency(
            "time_to_first_token_seconds", "From the request's arrival to its first token."
        )
        # Observed once per request and engine step: counted here, exposed at scrape time
        # (prometheus_client's Histogram.observe costs microseconds each, under a lock).
        self.itl = FastHistogram(
            P + "inter_token_latency_seconds",
            "Between successive outputs of one request (one per engine step that gave it tokens).",
            LATENCY_BUCKETS,
        )
        r.register(self.itl)
        self.e2e = self._latency(
            "e2e_request_latency_seconds", "From the request's arrival to its last token."
        )
        r.register(_EngineCollector(stats))

    def _latency(self, name: str, doc: str) -> Histogram:
        return Histogram(P + name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

    def finished(
        self,
        reason: str,
        prompt_tokens: int,
        generated: int,
        ttft: float | None,
        e2e: float | None,
    ) -> None:
        """One choice done (``prompt_tokens`` counted once per prompt by the caller)."""
        self.requests.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        if ttft is not None:
            self.ttft.observe(ttft)
        if e2e is not None:
            self.e2e.observe(e2e)

    def gaps(self, gaps: Sequence[float]) -> None:
        if gaps:
            self.itl.observe_all(gaps)

    def render(self) -> bytes:
        return generate_latest(self.registry)
