"""The metric families of one scrape: names, types, labels and help texts.

Owns: what each metric is called and means (docs/observability.md lists them) and building the
families from what the exporter gathered. Imported at the first scrape (prometheus_client and
what it brings cost 3 MB an unscraped agent does not carry). Must not gather anything itself:
agent.metrics.exporter reads NVML, podresources and the daemon's parts.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

from agent import __version__, _fast, latency
from agent.dra.slices import taint_value
from agent.nvml.telemetry import THROTTLE_REASONS

NS = "gpu_agent"
DEVICE_LABELS = ("resource", "device", "gpu", "uuid")
GPU_LABELS = ("gpu", "uuid")
POD_LABELS = ("namespace", "pod", "container")

# Telemetry gauges: (name in the reading, metric name, help).
GPU_GAUGES = (
    ("utilization_ratio", "gpu_utilization_ratio",
     "Fraction of the last sample period a kernel ran on the GPU (NVML utilization.gpu)"),
    ("memory_utilization_ratio", "gpu_memory_utilization_ratio",
     "Fraction of the last sample period device memory was read or written"),
    ("memory_used_bytes", "gpu_memory_used_bytes", "Device memory in use"),
    ("memory_total_bytes", "gpu_memory_total_bytes", "Device memory in all"),
    ("temperature_celsius", "gpu_temperature_celsius", "GPU core temperature"),
    ("power_watts", "gpu_power_watts", "Power drawn by the board"),
    ("power_limit_watts", "gpu_power_limit_watts", "Power limit the driver enforces"),
    ("sm_clock_hertz", "gpu_sm_clock_hertz", "Current SM clock"),
    ("retired_pages_pending", "gpu_retired_pages_pending",
     "1 if retired pages wait for a reboot or reset (pre-Ampere GPUs)"),
    ("remapped_rows_pending", "gpu_remapped_rows_pending",
     "1 if remapped rows wait for a GPU reset (Ampere and later)"),
    ("remapped_rows_failed", "gpu_remapped_rows_failed",
     "1 if a row remapping failed: the GPU needs service (Ampere and later)"),
)


def collect(x: Any) -> Iterator[Any]:
    """Every family of one scrape of exporter `x` (agent.metrics.exporter.Exporter)."""
    d = x.d
    yield from _agent(x)
    managers = dict(d.resources.managers)
    withdrawn = d.health.withdrawn() if d.health is not None else {}
    health = GaugeMetricFamily(f"{NS}_device_healthy", "1 if the device is advertised "
                               "Healthy; reason: why it is withdrawn (xid, ecc, lost, "
                               "hung, register, wait, isolated, mps, unsupported)",
                               labels=DEVICE_LABELS + ("reason",))
    allocated = GaugeMetricFamily(f"{NS}_device_allocated", "1 per container the device "
                                  "is allocated to (namespace, pod, container); 0 with "
                                  "empty pod labels while it is free",
                                  labels=DEVICE_LABELS + POD_LABELS)
    holders = x.holders()
    gpus: dict[str, int] = {}
    for name, manager in managers.items():
        for h in manager.snapshot().devices:
            dev = h.device
            gpus.setdefault(dev.gpu_uuid, dev.gpu_index)
            labels = [name, dev.id, str(dev.gpu_index), dev.gpu_uuid]
            reason = "" if h.healthy else withdrawn.get(dev.id, "unsupported")
            health.add_metric(labels + [reason], 1.0 if h.healthy else 0.0)
            pods = holders.get((name, dev.id)) or holders.get((name, dev.index))
            for pod in pods or ((("", "", ""),)):
                allocated.add_metric(labels + list(pod), 1.0 if pods else 0.0)
    yield health
    yield allocated
    yield from _mps(d.mps.status()["daemons"])
    yield from _xids(d.health)
    yield from _kubernetes(d.faults)
    yield from _dra(d.dra)
    yield from _threads()
    yield from _telemetry(x, gpus)

def _agent(x: Any) -> Iterator[Any]:
    d = x.d
    info = InfoMetricFamily(f"{NS}_build", "The running agent: its version, whether the hot "
                            "paths are compiled (cython) or the twins (python), and the host "
                            "name (usually the Kubernetes node name)",
                            labels=("version", "implementation", "hostname"))
    info.add_metric([__version__, _fast.IMPLEMENTATION, socket.gethostname()], {})
    yield info
    durations = HistogramMetricFamily(f"{NS}_rpc_duration_seconds", "Time to answer a "
                                      "device-plugin or DRA call from kubelet, by method "
                                      "(resource: the DRA driver's name for a DRA call)",
                                      labels=("method", "resource"))
    for (method, resource), hist in sorted(latency.histograms().items()):
        buckets, total = hist.snapshot()
        durations.add_metric([method, resource], buckets, total)
    yield durations
    registered = d.registrar.status() if d.registrar is not None else {}
    regs = CounterMetricFamily(f"{NS}_registrations", "Registrations with kubelet",
                               labels=("resource",))
    for name, r in sorted(registered.items()):
        regs.add_metric([name], r.registrations)
    yield regs
    yield CounterMetricFamily(f"{NS}_kubelet_restarts", "kubelet restarts the agent "
                              "re-registered after",
                              value=d.registrar.restarts if d.registrar is not None else 0)
    yield CounterMetricFamily(f"{NS}_reloads", "Configurations applied by SIGHUP",
                              value=d.reloads)
    journal = d.state.journal if d.state is not None else None
    yield CounterMetricFamily(f"{NS}_journal_writes", "Appends to the allocation journal",
                              value=journal.writes if journal is not None else 0)
    yield CounterMetricFamily(f"{NS}_journal_syncs", "fdatasyncs of the allocation journal",
                              value=journal.syncs if journal is not None else 0)
    yield CounterMetricFamily(f"{NS}_journal_failures", "Journal writes and syncs that "
                              "failed (Allocate answers UNAVAILABLE while writes fail)",
                              value=journal.failures if journal is not None else 0)
    events = CounterMetricFamily(f"{NS}_nvml_events", "NVML events the health loop took, "
                                 "by outcome (ignored: an XID the policy ignores, "
                                 "filtered before Python; sbe: single-bit ECC; delivered: "
                                 "handed to the health policy)", labels=("outcome",))
    for outcome, n in (d.health.counters.items() if d.health is not None else ()):
        events.add_metric([outcome], n)
    yield events

def _mps(daemons: list) -> Iterator[Any]:
    """sharing.mps: each shared GPU's control daemon (agent.mps.daemons)."""
    if not daemons:
        return
    up = GaugeMetricFamily(f"{NS}_mps_daemon_up", "1 if the GPU's MPS control daemon runs "
                           "with its limits (its replicas are withdrawn while 0)",
                           labels=GPU_LABELS)
    restarts = CounterMetricFamily(f"{NS}_mps_daemon_restarts", "Times the GPU's MPS control "
                                   "daemon exited and was started again", labels=GPU_LABELS)
    for m in daemons:
        labels = [str(m["gpuIndex"]), m["gpuUuid"]]
        up.add_metric(labels, 1.0 if m["running"] else 0.0)
        restarts.add_metric(labels, m["restarts"])
    yield up
    yield restarts


def _dra(dra: Any) -> Iterator[Any]:
    """DRA mode (agent.dramode): the slice, kubelet's registration, taints, prepared claims."""
    if dra is None:
        return
    st = dra.status()
    registered = GaugeMetricFamily(f"{NS}_dra_registered", "1 if kubelet registered the DRA "
                                   "driver's plugin", labels=("driver",))
    registered.add_metric([st["driver"]], 1.0 if st["registered"] else 0.0)
    yield registered
    generation = GaugeMetricFamily(f"{NS}_dra_slice_generation", "The pool generation of the "
                                   "node's ResourceSlice as last published", labels=("driver",))
    generation.add_metric([st["driver"]], st["sliceGeneration"])
    yield generation
    published = GaugeMetricFamily(f"{NS}_dra_slice_published", "1 if the last publication of "
                                  "the ResourceSlice succeeded (0: retried every 10 s, or held "
                                  "until kubelet registers the plugin)", labels=("driver",))
    published.add_metric([st["driver"]], 0.0 if st["error"] or st["held"] else 1.0)
    yield published
    tainted = GaugeMetricFamily(f"{NS}_dra_device_tainted", "1 per device tainted in the slice "
                                "(KEP-5055), with the taint's value and effect",
                                labels=("driver", "device", "value", "effect"))
    for name, (reason, _, effect) in sorted(dra.taints.items()):
        tainted.add_metric([st["driver"], name, taint_value(reason), effect], 1.0)
    yield tainted
    claims = GaugeMetricFamily(f"{NS}_dra_claim_prepared", "1 per device of a prepared claim, "
                               "with the pods the claim was reserved for when prepared",
                               labels=("namespace", "claim", "device", "pod"))
    for c in st["claims"]:
        for device in c["devices"]:
            claims.add_metric([c["namespace"], c["name"], device, ",".join(c["pods"])], 1.0)
    yield claims


def _threads() -> Iterator[Any]:
    """The process's threads (gRPC's and NVML's included), which prometheus_client's process
    collector does not count."""
    try:
        with open("/proc/self/status") as f:
            count = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration, ValueError):
        return
    threads = GaugeMetricFamily(f"{NS}_process_threads", "Threads of the agent's process "
                                "(/proc/self/status), gRPC's and NVML's included")
    threads.add_metric([], count)
    yield threads


def _kubernetes(faults: Any) -> Iterator[Any]:
    """The fault events and the node condition (agent.kubeapi.faults), when on."""
    if faults is None:
        return
    st = faults.status()
    up = GaugeMetricFamily(f"{NS}_kubernetes_api_up", "1 if the Kubernetes API server "
                           "answered the agent's last request (events, node condition)")
    up.add_metric([], 1.0 if st["api"] == "answering" else 0.0)
    yield up
    events = CounterMetricFamily(
        f"{NS}_kubernetes_events", "Kubernetes Events about GPU faults, by outcome: posted, "
        "counted (on the same event posted within 10 minutes), dropped (the queue was full "
        "while the API did not answer), limited (over the per-object rate limit), failed "
        "(refused by the API server)", labels=("outcome",))
    for outcome, n in st["eventCounts"].items():
        events.add_metric([outcome], n)
    yield events
    queued = GaugeMetricFamily(f"{NS}_kubernetes_events_queued", "Events waiting for the "
                               "Kubernetes API")
    queued.add_metric([], st["queued"])
    yield queued


def _xids(health: Any) -> Iterator[Any]:
    xids = CounterMetricFamily(f"{NS}_gpu_xid_events", "XID events delivered to the health "
                               "policy, by GPU and XID (gpu and uuid empty: the event named "
                               "no GPU)", labels=GPU_LABELS + ("xid",))
    for (index, uuid, xid), n in sorted((health.xid_counts() if health else {}).items(),
                                        key=str):
        xids.add_metric(["" if index is None else str(index), uuid or "", str(xid)], n)
    yield xids

def _telemetry(x: Any, gpus: dict[str, int]) -> Iterator[Any]:
    readings = x.read(gpus)
    gauges = {key: GaugeMetricFamily(f"{NS}_{name}", text, labels=GPU_LABELS)
              for key, name, text in GPU_GAUGES}
    ecc = CounterMetricFamily(f"{NS}_gpu_ecc_errors", "ECC errors since the driver loaded "
                              "(volatile), by type", labels=GPU_LABELS + ("type",))
    remapped = GaugeMetricFamily(f"{NS}_gpu_remapped_rows", "Rows remapped, by the kind "
                                 "of error that caused it", labels=GPU_LABELS + ("type",))
    throttle = GaugeMetricFamily(f"{NS}_gpu_throttle_reason", "1 for each reason the "
                                 "clocks are held down now", labels=GPU_LABELS + ("reason",))
    for uuid, reading in readings.items():
        labels = [str(gpus[uuid]), uuid]
        for key, family in gauges.items():
            if key in reading:
                family.add_metric(labels, reading[key])
        for kind in ("corrected", "uncorrected"):
            if f"ecc_{kind}" in reading:
                ecc.add_metric(labels + [kind], reading[f"ecc_{kind}"])
        for kind in ("correctable", "uncorrectable"):
            if f"remapped_rows_{kind}" in reading:
                remapped.add_metric(labels + [kind], reading[f"remapped_rows_{kind}"])
        for reason, _ in THROTTLE_REASONS:
            if f"throttle_{reason}" in reading:
                throttle.add_metric(labels + [reason], reading[f"throttle_{reason}"])
    yield from gauges.values()
    yield ecc
    yield remapped
    yield throttle
    failures = CounterMetricFamily(f"{NS}_gpu_telemetry_failures", "GPU readings left out "
                                   "of a scrape, by cause (timeout: NVML did not answer "
                                   "within the budget; busy: the last call still hangs; "
                                   "error: an NVML error)", labels=GPU_LABELS + ("cause",))
    for (index, uuid, cause), n in sorted(x.failures.items()):
        failures.add_metric([str(index), uuid, cause], n)
    yield failures
