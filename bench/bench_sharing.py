"""Sharing: Allocate of a time-sliced and of an MPS replica against Allocate of a full GPU,
interleaved in the same run, and an MPS control daemon's death to its replicas' return.

Owns: three `gpu-agent run` processes on three simulated dgx1-v100 nodes (each with its own
simulated kubelet): the 8 GPUs whole, `sharing.timeSlicing` and `sharing.mps` (4 replicas of
each GPU; MPS through the simulated nvidia-cuda-mps-control); a 1-device request to each, from
1 blocking caller, in alternating blocks; then one GPU's MPS control daemon killed
repeatedly. Figures only; the tests assert behaviour, never time.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.mps.control import Control
from agent.sim.kubelet import SimKubelet, SimKubeletClient
from bench import Section, allocate_timed, percentile, sim_node_env
from bench.bench_plugin import Kind, _next, _Run

QUICK = os.environ.get("BENCH_QUICK") == "1"  # a smoke run: a tenth of the calls
# Blocks of 10 calls (about 8 ms): a burst of the machine's noise falls on all three agents
# alike instead of on one agent's block, which would decide its p99.
BLOCKS, BLOCK = 200 // (10 if QUICK else 1), 10
REPLICAS = 4
KILLS = 4 if QUICK else 20
SHARED_CONFIG = """version: v1
sharing:
  {strategy}:
    resources:
    - name: nvidia.com/gpu
      replicas: {replicas}
"""
STAND_IN = str(Path(__file__).resolve().parent.parent / "agent" / "sim" / "bin" /
               "nvidia-cuda-mps-control")


class _Agent:
    """`gpu-agent run` on a fresh simulated node, with `config` (None: the defaults)."""

    def __init__(self, work: str, config: str | None):
        self.work = tempfile.mkdtemp(prefix="s", dir=work)
        kdir, _, env = sim_node_env(self.work)
        self.kubelet = SimKubelet(kdir)
        self.kubelet.start()
        self.client = client = SimKubeletClient(kdir)
        after = client.state().last_event_seq
        self.mps_root = os.path.join(self.work, "mps")
        self.mps = Control(STAND_IN, self.mps_root)  # to find its daemons, as the agent does
        args = ["--mps-root", self.mps_root, "--mps-control", STAND_IN]
        if config is not None:
            path = os.path.join(self.work, "config.yaml")
            with open(path, "w") as f:
                f.write(config)
            args += ["--config", path]
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
            for uuid in self.mps.running():
                os.kill(self.mps.pid(uuid), signal.SIGKILL)


def _unhealthy(event) -> int:
    return sum(d.health != "Healthy" for d in event.snapshot.devices)


def _daemon_kills(agent: _Agent) -> tuple[list[float], list[float]]:
    """Seconds from SIGKILL of one GPU's daemon (the first by UUID) to kubelet's snapshot
    withdrawing its replicas, and to the snapshot returning them (a new daemon running with
    its limits)."""
    uuid = agent.mps.running()[0]
    down, back = [], []
    for _ in range(KILLS):
        pid = agent.mps.pid(uuid)
        after = agent.client.state().last_event_seq
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        gone = agent.client.wait_for_event(
            lambda e: e.kind == Kind.SNAPSHOT and _unhealthy(e) == REPLICAS, after, 30,
            "the replicas withdrawn")
        down.append(time.perf_counter() - t0)
        agent.client.wait_for_event(lambda e: e.kind == Kind.SNAPSHOT and _unhealthy(e) == 0,
                                    gone.seq, 30, "the replicas back")
        back.append(time.perf_counter() - t0)
    return down, back


def run() -> Section:
    work = tempfile.mkdtemp(prefix="gabs", dir="/var/tmp")
    section = Section(
        title="Sharing: Allocate of a replica against a full GPU; an MPS daemon's restart",
        method=(
            "Three `gpu-agent run` processes (default settings, INFO logging to a file, state "
            "on /var/tmp) on three simulated dgx1-v100 nodes, each with its own simulated "
            f"kubelet: the 8 GPUs whole, `sharing.timeSlicing` and `sharing.mps` ({REPLICAS} "
            "replicas of each GPU; MPS with the simulated nvidia-cuda-mps-control). A 1-device "
            f"request (one GPU; one replica) to each from 1 blocking caller: {BLOCKS} "
            f"alternating blocks of {BLOCK} calls per agent, after 100 warm-up calls each. "
            f"Then one GPU's MPS control daemon killed (SIGKILL) {KILLS} times: from the kill to "
            "kubelet's snapshot with its replicas Unhealthy, and to the one with them back."),
        header=["measure", "median", "p99", "target", "met"],
    )
    agents: dict[str, _Agent] = {}
    try:
        for name, config in (("full", None),
                             ("time-sliced", SHARED_CONFIG.format(strategy="timeSlicing",
                                                                  replicas=REPLICAS)),
                             ("MPS", SHARED_CONFIG.format(strategy="mps", replicas=REPLICAS))):
            agents[name] = _Agent(work, config)
        for a in agents.values():
            allocate_timed(a.stub, a.request, 100)
        samples: dict[str, list[float]] = {name: [] for name in agents}
        for _ in range(BLOCKS):
            for name, a in agents.items():
                samples[name] += allocate_timed(a.stub, a.request, BLOCK)
        devices = {name: a.devices for name, a in agents.items()}
        down, back = _daemon_kills(agents["MPS"])
    finally:
        for a in agents.values():
            a.stop()
        shutil.rmtree(work, ignore_errors=True)

    def ms(s: float) -> str:
        return f"{s * 1e3:.3f} ms"

    f = samples["full"]
    section.rows.append([f"Allocate, full GPU ({devices['full']} devices advertised)",
                         ms(statistics.median(f)), ms(percentile(f, 99)), "", ""])
    for name in ("time-sliced", "MPS"):
        s = samples[name]
        section.rows.append([f"Allocate, one {name} replica ({devices[name]} devices "
                             "advertised)", ms(statistics.median(s)), ms(percentile(s, 99)),
                             "", ""])
        p50 = statistics.median(s) / statistics.median(f)
        p99 = percentile(s, 99) / percentile(f, 99)
        section.rows.append([f"**{name} replica / full GPU**", f"{p50:.2f}×", f"{p99:.2f}×",
                             "p99 ≤ 1.1×", "yes" if p99 <= 1.1 else "**no**"])
    section.rows.append(["MPS daemon killed → its replicas withdrawn (kubelet's snapshot)",
                         ms(statistics.median(down)), ms(percentile(down, 99)), "", ""])
    section.rows.append(["MPS daemon killed → restarted, limits sent, replicas back",
                         ms(statistics.median(back)), ms(percentile(back, 99)), "", ""])
    section.notes += [
        "A replica's Allocate is a full GPU's with one more step on the first call of a device "
        "list: the replica mapped to its GPU, and for MPS its pipe directory, /dev/shm and "
        "k/N limits (agent.rm.allocate); the answer is then cached per requested list like "
        "any other.",
        "The daemon's exit is seen through a pidfd (agent.mps.daemons), the replicas withdrawn "
        "through the health monitor, and the restart is `nvidia-cuda-mps-control -d` (here "
        "the simulated one, a Python script: most of the time back is its start) and two "
        "control commands for the limits.",
    ]
    if QUICK:
        section.notes.append("BENCH_QUICK=1: a tenth of the calls (a smoke run, not figures).")
    return section
