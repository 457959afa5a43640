"""The Prometheus endpoint: what a scrape costs with 8 and 64 GPUs, what the exporter costs an
idle agent nobody scrapes, and what a scrape every second does to Allocate.

Owns: the 64-GPU node profile (written at run time from the shipped pcie-8gpu: eight copies of
its eight GPUs, SYS between copies) and the three measurements. The references are measured
in the same run: the agent with its endpoint off and a bare grpcio server (idle CPU), and
Allocate with no scrapes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent._proto.simkubelet.v1 import control_pb2 as kctl
from agent.sim import PROFILES_DIR, lib_path
from agent.sim.kubelet import SimKubeletClient
from bench import (
    AGENT_COMMAND,
    Section,
    allocate_timed,
    cpu_seconds,
    percentile,
    rss_mb,
    sim_node_env,
    stop_agent,
)
from bench.kubelet import KubeletProcess
from tests.daemon_harness import thread_switches

SCRAPES = 50
MORE_SCRAPES = 1000  # then this many more, for the RSS they leave
IDLE_S = 60.0
IDLE_TARGET = 0.1  # % of a core: an agent nobody scrapes, 8 GPUs, endpoint on (issue 37)
ALLOCATE_BLOCK = 500  # calls per block (about 0.4 s)
BLOCKS = 90  # none, agent scraped, other server fetched, in turn: short blocks, so that each
# kind samples the machine's swings alike
RESOURCE = "nvidia.com/gpu"


def profile_64(path: str) -> str:
    """Write a 64-GPU profile to `path`: pcie-8gpu's GPUs eight times over."""
    text = (PROFILES_DIR / "pcie-8gpu.yaml").read_text()
    head, rest = text.split("gpus:\n", 1)
    gpus_text, topo_text = rest.split("pcie_topology:\n", 1)
    blocks = ["  - index:" + b for b in gpus_text.split("  - index:")[1:]]
    rows = [re.findall(r"\b(X|PIX|PXB|PHB|NODE|SYS)\b", line.split("#")[0])
            for line in topo_text.splitlines() if line.strip().startswith("- [")]
    out = [head.replace('name: "pcie-8gpu"', 'name: "bench-64gpu"'), "gpus:\n"]
    for k in range(64):
        b = blocks[k % 8]
        b = re.sub(r"index: \d+", f"index: {k}", b, count=1)
        b = re.sub(r"minor: \d+", f"minor: {k}", b, count=1)
        b = re.sub(r'uuid: "GPU-[^"]+"', f'uuid: "GPU-{uuid.UUID(int=k + 1)}"', b, count=1)
        b = re.sub(r'serial: "\d+"', f'serial: "{1000000000000 + k}"', b, count=1)
        b = re.sub(r'bus_id: "[^"]+"', f'bus_id: "{k // 8:08X}:{(k % 8 + 1) * 16:02X}:00.0"',
                   b, count=1)
        out.append(b)
    out.append("pcie_topology:\n")
    for i in range(64):
        row = [rows[i % 8][j % 8] if i // 8 == j // 8 else "SYS" for j in range(64)]
        out.append(f"  - [{', '.join(row)}]\n")
    with open(path, "w") as f:
        f.write("".join(out))
    return path


class Agent:
    def __init__(self, work: str, kdir: str, env: dict, client: SimKubeletClient, *args: str):
        self.state = os.path.join(work, "state")
        after = client.state().last_event_seq
        self.log = open(os.path.join(work, "agent.log"), "ab")
        self.proc = subprocess.Popen(
            [*AGENT_COMMAND, "run", "--kubelet-socket", os.path.join(kdir, "kubelet.sock"),
             "--state-dir", self.state, "--nvml-library", str(lib_path()),
             "--pod-resources-socket", os.path.join(kdir, "pod-resources", "kubelet.sock"),
             "--nfd-features-file", "", *args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        client.wait_for_event(lambda e: e.kind == kctl.Event.Kind.SNAPSHOT, after_seq=after,
                              timeout=60, what="first device list")

    def port(self) -> int:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with open(os.path.join(self.state, "status.json")) as f:
                    m = json.load(f).get("metrics") or {}
                if m.get("listening"):
                    return m["port"]
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise RuntimeError("the metrics endpoint never listened")

    def stop(self) -> None:
        try:
            stop_agent(self.proc)
        finally:
            self.log.close()


# What Prometheus 2.x sends (OpenMetrics preferred, gzip); the SCRAPER below sends it too.
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;"
              "version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "Accept-Encoding": "gzip"}


def _scrape(port: int) -> float:
    start = time.perf_counter()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers=PROMETHEUS_HEADERS)
    with urllib.request.urlopen(request, timeout=10) as r:
        r.read()
    return time.perf_counter() - start


def _exposition(port: int) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={
        "Accept": PROMETHEUS_HEADERS["Accept"]})
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.read().decode()


def _render_times(exposition: str, runs: int = 200) -> tuple[list[float], list[float], int]:
    """Seconds to write `exposition`'s samples as OpenMetrics: prometheus_client's writer and
    agent.metrics.render's, alternating, in this process; and the number of samples."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.openmetrics import exposition as openmetrics
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from agent.metrics.render import Renderer

    families = list(text_string_to_metric_families(exposition))

    class Parsed:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Parsed())
    reference = openmetrics.generate_latest
    fast = Renderer().encoder(reference)
    if fast(registry) != reference(registry):
        raise RuntimeError("agent.metrics.render wrote other bytes than prometheus_client")
    out: tuple[list[float], list[float]] = ([], [])
    for _ in range(runs):
        for times, encoder in zip(out, (reference, fast)):
            start = time.perf_counter()
            encoder(registry)
            times.append(time.perf_counter() - start)
    return out[0], out[1], sum(len(f.samples) for f in families)


class Node:
    def __init__(self, profile: str):
        self.work = tempfile.mkdtemp(prefix="gam", dir="/tmp")
        self.kdir, self.ctl, self.env = sim_node_env(self.work, profile)
        self.kubelet = KubeletProcess(self.kdir, self.env)
        self.client = SimKubeletClient(self.kdir)

    def agent(self, *args: str) -> Agent:
        return Agent(self.work, self.kdir, self.env, self.client, *args)

    def close(self) -> None:
        self.client.close()
        self.kubelet.stop()
        shutil.rmtree(self.work, ignore_errors=True)


def _scrape_times(profile: str, more: int) -> tuple[list[float], list[float], float, str]:
    """Scrape times; the agent's RSS after them and after `more` scrapes back to back; the
    agent's CPU seconds per timed scrape; the exposition of the last one."""
    node = Node(profile)
    try:
        agent = node.agent("--metrics-address", "127.0.0.1:0")
        try:
            port = agent.port()
            for _ in range(5):
                _scrape(port)
            cpu = cpu_seconds(agent.proc.pid)
            times = [_scrape(port) for _ in range(SCRAPES)]
            cpu = (cpu_seconds(agent.proc.pid) - cpu) / SCRAPES
            rss = [rss_mb(agent.proc.pid)]
            if more:
                for _ in range(more):
                    _scrape(port)
                rss.append(rss_mb(agent.proc.pid))
            return times, rss, cpu, _exposition(port)
        finally:
            agent.stop()
    finally:
        node.close()


def _run_ns(pid: int) -> dict[int, int]:
    """TID -> nanoseconds each thread of process `pid` has run (/proc/PID/task/TID/schedstat).
    An idle agent runs a few ms a minute: utime + stime, counted in 10 ms ticks, cannot tell
    0.1% of a core from 0.117%."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                out[int(task)] = int(f.read().split()[0])
        except OSError:
            continue  # the thread ended meanwhile
    return out


def _idle_percent(pid: int) -> tuple[float, float]:
    """The CPU % process `pid` (all its threads) runs over the next IDLE_S, and that span in
    seconds."""
    before, t0 = _run_ns(pid), time.monotonic()
    time.sleep(IDLE_S)
    span = time.monotonic() - t0
    ran = sum(ns - before.get(tid, 0) for tid, ns in _run_ns(pid).items())
    return 100 * ran / 1e9 / span, span


def _idle_floor(work: str) -> float:
    """CPU % over IDLE_S of a bare grpcio server that nobody calls: bench/bench_floor.py's
    floor process (grpc.server with the agent's worker count, one unix socket), the least a
    device plugin served by grpcio's server costs at rest (its server thread polls every
    200 ms, its event engine wakes about every second)."""
    from bench.bench_floor import _Floor  # the floor the Allocate figures are measured against

    floor = _Floor(work, dp.AllocateResponse().SerializeToString())
    try:
        time.sleep(2.0)
        return _idle_percent(floor.proc.pid)[0]
    finally:
        floor.stop()


def _idle_cpu(node: Node, address: str) -> tuple[float, float, dict[str, float]]:
    """CPU % of an agent nobody scrapes, over IDLE_S after it settled (its threads' run time),
    its RSS then, and the wake-ups per minute of each of its threads that woke in that time
    (voluntary context switches; threads of one name summed)."""
    agent = node.agent("--metrics-address", address)
    try:
        if address:
            agent.port()
        time.sleep(2.0)  # the journal load and first reconcile after the registration
        switches = thread_switches(agent.proc.pid)
        cpu, span = _idle_percent(agent.proc.pid)
        woke: dict[str, float] = {}
        for tid, (name, count) in thread_switches(agent.proc.pid).items():
            n = count - switches.get(tid, (name, 0))[1]
            if n:
                woke[name] = woke.get(name, 0.0) + n * 60 / span
        return cpu, rss_mb(agent.proc.pid), woke
    finally:
        agent.stop()


# A scraper in its own process, as Prometheus is: the request Prometheus sends (OpenMetrics
# preferred, gzip), then a second's pause, until stopped. The bench stops it (SIGSTOP) outside
# its own blocks and lets it go on (SIGCONT) during them, so every kind of block shares the
# one agent, the same minutes and the same state of the machine. Its second is counted in
# 10 ms naps of the time it runs: a plain sleep(1) goes on elapsing while it is stopped, and
# it would scrape at once on every resume (2 to 3 scrapes per second of its blocks).
SCRAPER = r"""
import json, sys, time, urllib.request
request = urllib.request.Request(sys.argv[1], headers=json.loads(sys.argv[2]))
print("ready", flush=True)
while True:
    with urllib.request.urlopen(request, timeout=10) as r:
        r.read()
    print("scraped", flush=True)
    waited = 0.0
    while waited < 1.0:
        start = time.monotonic()
        time.sleep(0.01)
        waited += min(time.monotonic() - start, 0.02)  # a nap stopped midway counts as one
"""


class Scraper:
    """A SCRAPER process for `url`, stopped until `go()` and after `pause()`."""

    def __init__(self, url: str):
        self.proc = subprocess.Popen([sys.executable, "-c", SCRAPER, url,
                                      json.dumps(PROMETHEUS_HEADERS)],
                                     stdout=subprocess.PIPE)
        if self.proc.stdout.readline() != b"ready\n" or \
                self.proc.stdout.readline() != b"scraped\n":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the scraper of {url} did not start")
        self.pause()

    def go(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def close(self) -> int:
        """Stops it; the scrapes it made after the first."""
        self.go()
        self.proc.kill()
        scrapes = self.proc.stdout.read().count(b"scraped\n")
        self.proc.wait()
        return scrapes


def _allocate_under_scrapes(node: Node) -> tuple[dict[str, list[float]], int]:
    """Allocate latencies with no scrapes ("none"), with the agent scraped every second
    ("agent"; and how many scrapes that made), and with the same scraper fetching the agent's
    exposition from another process's HTTP server every second ("other"): the machine's
    floor, what one more process doing the HTTP round trip costs the caller and the agent."""
    agent = node.agent("--metrics-address", "127.0.0.1:0")
    scrapers: dict[str, Scraper] = {}
    www = os.path.join(node.work, "www")
    os.makedirs(www)
    server = None
    try:
        port = agent.port()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            exposition = r.read()
        with open(os.path.join(www, "metrics"), "wb") as f:
            f.write(exposition)
        with socket.socket() as s:  # a free port for the other server
            s.bind(("127.0.0.1", 0))
            other_port = s.getsockname()[1]
        server = subprocess.Popen([sys.executable, "-m", "http.server", str(other_port),
                                   "--bind", "127.0.0.1", "--directory", www],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        scrapers["agent"] = Scraper(f"http://127.0.0.1:{port}/metrics")
        _wait_listening(other_port)
        scrapers["other"] = Scraper(f"http://127.0.0.1:{other_port}/metrics")
        ids = [d.id for d in node.client.state().resource(RESOURCE).devices][:2]
        request = dp.AllocateRequest(container_requests=[
            dp.ContainerAllocateRequest(devices_ids=ids)])
        times: dict[str, list[float]] = {"none": [], "agent": [], "other": []}
        with grpc.insecure_channel(f"unix:{os.path.join(node.kdir, 'gpu-agent-gpu.sock')}",
                                   options=[("grpc.enable_http_proxy", 0)]) as ch:
            stub = dp_grpc.DevicePluginStub(ch)
            allocate_timed(stub, request, 100)
            for block in range(BLOCKS):
                kind = ("none", "agent", "other")[block % 3]
                scraper = scrapers.get(kind)
                if scraper is not None:
                    scraper.go()
                times[kind] += allocate_timed(stub, request, ALLOCATE_BLOCK)
                if scraper is not None:
                    scraper.pause()
        return times, scrapers.pop("agent").close()
    finally:
        for scraper in scrapers.values():
            scraper.close()
        if server is not None:
            server.kill()
            server.wait()
        agent.stop()


def _wait_listening(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on port {port}") from None
            time.sleep(0.05)


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def run() -> Section:
    section = Section(
        title="Prometheus endpoint: scrape time, idle cost, Allocate under scrapes",
        method=(f"`gpu-agent run` on the simulated NVML and a simulated kubelet in a process "
                f"of its own (bench/kubelet.py), its endpoint on 127.0.0.1, scraped "
                f"with urllib from the bench process sending Prometheus' request (OpenMetrics, "
                f"gzip; HTTP round trip included). Scrape: "
                f"{SCRAPES} scrapes after 5 untimed, on dgx1-v100 (8 GPUs) and on a 64-GPU "
                f"profile made from pcie-8gpu; each scrape asks podresources and reads every "
                f"GPU's telemetry from NVML; on 8 GPUs then {MORE_SCRAPES:,} more, for the "
                f"memory they leave. Idle: CPU of an agent nobody scrapes over "
                f"{IDLE_S:g} s (its threads' run time, /proc/PID/task/*/schedstat), endpoint "
                f"on and off, and of a bare grpcio server (bench/bench_floor.py's floor "
                f"process), same run. Allocate: one blocking caller, "
                f"{BLOCKS} blocks of {ALLOCATE_BLOCK} 2-GPU Allocates (about 0.4 s each) on "
                f"one agent, in turn: no scrapes; the agent scraped every second; the same "
                f"scraper fetching the same exposition every second from another process "
                f"(python -m http.server), which measures what any process doing that HTTP "
                f"round trip costs the caller on this machine. The scraper is a process of its "
                f"own sending Prometheus' request (OpenMetrics preferred, gzip), stopped "
                f"(SIGSTOP) outside its blocks; its second counts only the time it runs."),
        header=["measure", "median", "p99", "target", "met"],
    )
    scraped_rss: list[float] = []
    with tempfile.TemporaryDirectory(prefix="gam64") as tmp:
        for name, profile, limit, more in (
                ("8 GPUs (dgx1-v100)", "dgx1-v100", 0.020, MORE_SCRAPES),
                ("64 GPUs", profile_64(os.path.join(tmp, "p64.yaml")), 0.100, 0)):
            times, rss, cpu, exposition = _scrape_times(profile, more)
            scraped_rss = scraped_rss or rss
            med, p99 = statistics.median(times), percentile(times, 99)
            section.rows.append([f"scrape, {name}", _ms(med), _ms(p99),
                                 f"median ≤ {limit * 1e3:.0f} ms",
                                 "yes" if med <= limit else "**no**"])
            section.rows.append([f"agent CPU per scrape, {name} (all its threads)", _ms(cpu),
                                 "", "—", ""])
            reference, fast, count = _render_times(exposition)
            r50, f50 = statistics.median(reference), statistics.median(fast)
            r99, f99 = percentile(reference, 99), percentile(fast, 99)
            section.rows.append([f"writing its {count} samples as OpenMetrics: "
                                 f"prometheus_client (reference)", _ms(r50), _ms(r99), "—", ""])
            section.rows.append([f"writing its {count} samples as OpenMetrics: "
                                 f"agent.metrics.render, same bytes", _ms(f50), _ms(f99), "—",
                                 f"{r50 / f50:.1f}× faster"])
    node = Node("dgx1-v100")
    try:
        off, off_rss, _ = _idle_cpu(node, "")
        on, on_rss, woke = _idle_cpu(node, "127.0.0.1:0")
        with tempfile.TemporaryDirectory(prefix="gaidle") as tmp:
            floor = _idle_floor(tmp)
        section.rows.append([f"idle CPU over {IDLE_S:g} s, a bare grpcio server nobody calls "
                             f"(the floor: bench/bench_floor.py's)", f"{floor:.3f} %", "", "—",
                             ""])
        section.rows.append([f"idle CPU over {IDLE_S:g} s, endpoint off (reference)",
                             f"{off:.3f} %", "", "—", ""])
        section.rows.append([f"idle CPU over {IDLE_S:g} s, 8 GPUs, endpoint on, not scraped",
                             f"{on:.3f} %", "", f"≤ {IDLE_TARGET:g} % of a core",
                             f"{'yes' if on <= IDLE_TARGET else '**no**'} ({on - off:+.3f} "
                             f"points on the reference, {on / floor:.1f}× the floor)"])
        section.rows.append(["RSS, endpoint off (reference)", f"{off_rss:.1f} MB", "", "—", ""])
        section.rows.append(["RSS, endpoint on, not scraped", f"{on_rss:.1f} MB", "", "—",
                             f"{on_rss - off_rss:+.1f} MB"])
        section.rows.append([f"RSS, 8 GPUs, after {SCRAPES + 5} scrapes",
                             f"{scraped_rss[0]:.1f} MB", "", "—",
                             f"{scraped_rss[0] - off_rss:+.1f} MB"])
        section.rows.append([f"RSS, 8 GPUs, after {MORE_SCRAPES:,} more scrapes back to back",
                             f"{scraped_rss[1]:.1f} MB", "", "flat",
                             f"{scraped_rss[1] - scraped_rss[0]:+.1f} MB"])
        times, scrapes = _allocate_under_scrapes(node)
    finally:
        node.close()
    q50, q99 = statistics.median(times["none"]), percentile(times["none"], 99)
    section.rows.append(["Allocate, no scrapes (reference)", _ms(q50), _ms(q99), "—", ""])
    for kind, name in (("agent", f"Allocate, the agent scraped every second "
                                 f"({scrapes} scrapes)"),
                       ("other", "Allocate, the same scraper fetching the same text from "
                                 "another process every second (the machine's floor)")):
        s50, s99 = statistics.median(times[kind]), percentile(times[kind], 99)
        target = "p99 ≤ 1.1× the reference" if kind == "agent" else "—"
        met = f"{s99 / q99:.2f}×" + (f" ({'yes' if s99 <= 1.1 * q99 else '**no**'})"
                                     if kind == "agent" else "")
        section.rows.append([name, _ms(s50), _ms(s99), target, met])
    section.notes.append(
        f"Wake-ups per minute of the idle agent's threads (endpoint on, not scraped; voluntary "
        f"context switches over the {IDLE_S:g} s, tests/test_idle.py counts them too): "
        + ", ".join(f"{name} {rate:.0f}" for name, rate in sorted(woke.items(),
                                                                  key=lambda kv: -kv[1]))
        + "; every other thread none. gRPC's own threads (_serve, grpc_global_timer, "
        "event_engine, lifeguard) wake in any gRPC Python server; main, health-events and "
        "journal are the agent's last timers (docs/architecture.md).")
    section.notes.append(
        "Nothing runs between scrapes: NVML is read when Prometheus asks (agent.nvml.telemetry, "
        "a 0.5 s budget per scrape), podresources is asked then too, and the listener's one "
        "thread sleeps in accept(); the HTTP server and prometheus_client "
        "are imported at the first scrape (the RSS rows). The Allocate handler's only cost "
        "is its latency histogram (agent/latency.py: a bisect and two additions under an "
        "uncontended lock).")
    section.notes.append(
        "The GPUs are read in turn on one NVML worker (agent.nvml.guard, `run_each`), not on "
        "a worker each: waking eight threads took half the CPU of a scrape of 8 GPUs.")
    section.notes.append(
        "A scrape costs Allocate through Python's lock: while the scrape's thread runs Python "
        "an Allocate that arrives waits for it (up to the 5 ms switch interval). Writing the "
        "text was most of that Python: the writing rows time prometheus_client's writer and "
        "the agent's (agent/metrics/render.py, the same bytes: checked before timing) on the "
        "exposition of the last scrape, in this process.")
    return section
