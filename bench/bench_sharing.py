"""Sharing: Allocate of a time-sliced replica against Allocate of a full GPU, interleaved in
the same run.

Owns: two `gpu-agent run` processes on two simulated dgx1-v100 nodes (each with its own
simulated kubelet), one advertising the 8 GPUs whole and one with `sharing.timeSlicing`
(4 replicas of each GPU); a 1-device request to each, from 1 blocking caller, in alternating
blocks. Figures only; the tests assert behaviour, never time.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.sim.kubelet import SimKubelet, SimKubeletClient
from bench import Section, allocate_timed, percentile, sim_node_env
from bench.bench_plugin import Kind, _next, _Run

QUICK = os.environ.get("BENCH_QUICK") == "1"  # a smoke run: a tenth of the calls
BLOCKS, BLOCK = 20, 100 // (10 if QUICK else 1)
REPLICAS = 4
SHARED_CONFIG = f"""version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: {REPLICAS}
"""


class _Agent:
    """`gpu-agent run` on a fresh simulated node, with `config` (None: the defaults)."""

    def __init__(self, work: str, config: str | None):
        self.work = tempfile.mkdtemp(prefix="s", dir=work)
        kdir, _, env = sim_node_env(self.work)
        self.kubelet = SimKubelet(kdir)
        self.kubelet.start()
        client = SimKubeletClient(kdir)
        after = client.state().last_event_seq
        args = []
        if config is not None:
            path = os.path.join(self.work, "config.yaml")
            with open(path, "w") as f:
                f.write(config)
            args = ["--config", path]
        self.run = _Run(self.work, kdir, env, *args)
        _next(client, Kind.SNAPSHOT, after, "first device list")
        res = client.state().resource("nvidia.com/gpu")
        self.socket = os.path.join(kdir, res.endpoint)
        self.devices = len(res.devices)
        self.request = dp.AllocateRequest(container_requests=[
            dp.ContainerAllocateRequest(devices_ids=[sorted(d.id for d in res.devices)[0]])])
        self.channel = grpc.insecure_channel(f"unix:{self.socket}",
                                             options=[("grpc.enable_http_proxy", 0)])
        self.stub = dp_grpc.DevicePluginStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        try:
            self.run.stop()
        finally:
            self.kubelet.stop()


def run() -> Section:
    work = tempfile.mkdtemp(prefix="gabs", dir="/var/tmp")
    section = Section(
        title="Sharing: Allocate of a time-sliced replica against a full GPU",
        method=(
            "Two `gpu-agent run` processes (default settings, INFO logging to a file, state on "
            "/var/tmp) on two simulated dgx1-v100 nodes, each with its own simulated kubelet: "
            f"one advertising the 8 GPUs whole, one with `sharing.timeSlicing` ({REPLICAS} "
            f"replicas of each GPU). A 1-device request (one GPU; one replica) to each from 1 "
            f"blocking caller: {BLOCKS} alternating blocks of {BLOCK} calls per agent, after "
            "100 warm-up calls each."),
        header=["measure", "median", "p99", "target", "met"],
    )
    full = shared = None
    try:
        full, shared = _Agent(work, None), _Agent(work, SHARED_CONFIG)
        for a in (full, shared):
            allocate_timed(a.stub, a.request, 100)
        samples: dict[str, list[float]] = {"full": [], "shared": []}
        for _ in range(BLOCKS):
            samples["full"] += allocate_timed(full.stub, full.request, BLOCK)
            samples["shared"] += allocate_timed(shared.stub, shared.request, BLOCK)
        devices = (full.devices, shared.devices)
    finally:
        for a in (full, shared):
            if a is not None:
                a.stop()
        shutil.rmtree(work, ignore_errors=True)

    def ms(s: float) -> str:
        return f"{s * 1e3:.3f} ms"

    f, s = samples["full"], samples["shared"]
    section.rows.append([f"Allocate, full GPU ({devices[0]} devices advertised)",
                         ms(statistics.median(f)), ms(percentile(f, 99)), "", ""])
    section.rows.append([f"Allocate, one replica ({devices[1]} devices advertised)",
                         ms(statistics.median(s)), ms(percentile(s, 99)), "", ""])
    p50 = statistics.median(s) / statistics.median(f)
    p99 = percentile(s, 99) / percentile(f, 99)
    section.rows.append(["**replica / full GPU**", f"{p50:.2f}×", f"{p99:.2f}×", "p99 ≤ 1.1×",
                         "yes" if p99 <= 1.1 else "**no**"])
    section.notes.append(
        "A replica's Allocate is a full GPU's with one more step on the first call of a device "
        "list: the replica mapped to its GPU (agent.rm.allocate); the answer is then cached "
        "per requested list like any other.")
    if QUICK:
        section.notes.append("BENCH_QUICK=1: a tenth of the calls (a smoke run, not figures).")
    return section
