"""`gpu-agent demo`'s observability step: the running agent's /metrics as Prometheus scrapes
it, and the node feature labels it keeps for node-feature-discovery.

Owns: that step's output. Must not hold logic of its own: it reads the endpoint the agent
serves (the port from status.json) and the label file the agent wrote.
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

from agent.status import read_status

SHOWN_LABELS = 8  # of the nvidia.com/gpu.* labels


def _scrape(url: str) -> list[tuple[str, dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


def run_metrics_step(state_dir: str, features_file: str, ctl: str, step: str, table,
                     say) -> int:
    """Print the step; 0 when the endpoint answered and named the demo's pod."""
    from agent.sim import control

    doc = read_status(state_dir) or {}
    port = (doc.get("metrics") or {}).get("port")
    url = f"http://127.0.0.1:{port}/metrics"
    say(f"{step}. Prometheus metrics and node feature labels (docs/observability.md)",
        f"  curl {url}   (agent.metricsAddress; read at scrape time, nothing polls)")
    if not port:
        print("  the metrics endpoint is not listening: see the agent's log")
        return 1
    samples = _scrape(url)
    held = [(lab["gpu"], lab["device"], f"{lab['namespace']}/{lab['pod']}", lab["container"])
            for name, lab, v in samples if name == "gpu_agent_device_allocated" and v == 1.0]
    print("  gpu_agent_device_allocated: which container holds each GPU (from podresources)")
    print(table(["GPU", "device", "pod", "container"], sorted(held, key=lambda r: int(r[0])),
                indent="    "))
    # the pod's GPUs get busy, as its job would make them (the simulator's control channel)
    for _, device, _, _ in held:
        control.set_telemetry(device, ctl, gpu_util=97, mem_util=61, memory_used_mib=14336,
                              temperature_c=71, power_mw=268000, sm_clock_mhz=1530,
                              throttle_reasons=0)
    print("  the pod's GPUs get busy: gpu-agent sim telemetry --gpu <each> --gpu-util 97 "
          "--temperature-c 71 --power-mw 268000 ...; scraped again:")
    samples = _scrape(url)
    per_gpu: dict[str, dict[str, float]] = {}
    for name, lab, v in samples:
        if name in ("gpu_agent_gpu_temperature_celsius", "gpu_agent_gpu_power_watts",
                    "gpu_agent_gpu_memory_used_bytes", "gpu_agent_gpu_utilization_ratio"):
            per_gpu.setdefault(lab["gpu"], {})[name] = v
    if per_gpu:
        print("  GPU telemetry, read from NVML during this scrape:")
        print(table(["GPU", "utilization", "memory used", "temperature", "power"],
                    [[g, _shown(d, "utilization_ratio", 100, "{:.0f} %"),
                      _shown(d, "memory_used_bytes", 2**-30, "{:.1f} GiB"),
                      _shown(d, "temperature_celsius", 1, "{:.0f} °C"),
                      _shown(d, "power_watts", 1, "{:.0f} W")]
                     for g, d in sorted(per_gpu.items(), key=lambda kv: int(kv[0]))],
                    indent="    "))
    calls = {lab["method"]: v for name, lab, v in samples
             if name == "gpu_agent_rpc_duration_seconds_count"}
    print(f"  {len(samples)} samples; kubelet's calls so far: "
          + ", ".join(f"{m} {int(n)}" for m, n in sorted(calls.items())))
    if os.path.exists(features_file):
        lines = Path(features_file).read_text().splitlines()
        print(f"  {features_file} (NFD's features.d; gpu-feature-discovery's label names):")
        found = [x for x in lines if x and not x.startswith("#")]
        shown = [x for x in found if x.startswith("nvidia.com/gpu.")][:SHOWN_LABELS]
        for line in shown:
            print(f"    {line}")
        print(f"    ... {len(found) - len(shown)} more (CUDA driver and runtime versions, MIG and MPS capability)")
    return 0 if held else 1


def _shown(values: dict[str, float], name: str, scale: float, form: str) -> str:
    value = values.get(f"gpu_agent_gpu_{name}")
    return "-" if value is None else form.format(value * scale)
