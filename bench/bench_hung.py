"""A GPU whose NVML calls hang for 30 s: Allocate on the other GPUs and the systemd watchdog.

`gpu-agent run` on the simulated dgx1-v100 node with the default NVML call budget
(agent.nvmlCallTimeout 5 s), its metrics endpoint scraped every second by a scraper process
(Prometheus' request) throughout, and systemd's watchdog stood in for by a notify socket
(WATCHDOG_USEC 2 s: a ping every second). One blocking caller allocates two other GPUs
without pause for PHASE_S seconds with every GPU answering, PHASE_S seconds while GPU 3's
calls block (`gpu-agent sim hang`, the whole phase), and PHASE_S seconds after; each phase
starts with a SIGHUP, so the reload in the hung phase reads GPU 3 from the main loop.

Owns: that measurement: Allocate p50/p99 in the hung phase against the two others together
(the reference, same agent, same run), the longest gap between watchdog pings and the pings
later than systemd's limit, and how long GPU 3 took to be withdrawn after the hang began and
to return after it ended (from the simulated kubelet's ListAndWatch).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.sim import control
from agent.sim.profile import load_profile
from bench import Section, allocate_timed, percentile
from bench.bench_metrics import Agent, Node, Scraper
from tests.daemon_harness import NotifySocket

PHASE_S = float(os.environ.get("GPU_AGENT_HUNG_PHASE_S", "30"))
HUNG_GPU = 3
WATCHDOG_USEC = 2_000_000
BLOCK = 200  # Allocates between clock checks
RESOURCE = "nvidia.com/gpu"


class _Timeline(threading.Thread):
    """Polls the simulated kubelet every 50 ms through every phase (the same client-side load
    in each): the times GPU `uuid` was seen healthy and unhealthy."""

    def __init__(self, node: Node, uuid: str):
        super().__init__(daemon=True)
        self.node, self.uuid = node, uuid
        self.seen: list[tuple[float, bool]] = []
        self._done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._done.wait(0.05):
            devices = self.node.client.state().resource(RESOURCE).devices
            self.seen.append((time.monotonic(), any(d.id == self.uuid and d.healthy
                                                    for d in devices)))

    def first(self, healthy: bool, after: float) -> float | None:
        """Seconds from `after` until the GPU was first seen `healthy`, or None."""
        return next((t - after for t, h in self.seen if t >= after and h == healthy), None)

    def stop(self) -> None:
        self._done.set()
        self.join()


def _phase(stub, request, agent: Agent, seconds: float) -> list[float]:
    agent.proc.send_signal(signal.SIGHUP)
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out += allocate_timed(stub, request, BLOCK)
    return out


def run() -> Section:
    section = Section(
        title="A GPU whose NVML calls hang: Allocate and the watchdog",
        method=(f"`gpu-agent run` on the simulated dgx1-v100 node, agent.nvmlCallTimeout 5 s "
                f"(the default), scraped every second (a scraper process, Prometheus' request) "
                f"and pinging a notify socket (WATCHDOG_USEC {WATCHDOG_USEC // 1000} ms: every "
                f"second). One blocking caller allocates GPUs 0 and 1 without pause: "
                f"{PHASE_S:g} s with every GPU answering, {PHASE_S:g} s while every NVML call "
                f"on GPU {HUNG_GPU} blocks (`gpu-agent sim hang`), {PHASE_S:g} s after. Each "
                f"phase begins with a SIGHUP (the reload reads every GPU from the main loop). "
                f"Reference: the phases before and after, same agent, same run."),
        header=["measure", "value", "target", "met"],
    )
    node = Node("dgx1-v100")
    watchdog = NotifySocket(None, abstract=True)  # the tests' stand-in for systemd
    env = dict(node.env, NOTIFY_SOCKET=watchdog.address, WATCHDOG_USEC=str(WATCHDOG_USEC))
    agent = Agent(node.work, node.kdir, env, node.client, "--metrics-address", "127.0.0.1:0")
    scraper = None
    try:
        scraper = Scraper(f"http://127.0.0.1:{agent.port()}/metrics")
        scraper.go()
        uuids = [g["uuid"] for g in load_profile("dgx1-v100")["gpus"]]
        hung_uuid = uuids[HUNG_GPU]
        request = dp.AllocateRequest(container_requests=[
            dp.ContainerAllocateRequest(devices_ids=uuids[:2])])
        with grpc.insecure_channel(f"unix:{os.path.join(node.kdir, 'gpu-agent-gpu.sock')}",
                                   options=[("grpc.enable_http_proxy", 0)]) as ch:
            stub = dp_grpc.DevicePluginStub(ch)
            allocate_timed(stub, request, 200)
            timeline = _Timeline(node, hung_uuid)
            started = time.monotonic()
            before = _phase(stub, request, agent, PHASE_S)
            hung_at = time.monotonic()
            control.hang(node.ctl, HUNG_GPU, PHASE_S)
            hung = _phase(stub, request, agent, PHASE_S)
            ended = hung_at + PHASE_S
            after = _phase(stub, request, agent, PHASE_S)
            finished = time.monotonic()
            timeline.stop()
            withdrawn, back = timeline.first(False, hung_at), timeline.first(True, ended)
        pings = [t for m, t in zip(watchdog.messages, watchdog.times) if m.get("WATCHDOG") == "1"]
        gaps = [b - a for a, b in zip(pings, pings[1:]) if a >= started and b <= finished]
    finally:
        if scraper is not None:
            scraper.close()
        agent.stop()
        watchdog.close()
        node.close()
    normal = before + after
    ratio50 = percentile(hung, 50) / percentile(normal, 50)
    ratio99 = percentile(hung, 99) / percentile(normal, 99)
    limit = WATCHDOG_USEC / 1e6
    section.rows = [
        ["Allocate p50, every GPU answering / GPU 3 hung",
         f"{percentile(normal, 50) * 1e3:.2f} / {percentile(hung, 50) * 1e3:.2f} ms "
         f"({ratio50:.2f}x)", "", ""],
        ["Allocate p99, every GPU answering / GPU 3 hung",
         f"{percentile(normal, 99) * 1e3:.2f} / {percentile(hung, 99) * 1e3:.2f} ms "
         f"({ratio99:.2f}x)", "<= 1.2x", "yes" if ratio99 <= 1.2 else "no"],
        ["Allocates (normal / hung)", f"{len(normal)} / {len(hung)}", "", ""],
        ["watchdog pings; longest gap", f"{len(gaps) + 1}; {max(gaps):.2f} s",
         f"< {limit:g} s", "yes" if max(gaps) < limit else "no"],
        ["pings later than WATCHDOG_USEC", str(sum(g >= limit for g in gaps)), "0",
         "yes" if all(g < limit for g in gaps) else "no"],
        ["GPU 3 withdrawn after the hang began",
         "never" if withdrawn is None else f"{withdrawn:.2f} s", "", ""],
        ["GPU 3 back after the hang ended", "never" if back is None else f"{back:.2f} s",
         "", ""],
        ["GPU 3 withdrawn before the hang", str(sum(not h for t, h in timeline.seen
                                                     if t < hung_at)), "0", ""],
    ]
    section.notes = [
        "GPU 3 is withdrawn by the reload's discovery call (the SIGHUP at the start of the "
        "hung phase) or the first scrape's telemetry call, whichever reaches the 5 s budget "
        "first; afterwards calls on it fail at once until the hung call returns, and the next "
        "recovery probe (every 0.25 s) returns it.",
        "Allocate never calls NVML; what the hang can cost it is the CPU and GIL time of the "
        "threads that notice and handle it.",
    ]
    return section

