"""Health: how fast an XID reaches kubelet, what the idle loop costs, how an XID storm is
drained, and whether the waiting loop slows Allocate.

Owns: four measurements on the simulated NVML (dgx1-v100):
- injected XID → ListAndWatch snapshot received by the simulated kubelet (its monotonic
  receive stamp minus the injection's), through `gpu-agent run` as a subprocess;
- the agent's idle CPU over 60 s (/proc/PID/stat utime+stime), the loop waiting;
- a storm of 100,000 ignored XIDs (XID 13) drained by one EventSet, wall time and process CPU,
  compiled vs pure-Python, each in its own child process;
- Allocate p50/p99 with the loop waiting vs health checks off (DP_DISABLE_HEALTHCHECKS=all).
Figures only; the tests assert behaviour, never time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent._proto.simkubelet.v1 import control_pb2 as ctl
from agent.sim import control, lib_path
from agent.sim.kubelet import SimKubelet, SimKubeletClient
from bench import Section, cpu_seconds, percentile, summarize

RESOURCE = "nvidia.com/gpu"
LATENCY_SAMPLES = 200
IDLE_S = 60.0
STORM = 100_000
ALLOCATE_CALLS = 2000
IDLE_SETTLE_S = 5.0
# tmpfs for the checkpoints of the Allocate comparison (falls back to /tmp without it)
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
Kind = ctl.Event.Kind


class _Node:
    """A temp dir with a simulated kubelet (in this process) and the simulator's control dir."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="gah", dir="/tmp")
        self.kdir = os.path.join(self.root, "kd")
        self.ctl = os.path.join(self.root, "ctl")
        os.makedirs(self.kdir)
        os.makedirs(self.ctl)
        self.kubelet = SimKubelet(self.kdir, dial_timeout=5.0)
        self.kubelet.start()
        self.client = SimKubeletClient(self.kdir)

    def agent(self, *args: str, **env: str) -> subprocess.Popen:
        full = {k: v for k, v in os.environ.items() if not k.startswith("GPU_AGENT_")
                and not k.startswith("DP_")}
        full.update(GPU_AGENT_SIM_PROFILE="dgx1-v100", GPU_AGENT_SIM_CONTROL=self.ctl, **env)
        log = open(os.path.join(self.root, "agent.log"), "ab")
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "agent", "run", "--kubelet-socket",
                 os.path.join(self.kdir, "kubelet.sock"), "--state-dir",
                 os.path.join(self.root, "state"), "--nvml-library", str(lib_path()),
                 "--unhealthy-devices-file", os.path.join(self.root, "isolation.json"),
                 "--pod-resources-socket",
                 os.path.join(self.kdir, "pod-resources", "kubelet.sock"), *args],
                env=full, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def registered(self, after: int = 0) -> ctl.Event:
        self.client.wait_for_event(lambda e: e.kind == Kind.REGISTERED, after_seq=after,
                                   timeout=60, what="registration")
        return self.client.wait_for_event(lambda e: e.kind == Kind.SNAPSHOT, after_seq=after,
                                          timeout=60, what="first snapshot")

    def close(self) -> None:
        self.client.close()
        self.kubelet.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    if proc.wait(30) != 0:
        raise RuntimeError(f"the agent exited {proc.returncode}")


def _unhealthy(snapshot: ctl.Snapshot) -> set[str]:
    return {d.id for d in snapshot.devices if d.health != "Healthy"}


def _latency(node: _Node, uuids: list[str], seq: int) -> list[float]:
    """XID 48 round-robin over the GPUs (quiet period 0: each comes back at the next check);
    each sample waits for its GPU to be healthy, injects, and takes the first snapshot that
    withdraws it."""
    samples: list[float] = []
    events = node.client.events(after_seq=seq, timeout=600)
    latest: set[str] = set()
    for i in range(LATENCY_SAMPLES + 10):
        gpu = i % len(uuids)
        while uuids[gpu] in latest:  # not back yet: follow the snapshots until it is
            e = next(events)
            if e.kind == Kind.SNAPSHOT:
                latest = _unhealthy(e.snapshot)
        t0 = time.monotonic_ns()
        control.inject_xid(node.ctl, gpu, 48)
        while True:
            e = next(events)
            if e.kind != Kind.SNAPSHOT:
                continue
            latest = _unhealthy(e.snapshot)
            if uuids[gpu] in latest:
                if i >= 10:  # the first rounds warm up
                    samples.append((e.snapshot.received.monotonic_ns - t0) / 1e9)
                break
    events.close()
    return samples


def _allocate_interleaved(nodes: dict[str, _Node], uuid: str) -> dict[str, list[float]]:
    """Allocate latency of each node's agent, calls alternating between them, so that load
    from elsewhere on the machine falls on both alike."""
    request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(
        devices_ids=[uuid])])
    channels = {m: grpc.insecure_channel(f"unix:{os.path.join(n.kdir, 'gpu-agent-gpu.sock')}",
                                         options=[("grpc.enable_http_proxy", 0)])
                for m, n in nodes.items()}
    try:
        stubs = {m: dp_grpc.DevicePluginStub(ch) for m, ch in channels.items()}
        out: dict[str, list[float]] = {m: [] for m in nodes}
        for i in range(ALLOCATE_CALLS + 100):
            for mode, stub in (list(stubs.items()) if i % 2 else list(stubs.items())[::-1]):
                start = time.perf_counter()
                stub.Allocate(request, timeout=10)
                if i >= 100:
                    out[mode].append(time.perf_counter() - start)
        return out
    finally:
        for ch in channels.values():
            ch.close()


def _storm_child(impl: str) -> None:
    """Runs in a child: 100,000 XID 13 records appended, then one EventSet drains them."""
    from agent._fast import _events_py, events
    from agent.nvml import library

    module = events if impl == "cython" else _events_py
    path = str(lib_path())
    library.init(path)
    with module.EventSet(path) as es:
        es.register(3, 0x8)
        es.set_ignored_xids([13])
        control.inject_xids(os.environ["GPU_AGENT_SIM_CONTROL"], [(3, 13)] * STORM)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        while es.counters["ignored"] < STORM:  # wait(0): drain what is queued, then return
            if es.wait(0) is not None:
                raise SystemExit("an ignored XID came back")
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        json.dump({"wall": wall, "cpu": cpu, "counters": es.counters}, sys.stdout)


def _storm(impl: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="gastorm") as ctl_dir:
        env = dict(os.environ, GPU_AGENT_SIM_CONTROL=ctl_dir, GPU_AGENT_SIM_PROFILE="dgx1-v100")
        out = subprocess.run(
            [sys.executable, "-c", f"from bench.bench_health import _storm_child; "
                                   f"_storm_child({impl!r})"],
            env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    return json.loads(out)


def run() -> Section:
    section = Section(
        title="Health: XID to kubelet, idle cost, XID storm, Allocate beside the loop",
        method=("Simulated NVML (dgx1-v100), `gpu-agent run` as a subprocess against an "
                "in-process simulated kubelet. XID latency: XID 48 injected round-robin over "
                "the GPUs (quiet period 0, so each returns at the next recovery check), from "
                "the append to the control log to the simulated kubelet receiving the "
                f"ListAndWatch snapshot that withdraws the GPU ({LATENCY_SAMPLES} samples). "
                f"Idle CPU: utime+stime over {IDLE_S:g} s of two freshly registered agents "
                f"({IDLE_SETTLE_S:g} s after registration), one with the loop waiting, one with "
                "DP_DISABLE_HEALTHCHECKS=all, each with the simulated kubelet's podresources socket as on "
                "a node (reconciling every 60 s). Storm: "
                f"{STORM:,} XID 13 records appended at once, drained by one EventSet with 13 "
                "ignored, in a child process per implementation (the simulator's parsing and "
                "queueing of the records is included and is the same for both). Allocate: "
                f"{ALLOCATE_CALLS} sequential calls of one GPU to each of two agents, alternating, "
                "one with the loop waiting, one with DP_DISABLE_HEALTHCHECKS=all (no loop); "
                "their checkpoints are on tmpfs, so the figures compare the GIL, not disk jitter "
                "(the journal's disk cost is measured in the allocation-state section)."),
        header=["measurement", "cython", "python", "target"],
    )
    from agent.sim.profile import load_profile

    uuids = [g["uuid"] for g in load_profile("dgx1-v100")["gpus"]]
    latency: dict[str, tuple[float, float]] = {}
    for impl in ("cython", "python"):
        node = _Node()
        try:
            env = {"GPU_AGENT_PURE_PYTHON": "1"} if impl == "python" else {}
            proc = node.agent("--recovery-quiet-period", "0", **env)
            seq = node.registered().seq
            latency[impl] = summarize(_latency(node, uuids, seq))
            _stop(proc)
        finally:
            node.close()
    section.rows.append(["XID → snapshot p50 / p99",
                         *[f"{latency[i][0] / 1e3:.2f} / {latency[i][1] / 1e3:.2f} ms"
                           for i in ("cython", "python")], "p99 ≤ 5 ms"])

    storms = {impl: _storm(impl) for impl in ("cython", "python")}
    section.rows.append([f"{STORM:,} ignored XIDs: drain wall / CPU",
                         *[f"{storms[i]['wall']:.2f} s / {storms[i]['cpu']:.2f} s"
                           for i in ("cython", "python")], "-"])
    section.notes.append(
        f"storm python/cython ratio: wall {storms['python']['wall'] / storms['cython']['wall']:.2f}×, "
        f"CPU {storms['python']['cpu'] / storms['cython']['cpu']:.2f}×")

    nodes = {"waiting": _Node(), "off": _Node()}
    try:
        # The checkpoint on tmpfs: this comparison is about the GIL, not the disk, and fsync
        # jitter on the VM's disk would otherwise swamp it (bench_state measures the disk).
        procs = {mode: n.agent("--state-dir", tempfile.mkdtemp(prefix="gah", dir=SHM),
                               **({"DP_DISABLE_HEALTHCHECKS": "all"} if mode == "off" else {}))
                 for mode, n in nodes.items()}
        for n in nodes.values():
            n.registered()
        time.sleep(IDLE_SETTLE_S)
        before = {m: (cpu_seconds(p.pid), time.monotonic()) for m, p in procs.items()}
        time.sleep(IDLE_S)
        idle = {}
        for m, p in procs.items():
            used, span = cpu_seconds(p.pid) - before[m][0], time.monotonic() - before[m][1]
            idle[m] = f"{used / span * 100:.3f}% of a core ({used:.2f} s CPU in {span:.0f} s)"
        samples = _allocate_interleaved(nodes, uuids[0])
        alloc = {m: (percentile(v, 50), percentile(v, 99)) for m, v in samples.items()}
        for proc in procs.values():
            _stop(proc)
    finally:
        for n in nodes.values():
            n.close()
    section.rows.append(["agent idle CPU, loop waiting", idle["waiting"], "-",
                         "≤ 0.2% of a core"])
    section.rows.append(["agent idle CPU, health checks off", idle["off"], "-", "-"])
    section.rows.append(["Allocate p50 / p99, loop waiting",
                         f"{alloc['waiting'][0] * 1e3:.3f} / {alloc['waiting'][1] * 1e3:.3f} ms",
                         "-", "-"])
    section.rows.append(["Allocate p50 / p99, health checks off",
                         f"{alloc['off'][0] * 1e3:.3f} / {alloc['off'][1] * 1e3:.3f} ms", "-", "-"])
    section.notes.append(f"Allocate p99 ratio, loop waiting / off: "
                         f"{alloc['waiting'][1] / alloc['off'][1]:.2f} (target ≤ 1.1)")
    return section
