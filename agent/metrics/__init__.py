"""The Prometheus endpoint: `/metrics` on agent.metricsAddress, gathered at scrape time.

Parts: `exporter` (the listener, the devices' holders, the GPUs' telemetry within a time budget,
the status) and `families` (the metric names, types, labels and help texts, imported at the
first scrape). Nothing runs between scrapes: an idle agent stays idle. docs/observability.md
lists every metric.
"""
