"""Allocate against the gRPC floor: the agent beside a bare grpcio server that answers a fixed
AllocateResponse, measured interleaved in the same run, with the journal on the machine's disk.

Owns: the floor server (a subprocess: same grpcio, same worker count as the agent's plugin
server, the agent's own response bytes for the same request), the interleaved 1-caller
comparison (p50 and p99 ratios), the journal-growth run (10,000 Allocates that no pod claims:
p50 of the first and last 250 calls, RSS after start and after the run), each on several
fresh process pairs and judged on their median, and 64 concurrent callers against both
(throughput, p50, p99). Figures only; the tests assert behaviour, never time.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.sim.kubelet import SimKubeletClient
from bench import Section, allocate_concurrently, allocate_timed, percentile, rss_mb, sim_node_env
from bench.bench_plugin import Kind, _next, _Run
from bench.kubelet import KubeletProcess

QUICK = os.environ.get("BENCH_QUICK") == "1"  # a smoke run: a tenth of the calls
SCALE = 10 if QUICK else 1
BLOCKS, BLOCK = 20, 100 // SCALE  # 1 caller: 2,000 calls per server, in alternating blocks
GROWTH_CALLS = 10_000 // SCALE
EDGE = 250 // SCALE  # the first and the last this many calls of the growth run
CALLERS, PER_CALLER, ROUNDS = 64, 40 // SCALE, 2
PAIRS = 1 if QUICK else 3  # fresh agent and floor processes, each for both runs above
OPTIONS = [("grpc.enable_http_proxy", 0)]
# Agents without a piece of speed-only code, measured beside the agent in the same blocks to
# say what each buys (docs/benchmarks.md's rule): Python code run in them before the agent.
WITHOUT = {
    "the answer cache (agent/kubelet/plugin.py)":
        "import agent.kubelet.plugin as p; p.REQUEST_KEPT_BYTES = -1; ",
}
# The growth run again, without a piece of code that exists only for memory: that code
# skips itself (agent/arenas.py leaves an operator's MALLOC_ARENA_MAX alone; glibc read the
# environment before this runs, so its default number of arenas stays).
WITHOUT_ARENA = 'import os; os.environ["MALLOC_ARENA_MAX"] = "glibc default"; '

_FLOOR = """
import sys
from concurrent import futures

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.kubelet.plugin import WORKERS

with open(sys.argv[2], "rb") as f:
    answer = dp.AllocateResponse.FromString(f.read())


class Floor(dp_grpc.DevicePluginServicer):
    def Allocate(self, request, context):
        return answer


server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS))
dp_grpc.add_DevicePluginServicer_to_server(Floor(), server)
server.add_insecure_port("unix:" + sys.argv[1])
server.start()
print("ready", flush=True)
sys.stdin.read()
server.stop(None)
"""


def _filesystem(path: str) -> str:
    """The filesystem type `path` is on (from /proc/mounts: the longest mount point over it)."""
    best, kind = "", "?"
    path = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            _, point, fstype = line.split()[:3]
            if (path == point or path.startswith(point.rstrip("/") + "/")) and \
                    len(point) > len(best):
                best, kind = point, fstype
    return kind


class _Agent:
    """`gpu-agent run` on a fresh simulated node with its state directory under `work`;
    `prelude`: a WITHOUT value."""

    def __init__(self, work: str, prelude: str = ""):
        self.work = tempfile.mkdtemp(prefix="a", dir=work)
        kdir, _, env = sim_node_env(self.work)
        self.kubelet = KubeletProcess(kdir, env)
        client = SimKubeletClient(kdir)
        after = client.state().last_event_seq
        self.run = _Run(self.work, kdir, env, prelude=prelude)
        _next(client, Kind.SNAPSHOT, after, "first device list")
        time.sleep(0.5)  # let start-up settle before reading memory
        self.rss_start = rss_mb(self.run.proc.pid)
        res = client.state().resource("nvidia.com/gpu")
        self.socket = os.path.join(kdir, res.endpoint)
        self.ids = sorted(d.id for d in res.devices)[:2]

    def stop(self) -> None:
        try:
            self.run.stop()
        finally:
            self.kubelet.stop()


class _Floor:
    def __init__(self, work: str, answer: bytes):
        path = os.path.join(work, "answer.bin")
        with open(path, "wb") as f:
            f.write(answer)
        self.socket = os.path.join(work, "floor.sock")
        self.proc = subprocess.Popen([sys.executable, "-c", _FLOOR, self.socket, path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the floor server did not start")

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


def _stub(socket: str) -> tuple[grpc.Channel, object]:
    channel = grpc.insecure_channel(f"unix:{socket}", options=OPTIONS)
    return channel, dp_grpc.DevicePluginStub(channel)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _pair(work: str, with_many: bool) -> dict:
    """One pair: a fresh agent and a floor answering its bytes, 1 caller in interleaved
    blocks (then, `with_many`, 64 callers against both); then a fresh agent answering
    GROWTH_CALLS Allocates that no pod claims, the same floor measured beside its first and
    last calls; RSS of both agents."""
    agent = floor = None
    others: list[_Agent] = []
    out: dict = {}
    try:
        agent = _Agent(work)
        others = [_Agent(work, prelude) for prelude in WITHOUT.values()]
        request = dp.AllocateRequest(container_requests=[
            dp.ContainerAllocateRequest(devices_ids=agent.ids)])
        channel, stub = _stub(agent.socket)
        floor = _Floor(work, stub.Allocate(request, timeout=10).SerializeToString())
        floor_channel, floor_stub = _stub(floor.socket)
        stubs = {"agent": stub, "floor": floor_stub, **{
            piece: _stub(other.socket)[1] for piece, other in zip(WITHOUT, others)}}
        for s in stubs.values():
            allocate_timed(s, request, 100)
        for name in stubs:
            out[name] = []
        for _ in range(BLOCKS):
            for name, s in stubs.items():
                out[name] += allocate_timed(s, request, BLOCK)
        for other in others:
            other.stop()
        others = []
        if with_many:
            many = {"agent": ([], 0.0), "floor": ([], 0.0)}
            for _ in range(ROUNDS):
                for name, sock in (("agent", agent.socket), ("floor", floor.socket)):
                    samples, wall = allocate_concurrently(sock, request, CALLERS, PER_CALLER)
                    many[name] = (many[name][0] + samples, many[name][1] + wall)
            out["many"] = many
        out["rss_first"] = agent.rss_start
        channel.close()
        agent.stop()
        agent = None

        agent = _Agent(work)  # a fresh journal for the growth run
        channel, stub = _stub(agent.socket)
        allocate_timed(stub, request, 50)  # the channel and the agent's first calls (50 records)
        # the floor beside the first and the last calls: the machine's speed then, to tell
        # the journal's growth from the VM's swings
        out["first"] = allocate_timed(stub, request, EDGE)
        out["floor_first"] = allocate_timed(floor_stub, request, EDGE)
        allocate_timed(stub, request, GROWTH_CALLS - 2 * EDGE)
        out["floor_last"] = allocate_timed(floor_stub, request, EDGE)
        out["last"] = allocate_timed(stub, request, EDGE)
        time.sleep(0.5)
        out["rss_start"], out["rss_after"] = agent.rss_start, rss_mb(agent.run.proc.pid)
        channel.close()
        agent.stop()
        agent = None

        agent = _Agent(work, WITHOUT_ARENA)
        channel, stub = _stub(agent.socket)
        allocate_timed(stub, request, GROWTH_CALLS + 50)
        time.sleep(0.5)
        out["arena_start"], out["arena_after"] = agent.rss_start, rss_mb(agent.run.proc.pid)
        channel.close()
        floor_channel.close()
        return out
    finally:
        for part in (agent, floor, *others):
            if part is not None:
                part.stop()


def run() -> Section:
    work = tempfile.mkdtemp(prefix="gabf", dir="/var/tmp")  # the machine's disk, not tmpfs
    fs = _filesystem(work)
    section = Section(
        title="Allocate against the gRPC floor (journal on disk), journal growth, memory",
        method=(
            "`gpu-agent run` (default settings, INFO logging to a file, state directory on "
            f"{fs} under /var/tmp) on the simulated node (its kubelet a process of its own, "
            "as kubelet is), and a bare grpcio server answering "
            "the agent's own AllocateResponse for the same 2-GPU request (same grpcio, same "
            f"worker count), and {len(WITHOUT)} more agent(s) each without one piece of "
            "speed-only code, all subprocesses. 1 caller: "
            f"{BLOCKS * BLOCK} calls to each in "
            f"{BLOCKS} alternating blocks of {BLOCK}, after 100 warm-up calls each. Growth: a "
            f"fresh agent answers 50 warm-up calls, then {GROWTH_CALLS:,} from 1 caller; no pod "
            "claims them, so "
            f"they all stay in its journal; p50 of the first and the last {EDGE} calls, and of "
            f"{EDGE} floor calls right after the first and right before the last; RSS "
            "(VmRSS) 0.5 s after the first device list and after the run. 64 callers (after "
            f"the first 1-caller run): {CALLERS} grpc.aio callers × {PER_CALLER} calls on one "
            f"channel, {ROUNDS} rounds per server, alternating. All of it is done {PAIRS} "
            "times, each with a fresh floor and fresh agents; a ratio is judged on the median "
            f"of the {PAIRS}, and RSS on the largest."),
        header=["measure", "median", "p99", "target", "met"],
    )
    try:
        pairs = [_pair(work, with_many=i == 0) for i in range(PAIRS)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    many = pairs[0]["many"]

    def row(name, samples, target="", met=None):
        section.rows.append([name, _ms(statistics.median(samples)), _ms(percentile(samples, 99)),
                             target, "" if met is None else ("yes" if met else "**no**")])

    p50s, p99s = [], []
    for i, one in enumerate(pairs, 1):
        a, f = one["agent"], one["floor"]
        p50s.append(statistics.median(a) / statistics.median(f))
        p99s.append(percentile(a, 99) / percentile(f, 99))
        row(f"Allocate, 1 caller, bare grpcio floor (pair {i})", f)
        row(f"Allocate, 1 caller, gpu-agent (pair {i}: {p50s[-1]:.2f}× p50, "
            f"{p99s[-1]:.2f}× p99)", a)
    p50, p99 = statistics.median(p50s), statistics.median(p99s)
    section.rows.append([f"**agent / floor** (median of {PAIRS})", f"{p50:.2f}×", f"{p99:.2f}×",
                         "p50 ≤ 1.25×, p99 ≤ 1.4×",
                         "yes" if p50 <= 1.25 and p99 <= 1.4 else "**no**"])
    for piece in WITHOUT:
        ratio = statistics.median(statistics.median(one[piece]) / statistics.median(one["floor"])
                                  for one in pairs)
        buys = statistics.median(1 - statistics.median(one["agent"]) /
                                 statistics.median(one[piece]) for one in pairs)
        section.rows.append([f"gpu-agent without {piece} / floor (median of {PAIRS}; the piece "
                             f"buys {buys:.0%} of the agent's p50)", f"{ratio:.2f}×", "",
                             "kept: buys ≥ 5%", "yes" if buys >= 0.05 else "**no**"])
    grow_ratios = []
    for i, g in enumerate(pairs, 1):
        grow = statistics.median(g["last"]) / statistics.median(g["first"])
        speed = statistics.median(g["floor_last"]) / statistics.median(g["floor_first"])
        grow_ratios.append(grow)
        row(f"Allocate, first {EDGE} of {GROWTH_CALLS:,} unclaimed (pair {i})", g["first"])
        row(f"Allocate, last {EDGE} of {GROWTH_CALLS:,} unclaimed (pair {i}: {grow:.2f}× the "
            f"first; the floor beside them: {speed:.2f}×)", g["last"])
    grow = statistics.median(grow_ratios)
    section.rows.append([f"**last {EDGE} / first {EDGE}** (median of {PAIRS})", f"{grow:.2f}×",
                         "", "p50 ≤ 1.1×", "yes" if grow <= 1.1 else "**no**"])
    for name in ("floor", "agent"):
        samples, wall = many[name]
        rate = len(samples) / wall
        section.rows.append([f"Allocate, {CALLERS} callers, {name}: {rate:,.0f}/s",
                             _ms(statistics.median(samples)), _ms(percentile(samples, 99)),
                             "≥ 2,000 Allocate/s" if name == "agent" else "",
                             ("yes" if rate >= 2000 else "**no**") if name == "agent" else ""])
    starts = [p[k] for p in pairs for k in ("rss_first", "rss_start")]
    rss_start = max(starts)
    growth = max(g["rss_after"] - g["rss_start"] for g in pairs)
    section.rows.append(["RSS after start (largest of "
                         f"{len(starts)}: {', '.join(f'{x:.1f}' for x in starts)})",
                         f"{rss_start:.1f} MB", "", "≤ 45 MB",
                         "yes" if rss_start <= 45 else "**no**"])
    section.rows.append([f"RSS after {GROWTH_CALLS:,} Allocates (largest growth of {PAIRS}: "
                         + ", ".join(f"{g['rss_start']:.1f} → {g['rss_after']:.1f}"
                                     for g in pairs) + ")",
                         f"+{growth:.1f} MB", "", "≤ start + 3 MB",
                         "yes" if growth <= 3 else "**no**"])
    growth_without = max(g["arena_after"] - g["arena_start"] for g in pairs)
    buys = 1 - growth / growth_without
    section.rows.append([f"RSS after {GROWTH_CALLS:,} Allocates without one malloc arena "
                         "(agent/arenas.py; largest growth of {PAIRS}: ".format(PAIRS=PAIRS)
                         + ", ".join(f"{g['arena_start']:.1f} → {g['arena_after']:.1f}"
                                     for g in pairs) + f"; the piece buys {buys:.0%})",
                         f"+{growth_without:.1f} MB", "", "kept: buys ≥ 5%",
                         "yes" if buys >= 0.05 else "**no**"])
    section.notes += [
        "The agent's Allocate: the answer kept by the request's bytes (or the request decoded "
        "by protobuf, the IDs resolved, the response built by agent/rm/allocate.py and "
        "serialized), one journal entry packed by msgpack and appended with one write (no "
        "fsync: the journal syncs every second in the background, docs/state.md), and the log "
        "line written.",
        "The agent 'without' runs in the same blocks as the agent and the floor, with a piece "
        "of speed-only code undone (WITHOUT in bench/bench_floor.py: no answer kept): what it "
        "buys, by the rule at the top.",
        "The growth run is done once more per pair by an agent without agent/arenas.py (glibc's "
        "default number of malloc arenas: WITHOUT_ARENA in bench/bench_floor.py): what one "
        "arena buys on the memory a user sees, by the rule at the top.",
        "The floor does nothing but return its message, so the gap is everything above; "
        "client and servers share the machine's two CPUs.",
        "Why several pairs: on this 2-CPU VM a pair of processes keeps an offset of its own for "
        "its whole life (where the scheduler puts its threads against the client's), about "
        "±0.04× on the p50 ratio from one pair to the next, while blocks interleaved within "
        "a pair agree closely; the growth ratio, its two ends seconds apart, swings more. One "
        "pair would judge that draw; the median of several judges the agent. Each pair's "
        "figures are in the table.",
    ]
    if QUICK:
        section.notes.append("BENCH_QUICK=1: a tenth of the calls (a smoke run, not figures).")
    return section
