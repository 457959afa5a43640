"""agent.metrics.render against prometheus_client, the reference it must equal byte for byte:
for every Accept header Prometheus and other scrapers send, on families shaped as the agent
makes them (awkward label values and numbers included), and on families it must hand back to
prometheus_client (another escaping scheme, timestamps, units, types the agent does not make).
The live endpoint's output is checked the same way in tests/test_metrics.py.
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    StateSetMetricFamily,
)
from prometheus_client.exposition import choose_encoder

from agent.metrics.render import Renderer

# What scrapers send: Prometheus 2.x (OpenMetrics preferred), Prometheus 3.x (with escaping),
# curl (nothing), the 0.0.4 text format named, and text 1.0.0 with an escaping scheme.
ACCEPT = {
    "prometheus-2": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                    "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "prometheus-3": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
                    "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;"
                    "escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "openmetrics-underscores": "application/openmetrics-text;version=1.0.0;escaping=underscores",
    "openmetrics-no-version": "application/openmetrics-text",
    "none": "",
    "text-0.0.4": "text/plain;version=0.0.4",
    "text-1.0.0": "text/plain;version=1.0.0;escaping=underscores",
}


class Families:
    def __init__(self, *families):
        self.families = families

    def collect(self):
        yield from self.families


def registry(*families) -> CollectorRegistry:
    r = CollectorRegistry(auto_describe=False)
    r.register(Families(*families))
    return r


def agent_like() -> CollectorRegistry:
    """Every kind of family the agent exports, with the values that format differently."""
    healthy = GaugeMetricFamily("gpu_agent_device_healthy", 'Help with "quotes", a \\ and\n'
                                "a new line", labels=("resource", "device", "reason"))
    for i, value in enumerate((1.0, 0.0, 1, 0, True, 0.5, -2.25, 123456789.0, 1e21, 1e-7,
                               math.inf, -math.inf, math.nan)):
        healthy.add_metric(["nvidia.com/gpu", f"GPU-{i}", "xid"], value)
    pods = GaugeMetricFamily("gpu_agent_device_allocated", "Pods", labels=("pod", "namespace"))
    for pod in ("", 'we"ird', "back\\slash", "new\nline", "ünïcode-ポッド", "a,b=c}"):
        pods.add_metric([pod, "ml"], 1.0)
    regs = CounterMetricFamily("gpu_agent_registrations", "Registrations", labels=("resource",))
    regs.add_metric(["nvidia.com/gpu"], 3)
    restarts = CounterMetricFamily("gpu_agent_kubelet_restarts_total", "Named with _total",
                                   value=0)
    info = InfoMetricFamily("gpu_agent_build", "Build", labels=("version", "implementation"))
    info.add_metric(["0.1.0", "cython"], {})
    durations = HistogramMetricFamily("gpu_agent_rpc_duration_seconds", "Latency",
                                      labels=("method", "resource"))
    durations.add_metric(["Allocate", "nvidia.com/gpu"],
                         [("0.0005", 2), ("0.001", 5), ("+Inf", 7)], 0.0123)
    empty = GaugeMetricFamily("gpu_agent_gpu_remapped_rows", "No samples this scrape",
                              labels=("gpu",))
    return registry(healthy, pods, regs, restarts, info, durations, empty)


@pytest.mark.parametrize("accept", list(ACCEPT.values()), ids=list(ACCEPT))
def test_the_agents_families_render_as_prometheus_client_renders_them(accept):
    chosen, _ = choose_encoder(accept)
    r = agent_like()
    renderer = Renderer()
    fast = renderer.encoder(chosen)
    assert fast is not chosen  # these all take the fast path ...
    assert fast(r) == chosen(r)  # ... to the same bytes
    assert fast(r) == chosen(r)  # and again from the kept label texts


def test_a_family_the_fast_path_does_not_know_is_left_to_prometheus_client():
    timestamped = GaugeMetricFamily("gpu_agent_x", "Timestamped", labels=("gpu",))
    timestamped.add_metric(["0"], 1.0, timestamp=1700000000.5)
    unit = GaugeMetricFamily("gpu_agent_temperature_celsius", "With a unit", unit="celsius")
    unit.add_metric([], 40.0)
    state = StateSetMetricFamily("gpu_agent_mode", "A state set", value={"a": True, "b": False})
    colon = GaugeMetricFamily("gpu_agent:recorded", "A colon", value=1.0)
    for odd in (timestamped, unit, state, colon):
        r = registry(GaugeMetricFamily("gpu_agent_first", "Plain", value=2.0), odd)
        for accept in ACCEPT.values():
            chosen, _ = choose_encoder(accept)
            assert Renderer().render(list(r.collect()), om="openmetrics" in accept) is None, \
                odd.name
            assert Renderer().encoder(chosen)(r) == chosen(r), (odd.name, accept)


class Counting(Families):
    """A collector that counts how often it is asked, as the agent's reads NVML each time."""

    collected = 0

    def collect(self):
        self.collected += 1
        yield from self.families


def test_a_scrape_collects_once_whichever_writer_writes_it():
    # Falling back part-way must hand prometheus_client the families already read: a second
    # collect() would read every GPU's telemetry and ask podresources twice, and count the
    # scrape twice (agent.metrics.exporter counts scrapes in collect()).
    plain = GaugeMetricFamily("gpu_agent_first", "Plain", value=2.0)
    timestamped = GaugeMetricFamily("gpu_agent_x", "Timestamped", labels=("gpu",))
    timestamped.add_metric(["0"], 1.0, timestamp=1700000000.5)
    for families in ((plain,), (plain, timestamped)):
        for accept in ACCEPT.values():
            chosen, _ = choose_encoder(accept)
            collector = Counting(*families)
            r = CollectorRegistry(auto_describe=False)
            r.register(collector)
            body = Renderer().encoder(chosen)(r)
            assert collector.collected == 1, (families[-1].name, accept)
            assert body == chosen(registry(*families)), (families[-1].name, accept)


def test_another_escaping_scheme_is_prometheus_clients_own_encoder():
    for scheme in ("dots", "values"):
        chosen, _ = choose_encoder(f"application/openmetrics-text;version=1.0.0;escaping={scheme}")
        assert Renderer().encoder(chosen) is chosen
