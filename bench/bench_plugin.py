"""The device plugin as kubelet meets it: `gpu-agent run` (a real subprocess, simulated NVML
dgx1-v100) against an in-process simulated kubelet over real unix sockets.

Owns: measuring Allocate latency over the plugin socket with 1 caller (a blocking stub, as
kubelet calls) and with 64 concurrent callers (grpc.aio on one channel), the time from process
start to registered and to the first device list (the simulated kubelet's event timestamps),
the time from a kubelet restart to the registration and the next device list, the time from a
SIGHUP to the new setting answering Allocate, and the agent's resident memory
(/proc/PID/status VmRSS). Figures only; the tests assert behaviour, never time.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent._proto.simkubelet.v1 import control_pb2 as ctl
from agent.sim import lib_path
from agent.sim.kubelet import SimKubelet, SimKubeletClient
from bench import (
    AGENT_COMMAND,
    Section,
    allocate_concurrently,
    allocate_timed,
    percentile,
    rss_mb,
    sim_node_env,
    stop_agent,
)

RESOURCE = "nvidia.com/gpu"
STARTS = 10
RESTARTS = 20
RELOADS = 20
ONE_CALLER_CALLS = 2000
MANY_CALLERS = 64
CALLS_PER_CALLER = 60
Kind = ctl.Event.Kind


# Agents started without a piece of speed-only code, to measure what it buys (docs/benchmarks.md
# names the rule): Python code run before the agent's own `main`.
WITHOUT = {
    # agent/deferred.py: the modules it defers imported first (it defers none then)
    "the deferral": "import grpc, inspect, typing_extensions, ctypes.util, "
                    "google.protobuf.internal.python_message; ",
    # agent/gcpause.py: gc.disable (the start's and the pauses') and gc.freeze made no-ops
    "the collector's pause": "import gc; gc.disable = gc.freeze = lambda: None; ",
}


class _Run:
    """One agent process against the bench's simulated kubelet; `prelude`: Python code run
    in it before the agent (a WITHOUT value)."""

    def __init__(self, work: str, kdir: str, env: dict, *args: str, prelude: str = ""):
        self.log = open(os.path.join(work, "agent.log"), "ab")  # closed in stop()
        self.t0_ns = time.time_ns()
        command = AGENT_COMMAND[:-1] + [prelude + AGENT_COMMAND[-1]]
        self.proc = subprocess.Popen(
            [*command, "run", "--kubelet-socket",
             os.path.join(kdir, "kubelet.sock"), "--state-dir", os.path.join(work, "state"),
             "--nvml-library", str(lib_path()), *args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        try:
            stop_agent(self.proc, 10)
        finally:
            self.log.close()


def _next(client: SimKubeletClient, kind: int, after: int, what: str) -> ctl.Event:
    return client.wait_for_event(lambda e: e.kind == kind and e.resource_name == RESOURCE,
                                 after_seq=after, timeout=30, what=what)


def _allocate_one_caller(socket: str, ids: list[str]) -> list[float]:
    request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)])
    with grpc.insecure_channel(f"unix:{socket}", options=[("grpc.enable_http_proxy", 0)]) as ch:
        stub = dp_grpc.DevicePluginStub(ch)
        allocate_timed(stub, request, 50)
        return allocate_timed(stub, request, ONE_CALLER_CALLS)


def _allocate_many_callers(socket: str, ids: list[str]) -> tuple[list[float], float]:
    request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)])
    return allocate_concurrently(socket, request, MANY_CALLERS, CALLS_PER_CALLER)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def run() -> Section:
    section = Section(
        title="Device plugin: Allocate latency, start to registered, kubelet restart, memory",
        method=("`gpu-agent run` as a subprocess, started as the installed console script "
                "starts it (import agent.__main__, call main; not `python -m`), on the "
                "simulated NVML (dgx1-v100, 8 GPUs), "
                "default settings (envvar, INFO logging to a file), against a simulated kubelet "
                "in the bench process over real unix sockets. Allocate: a 2-GPU request "
                f"straight to the plugin socket, {ONE_CALLER_CALLS} calls from 1 blocking "
                f"caller, and {MANY_CALLERS} concurrent grpc.aio callers × {CALLS_PER_CALLER} "
                "calls on one channel (client and agent share the machine's CPUs). Start: "
                f"process spawn to kubelet's REGISTERED and first SNAPSHOT events, {STARTS} "
                f"starts. Restart: kubelet restart to the agent's registration and to the next "
                f"device list, {RESTARTS} restarts. Reload: SIGHUP to the new setting answering "
                f"Allocate, {RELOADS} reloads. RSS: VmRSS of the agent process."),
        header=["measure", "median", "p99 / worst", "target", "met"],
    )
    work = tempfile.mkdtemp(prefix="gab", dir="/tmp")
    kdir, _, env = sim_node_env(work)
    kubelet = SimKubelet(kdir)
    kubelet.start()
    client = SimKubeletClient(kdir)
    agent = None
    try:
        # -- start to registered, several times, and without each piece (interleaved) -----------
        to_registered, to_devices, rss_start = [], [], []
        without: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in WITHOUT}
        spawn: list[float] = []
        for _ in range(STARTS):
            spawn.append(_spawn_pass())
            for piece in (None, *WITHOUT):
                after = client.state().last_event_seq
                agent = _Run(work, kdir, env, prelude=WITHOUT.get(piece, ""))
                registered = _next(client, Kind.REGISTERED, after, "registration")
                snapshot = _next(client, Kind.SNAPSHOT, registered.seq, "first device list")
                took = (registered.time.wall_ns - agent.t0_ns) / 1e9
                time.sleep(0.5)  # let start-up settle before reading memory
                rss = rss_mb(agent.proc.pid)
                if piece is None:
                    to_registered.append(took)
                    to_devices.append((snapshot.time.wall_ns - agent.t0_ns) / 1e9)
                    rss_start.append(rss)
                else:
                    without[piece][0].append(took)
                    without[piece][1].append(rss)
                agent.stop()
                agent = None

        stages = _start_stages()

        # -- one agent for the rest -------------------------------------------------------------
        after = client.state().last_event_seq
        config = os.path.join(work, "config.yaml")
        _write_strategy(config, STRATEGIES[0])
        agent = _Run(work, kdir, env, "--config", config)
        _next(client, Kind.SNAPSHOT, after, "first device list")
        res = client.state().resource(RESOURCE)
        ids = sorted(d.id for d in res.devices)[:2]
        socket = os.path.join(kdir, res.endpoint)
        reloaded = _reloads(agent, config, socket, ids)
        one = _allocate_one_caller(socket, ids)
        many, wall = _allocate_many_callers(socket, ids)
        rss_after_load = rss_mb(agent.proc.pid)

        re_registered, re_listed = [], []
        for _ in range(RESTARTS):
            after = client.state().last_event_seq
            client.restart()
            restarted = _next_any(client, Kind.RESTARTED, after)
            registered = _next(client, Kind.REGISTERED, restarted.seq, "registration")
            snapshot = _next(client, Kind.SNAPSHOT, registered.seq, "device list after restart")
            re_registered.append((registered.time.wall_ns - restarted.time.wall_ns) / 1e9)
            re_listed.append((snapshot.time.wall_ns - restarted.time.wall_ns) / 1e9)
        agent.stop()
        agent = None
    finally:
        if agent is not None:
            agent.proc.kill()
            agent.proc.wait()
        client.close()
        kubelet.stop()
        shutil.rmtree(work, ignore_errors=True)

    def row(name, samples, worst_is_max, target, limit, fmt=_ms, median_limit=None):
        med = statistics.median(samples)
        tail = max(samples) if worst_is_max else percentile(samples, 99)
        met = "" if limit is None else ("yes" if tail <= limit else "**no**")
        if median_limit is not None:
            met = "yes" if med <= median_limit else "**no**"
        section.rows.append([name, fmt(med), fmt(tail), target, met])

    row("Allocate, 1 caller", one, False, "p99 ≤ 2 ms", 0.002)
    row(f"Allocate, {MANY_CALLERS} concurrent callers", many, False, "—", None)
    floor = statistics.median(spawn)
    row(f"start → registered ({statistics.median(to_registered) / floor:.1f}× `python -c "
        "pass`)", to_registered, False, "median ≤ 10× `python -c pass`", None,
        median_limit=10 * floor)
    for piece, (took, rss) in without.items():
        med = statistics.median(took)
        row(f"start → registered without {piece} ({med / floor:.1f}×; the piece buys "
            f"{1 - statistics.median(to_registered) / med:.0%}; RSS after start "
            f"{max(rss):.1f} MB)", took, False, "—", None)
    row("start → first device list", to_devices, False, "—", None)
    row("reference: spawn `python -c pass` to its exit", spawn, False, "—", None)
    for name, samples in zip(IMPORT_STAGES, stages):
        row(f"reference: import {name} (fresh interpreter)", samples, False, "—", None)
    row("kubelet restart → re-registered", re_registered, False, "median ≤ 15 ms", None,
        median_limit=0.015)
    row("kubelet restart → next device list", re_listed, False, "—", None)
    row("SIGHUP → new setting answers Allocate", reloaded, False, "median ≤ 50 ms", None,
        median_limit=0.050)
    row("RSS after start", rss_start, True, "≤ 60 MB", 60.0, fmt=lambda m: f"{m:.1f} MB")
    section.rows.append([f"RSS after {len(one) + len(many) + 100} Allocate calls",
                         f"{rss_after_load:.1f} MB", "", "≤ 60 MB",
                         "yes" if rss_after_load <= 60.0 else "**no**"])
    section.notes += [
        f"{MANY_CALLERS} callers: {len(many)} calls in {wall:.2f} s "
        f"({len(many) / wall:.0f} Allocate/s); a single Python server process answers them "
        "one at a time under the GIL, so this is queueing time, not per-call cost.",
        "Start: the reference rows split what a start costs before the agent does anything: "
        "the interpreter, then each stage of the imports the start path needs, measured in "
        "fresh interpreters in this run (the agent's own modules are measured after the "
        "third-party ones they import). The rest is the agent's work: config, NVML init and "
        "discovery on the simulated library, the link model, the recorded faults, serving, and "
        "kubelet's dial-back inside Register. The journal, the CDI check, PyYAML, pyinotify "
        "and the podresources client load after the first registration; asyncio, grpc.aio, "
        "protobuf's python_message, ctypes.util, typing_extensions and inspect, which grpc, "
        "protobuf and pynvml import but the agent never uses, load only if something uses "
        "them (agent/deferred.py). "
        "The garbage collector is off until the start is done (agent/gcpause.py): the start "
        "keeps nearly everything it makes, so collections during it found next to nothing. "
        "The rows 'without' start agents, interleaved with the others, with that piece "
        "undone (bench/bench_plugin.py WITHOUT: the deferred modules imported first; "
        "gc.disable and gc.freeze made no-ops): what each buys, by the rule at the top.",
        "Restart: measured from the simulated kubelet's RESTARTED event (its sockets wiped, "
        "kubelet.sock about to be served again) to the agent's Register and to the first "
        "device list of the new stream. The agent acts on the inotify event at once: it "
        "re-creates its socket when that is gone and registers when kubelet.sock's identity "
        "differs from the instance it registered with (agent/kubelet/registrar.py).",
        f"SIGHUP: {RELOADS} reloads alternating deviceListStrategy envvar and volume-mounts, "
        "on the fresh agent (before the Allocate load below fills its journal); from the "
        "signal to the first Allocate (polled on the plugin socket) answered the new way. The "
        "servers keep serving through the reload: the same ListAndWatch stream and "
        "registration carry on.",
        "Every Allocate is written to the journal before it is answered (docs/state.md: one "
        "append per group of concurrent Allocates, fdatasync in the background). These calls "
        "come straight to the plugin socket, not from a pod kubelet admitted, so podresources "
        "never claims their records: all of them stay (300 s grace), "
        f"{len(one) + len(many) + 100:,} records by the end, which the RSS-after-load row "
        "shows. The comparison with a bare grpcio server is in the next section; the "
        "journal's own cost in the allocation-state section.",
    ]
    return section


STRATEGIES = ("envvar", "volume-mounts")


def _write_strategy(path: str, strategy: str) -> None:
    with open(path, "w") as f:
        f.write(f"version: v1\nflags:\n  plugin:\n    deviceListStrategy: {strategy}\n")


def _reloads(agent: _Run, config: str, socket: str, ids: list[str]) -> list[float]:
    """Seconds from SIGHUP to the first Allocate answered with the new strategy."""
    request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)])
    out = []
    with grpc.insecure_channel(f"unix:{socket}", options=[("grpc.enable_http_proxy", 0)]) as ch:
        stub = dp_grpc.DevicePluginStub(ch)
        for n in range(1, RELOADS + 1):
            _write_strategy(config, STRATEGIES[n % 2])
            mounted = STRATEGIES[n % 2] == "volume-mounts"
            start = time.perf_counter()
            agent.proc.send_signal(signal.SIGHUP)
            while True:
                response = stub.Allocate(request, timeout=10).container_responses[0]
                if bool(response.mounts) == mounted:
                    break
                if time.perf_counter() - start > 10:
                    raise RuntimeError("the reloaded strategy never answered")
            out.append(time.perf_counter() - start)
    return out


_IMPORT_STAGES = '''
import time
t0 = time.perf_counter()
from agent.deferred import defer_unused_modules
defer_unused_modules()  # as `gpu-agent run` does first
import logging, argparse
t1 = time.perf_counter()
import grpc
t2 = time.perf_counter()
import pynvml
t3 = time.perf_counter()
from agent._proto.deviceplugin.v1beta1 import api_pb2
t4 = time.perf_counter()
import agent.__main__, agent.daemon
t5 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)
'''
IMPORT_STAGES = ("the deferral (agent/deferred.py) + logging + argparse",
                 "grpc (asyncio, grpc.aio deferred)", "pynvml (ctypes.util deferred)",
                 "protobuf + the device-plugin messages", "the agent's own start path")


def _spawn_pass() -> float:
    """Seconds to spawn `python -c pass` and wait for it."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - start


def _start_stages(runs: int = 10) -> list[list[float]]:
    """In fresh interpreters, what importing each stage of the start path costs (the rest of
    the start is our work)."""
    stages = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", _IMPORT_STAGES], check=True,
                             capture_output=True, text=True).stdout
        stages.append([float(x) for x in out.split()])
    return [list(col) for col in zip(*stages)]


def _next_any(client: SimKubeletClient, kind: int, after: int) -> ctl.Event:
    return client.wait_for_event(lambda e: e.kind == kind, after_seq=after, timeout=30,
                                 what=ctl.Event.Kind.Name(kind))
