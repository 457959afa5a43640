"""Latency histograms that the gRPC handlers fill and the metrics exporter reads.

Owns: the bucket bounds (seconds, from the gRPC floor of a unix socket to a second) and an
`observe()` cheap enough for Allocate's path: a bisect and two additions under an uncontended
lock, no prometheus_client on the start path; `timed()`, a handler's call observed in one.
Must not import anything of agent: the kubelet layer and the DRA plugin fill these and
agent.metrics turns them into Prometheus histograms.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left

# Upper bounds ("le") of the buckets, in seconds; +Inf is implied.
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 1.0)


class Histogram:
    """Counts per bucket (not cumulative), their sum and count; `snapshot()` for a scrape."""

    __slots__ = ("bounds", "_counts", "_sum", "_lock")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S):
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect_left(self.bounds, seconds)  # le: a value equal to a bound is in its bucket
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (le, count) pairs ending with +Inf, and the sum of observations."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        out, running = [], 0
        for bound, count in zip(self.bounds + (float("inf"),), counts):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out, total


_HISTOGRAMS: dict[tuple[str, str], Histogram] = {}
_REGISTRY_LOCK = threading.Lock()


def histogram(method: str, resource: str) -> Histogram:
    """The process's histogram of `method` calls for `resource`: a plugin server that replaces
    another (a reload, a kubelet restart) goes on counting in the same one."""
    with _REGISTRY_LOCK:
        return _HISTOGRAMS.setdefault((method, resource), Histogram())


def histograms() -> dict[tuple[str, str], Histogram]:
    """Every (method, resource) histogram made so far."""
    with _REGISTRY_LOCK:
        return dict(_HISTOGRAMS)


def timed(hist: Histogram, fn, *args):
    """fn(*args), its time observed in `hist` (a call that raises too)."""
    started = time.perf_counter()
    try:
        return fn(*args)
    finally:
        hist.observe(time.perf_counter() - started)
