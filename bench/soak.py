"""`make soak` (`python -m bench soak`): the agent under a steady load with faults, for minutes.

`gpu-agent run` on the simulated node (dgx1-v100, recovery quiet period 5 s, reconcile every
5 s, a config file) and the simulated kubelet, which admits pods as its device manager does
(GetPreferredAllocation then Allocate, over the real sockets) and deletes them, keeping at
most LIVE_PODS alive, at RATE pods a second; an XID 48 (reset class) every XID_EVERY_S on the
next GPU in turn; a kubelet restart every RESTART_EVERY_S; a SIGHUP every SIGHUP_EVERY_S,
alternating the device list strategy. At the end: the agent's RSS, open file descriptors and threads against their
values after the warm-up, the live pods' allocations in the journal (attributed to them), and
every GPU back. A pod kubelet refuses (no device free while a GPU is withdrawn and the live
pods hold the others, or kubelet restarting) is counted, not an error.

Owns: that load and its figures (a section of docs/benchmarks.md, kept by `make bench`).
Not in `make test`: it runs SOAK_S seconds (GPU_AGENT_SOAK_SECONDS shortens it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

from agent._proto.simkubelet.v1 import control_pb2 as ctl
from agent.sim import control, lib_path
from agent.sim.kubelet import PodRejected, SimKubelet, SimKubeletClient, SimKubeletError
from agent.state.journal import JOURNAL_FILE, read_journal
from bench import AGENT_COMMAND, Section, rss_mb, sim_node_env, stop_agent

TITLE = "Soak: pods, XIDs, kubelet restarts and SIGHUPs, for minutes"
SOAK_S = float(os.environ.get("GPU_AGENT_SOAK_SECONDS", "600"))
WARM_UP_S = 30.0
RATE = 50.0  # pods admitted a second (each: GetPreferredAllocation + Allocate)
LIVE_PODS = 4
XID_EVERY_S, RESTART_EVERY_S, SIGHUP_EVERY_S = 10.0, 30.0, 60.0
RESOURCE = "nvidia.com/gpu"
STRATEGIES = ("envvar", "volume-mounts")


def _proc(pid: int) -> tuple[float, int, int]:
    """(RSS MB, open fds, threads) of process `pid`."""
    with open(f"/proc/{pid}/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return rss_mb(pid), len(os.listdir(f"/proc/{pid}/fd")), threads


def _unclaimed(state_dir: str, pods: list[str]) -> list[str]:
    """The pods among `pods` that no journal record is attributed to."""
    journal = read_journal(os.path.join(state_dir, JOURNAL_FILE))
    held = {r.pod[1] for r in (journal.records if journal else ()) if r.pod is not None}
    return [p for p in pods if p not in held]


def _config(path: str, strategy: str) -> None:
    with open(path, "w") as f:
        f.write(f"version: v1\nflags:\n  plugin:\n    deviceListStrategy: {strategy}\n")


def run() -> Section:
    work = tempfile.mkdtemp(prefix="gasoak", dir="/tmp")
    kdir, ctl_dir, env = sim_node_env(work)
    kubelet = SimKubelet(kdir)
    kubelet.start()
    client = SimKubeletClient(kdir)
    config = os.path.join(work, "config.yaml")
    _config(config, STRATEGIES[0])
    state = os.path.join(work, "state")
    log = open(os.path.join(work, "agent.log"), "ab")  # closed below
    proc = subprocess.Popen(
        [*AGENT_COMMAND, "run", "--kubelet-socket", os.path.join(kdir, "kubelet.sock"),
         "--pod-resources-socket", os.path.join(kdir, "pod-resources", "kubelet.sock"),
         "--state-dir", state, "--nvml-library", str(lib_path()), "--config", config,
         "--recovery-quiet-period", "5s", "--reconcile-interval", "5s",
         "--metrics-address", ""],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        client.wait_for_event(lambda e: e.kind == ctl.Event.Kind.SNAPSHOT and
                              e.resource_name == RESOURCE, after_seq=0, timeout=30,
                              what="the first device list")
        counts = dict(admitted=0, refused=0, xids=0, restarts=0, sighups=0)
        live: list[str] = []
        start = time.monotonic()
        baseline = None
        next_pod = start
        next_xid, next_restart, next_hup = (start + XID_EVERY_S, start + RESTART_EVERY_S,
                                            start + SIGHUP_EVERY_S)
        n = 0
        while (now := time.monotonic()) < start + SOAK_S:
            if baseline is None and now >= start + WARM_UP_S:
                baseline = _proc(proc.pid)
            if now >= next_xid:
                control.inject_xid(ctl_dir, counts["xids"] % 8, 48)
                counts["xids"] += 1
                next_xid += XID_EVERY_S
            if now >= next_restart:
                client.restart()
                counts["restarts"] += 1
                next_restart += RESTART_EVERY_S
            if now >= next_hup:
                counts["sighups"] += 1
                _config(config, STRATEGIES[counts["sighups"] % 2])
                proc.send_signal(signal.SIGHUP)
                next_hup += SIGHUP_EVERY_S
            if now < next_pod:
                time.sleep(min(next_pod, next_xid, next_restart, next_hup) - now)
                continue
            next_pod += 1.0 / RATE
            if len(live) >= LIVE_PODS:
                client.delete_pod(live.pop(0))
            n += 1
            try:
                client.admit_pod(f"soak-{n}", {"main": {RESOURCE: 1}})
                live.append(f"soak-{n}")
                counts["admitted"] += 1
            except (PodRejected, SimKubeletError):
                counts["refused"] += 1
        elapsed = time.monotonic() - start
        end = _proc(proc.pid)
        # every GPU back after its quiet period (the last XID is at most XID_EVERY_S old)
        deadline = time.monotonic() + 30
        while client.state().resource(RESOURCE).allocatable != 8 and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        allocatable = client.state().resource(RESOURCE).allocatable
        # the live pods' records claimed by them (a reconcile every 5 s attributes them)
        while (lost := _unclaimed(state, live)) and time.monotonic() < deadline + 15:
            time.sleep(0.2)
        alive = proc.poll() is None
        stop_agent(proc, 30)
        lost = _unclaimed(state, live)  # as the stopped agent left its journal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        client.close()
        kubelet.stop()
        shutil.rmtree(work, ignore_errors=True)
    if baseline is None:
        raise RuntimeError(f"the soak ran {elapsed:.0f} s, less than its {WARM_UP_S:g} s warm-up")
    rss0, fds0, threads0 = baseline
    rss1, fds1, threads1 = end
    section = Section(
        title=TITLE,
        method=(f"`gpu-agent run` on the simulated node (dgx1-v100, recovery quiet period "
                f"5 s, reconcile every 5 s, a config file) for {elapsed:.0f} s: the simulated "
                f"kubelet admits "
                f"{RATE:g} pods a second (each a GetPreferredAllocation and an Allocate, as "
                f"its device manager calls them) and deletes the oldest beyond {LIVE_PODS}; "
                f"an XID 48 every {XID_EVERY_S:g} s on the next GPU, a kubelet restart every "
                f"{RESTART_EVERY_S:g} s, a SIGHUP every {SIGHUP_EVERY_S:g} s alternating the "
                f"device list strategy. Baseline after a {WARM_UP_S:g} s warm-up. "
                f"`make soak`, run {time.strftime('%Y-%m-%d %H:%M %Z')}."),
        header=["measure", "after warm-up", "at the end", "target", "met"],
    )
    section.rows += [
        ["RSS", f"{rss0:.1f} MB", f"{rss1:.1f} MB", "growth ≤ 2 MB",
         f"{rss1 - rss0:+.1f} MB ({'yes' if rss1 - rss0 <= 2 else '**no**'})"],
        ["open file descriptors", str(fds0), str(fds1), "no growth",
         "yes" if fds1 <= fds0 else f"**no** ({fds1 - fds0:+d})"],
        ["threads", str(threads0), str(threads1), "no growth",
         "yes" if threads1 <= threads0 else f"**no** ({threads1 - threads0:+d})"],
        ["live pods' allocations in the journal, attributed to them", "",
         f"{len(live) - len(lost)} of {len(live)}",
         "all", "yes" if not lost else f"**no** (missing: {', '.join(lost)})"],
        ["GPUs allocatable after the last quiet period", "", f"{allocatable} of 8", "8",
         "yes" if allocatable == 8 else "**no**"],
        ["agent alive at the end", "", "yes" if alive else "no", "yes",
         "yes" if alive else "**no**"],
    ]
    section.notes.append(
        f"{counts['admitted']} pods admitted, {counts['refused']} refused by kubelet (no "
        f"device free, or kubelet restarting), {counts['xids']} XIDs, {counts['restarts']} "
        f"kubelet restarts, {counts['sighups']} SIGHUPs.")
    return section
