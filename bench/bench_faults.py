"""The figures of each fault in docs/reliability.md: how long the agent takes to act and to
recover, what it refused meanwhile, what it kept.

Each fault is made as its test in tests/test_faults.py (and the tests named in
docs/reliability.md) makes it, on the simulated dgx1-v100 node with the simulated kubelet,
through tests/daemon_harness.py (the same harness, so the figure is of the checked scenario):
`gpu-agent run` as a subprocess, a thread calling Allocate on GPU 0 throughout where the fault
happens during Allocates. Times are from the fault (or its end) to the change kubelet saw, from
the simulated kubelet's allocatable history (its own CLOCK_MONOTONIC stamps, not polling).

Owns: those scenarios and their figures (one row each). A fault that needs root (a full or
read-only state directory: mounts) is reported as not measured otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import grpc

from agent.errors import CheckpointError
from agent.sim import control
from agent.sim.profile import load_profile
from agent.state.journal import JOURNAL_FILE, read_journal
from bench import Section, wait_until
from tests.daemon_harness import GPU, Node, ReadOnlyMount, changed_files, write_files

UUIDS = [g["uuid"] for g in load_profile("dgx1-v100")["gpus"]]
FLAP_RUNS = 3


class _Allocating:
    """Allocate GPU 0 without pause on another thread; answers and refusals counted."""

    def __init__(self, agent):
        self.agent, self.answered, self.refused = agent, 0, 0
        self.reasons: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.agent.allocate([UUIDS[0]])
                self.answered += 1
            except grpc.RpcError as exc:
                self.refused += 1
                self.reasons.add(exc.code().name)

    def next_answer(self) -> float:
        """Seconds from now until the next Allocate answered."""
        t0, answered = time.monotonic(), self.answered
        while self.answered == answered:
            time.sleep(0.001)
        return time.monotonic() - t0

    def stop(self) -> str:
        self._stop.set()
        self._thread.join()
        refused = f"{self.refused} refused" + (f" ({', '.join(sorted(self.reasons))})"
                                               if self.reasons else "")
        return f"{self.answered} Allocates answered, {refused}"


def _running(node: Node, *args: str):
    """`gpu-agent run ARGS` on `node`, registered, with Allocates on GPU 0 going on."""
    agent = node.agent(*args)
    agent.wait_registered()
    return agent, _Allocating(agent)


def _when(node: Node, after_ns: int, allocatable: int) -> float:
    """Seconds from `after_ns` (monotonic) to kubelet's first allocatable == `allocatable`
    after it."""
    for change in node.client.allocatable_history(GPU):
        if change.monotonic_ns >= after_ns and change.allocatable == allocatable:
            return (change.monotonic_ns - after_ns) / 1e9
    raise RuntimeError(f"allocatable never {allocatable} after the fault")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def _xid_reset() -> list[str]:
    with Node() as node:
        agent, allocating = _running(node, "--recovery-quiet-period", "1s")
        t0 = time.monotonic_ns()
        control.inject_xid(node.ctl, 3, 48)
        agent.wait_for(lambda s: s.resource(GPU).allocatable == 7, "GPU 3 withdrawn")
        agent.wait_for(lambda s: s.resource(GPU).allocatable == 8, "GPU 3 back")
        out = allocating.stop()
        withdrawn, back = _when(node, t0, 7), _when(node, t0, 8)
        agent.stop()
    return ["XID 48 (reset class), quiet period 1 s",
            f"withdrawn {_ms(withdrawn)} after the XID; back {back:.2f} s after it; {out}"]


def _lost() -> list[str]:
    with Node() as node:
        agent, allocating = _running(node, "--recovery-quiet-period", "0.5s")
        t0 = time.monotonic_ns()
        control.lose(node.ctl, 2)
        agent.wait_for(lambda s: s.resource(GPU).allocatable == 7, "GPU 2 withdrawn")
        t1 = time.monotonic_ns()
        control.restore(node.ctl, 2)
        agent.wait_for(lambda s: s.resource(GPU).allocatable == 8, "GPU 2 back")
        out = allocating.stop()
        withdrawn, back = _when(node, t0, 7), _when(node, t1, 8)
        agent.stop()
    return ["A GPU lost, then restored (quiet period 0.5 s), during Allocates",
            f"withdrawn {_ms(withdrawn)} after it fell off; back {back:.2f} s after the "
            f"restore; {out}"]


def _storm() -> list[str]:
    with Node() as node:
        agent, allocating = _running(node, "--recovery-quiet-period", "600s")
        t0 = time.monotonic_ns()
        for i in range(300):
            gpu = 1 + i % 7
            control.inject_xid(node.ctl, gpu, 48 if gpu <= 3 else 13)
        agent.wait_for(lambda s: s.resource(GPU).allocatable == 5, "GPUs 1-3 withdrawn")
        out = allocating.stop()
        done = _when(node, t0, 5)
        agent.stop()
    return ["An XID storm: 300 XIDs on 7 GPUs (3 of them withdrawing) during Allocates",
            f"the 3 struck GPUs withdrawn {_ms(done)} after the first XID; during the storm "
            f"{out}"]


def _sighups() -> list[str]:
    strategies = ["envvar", "volume-mounts"]
    with Node() as node:
        config = node.write("config.yaml", "version: v1\n")
        agent = node.agent("--config", config)
        agent.wait_registered()
        since = time.monotonic_ns()
        allocating = _Allocating(agent)
        for n in range(50):
            node.write("config.yaml", "version: v1\nflags:\n  plugin:\n    deviceListStrategy: "
                                      f"{strategies[n % 2]}\n")
            agent.send(signal.SIGHUP)
        sent = time.monotonic()
        agent.wait_for(lambda s: agent.allocate([UUIDS[1]]).container_responses[0].envs[
            "NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices", "the last config")
        live = time.monotonic() - sent
        out = allocating.stop()
        windows = node.client.zero_windows(GPU, since)
        agent.stop()
    return ["50 SIGHUPs back to back during Allocates",
            f"the last config live {_ms(live)} after the last signal; {len(windows)} windows "
            f"with no device; {out}"]


def _flapping() -> list[str]:
    times, registrations = [], []
    for _ in range(FLAP_RUNS):  # it varies: kubelet's dial of our socket may back off
        with Node() as node:
            agent = node.agent()
            agent.wait_registered()
            first = node.client.state().restarts
            for _ in range(99):
                node.client.restart()
            t0 = time.monotonic_ns()
            node.client.restart()
            last = first + 100
            agent.wait_for(lambda s, last=last: s.restarts == last and
                           s.resource(GPU).connected and s.resource(GPU).allocatable == 8,
                           "registered with the last kubelet")
            times.append(next(c.monotonic_ns - t0 for c in node.client.allocatable_history(GPU)
                              if c.instance == last and c.allocatable == 8) / 1e9)
            registrations.append(node.client.registrations_per_instance(GPU)[last])
            agent.stop()
    times.sort()
    return [f"kubelet restarted 100 times without waiting ({FLAP_RUNS} runs)",
            f"registered with the last kubelet {', '.join(_ms(t) for t in times)} after its "
            f"restart began; {', '.join(map(str, registrations))} registration with it"]


def _podresources_silent() -> list[str]:
    import socket

    with Node() as node:
        path = node.path("silent.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(16)
        held: list[socket.socket] = []
        threading.Thread(target=lambda: _accept(listener, held), daemon=True).start()
        try:
            agent = node.agent("--pod-resources-socket", path)
            agent.wait_registered()
            t0 = time.monotonic()
            allocating = _Allocating(agent)
            agent.wait_log(f"podresources List on {path} failed: DEADLINE_EXCEEDED", timeout=30)
            reported = time.monotonic() - t0
            out = allocating.stop()
            agent.stop()
        finally:
            listener.close()
            for conn in held:
                conn.close()
    return ["podresources accepts and never answers, during Allocates",
            f"the reconcile's call timed out and was reported {reported:.1f} s after the "
            f"registration (its deadline is 5 s); {out}"]


def _accept(listener, held) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        held.append(conn)


def _kill9() -> list[str]:
    with Node() as node:
        agent = node.agent()
        agent.wait_registered()
        answered = []
        for i in range(200):
            agent.allocate([UUIDS[i % 8]])
            answered.append(UUIDS[i % 8])
        agent.kill()
        journal = read_journal(os.path.join(node.state, JOURNAL_FILE))
        kept = len(journal.records) if journal else 0
        agent = node.agent()
        agent.wait_registered(2)
        t0 = time.monotonic()
        agent.allocate([UUIDS[0]])  # waits for the journal to load
        loaded = time.monotonic() - t0
        agent.stop()
    return ["kill -9 after 200 answered Allocates",
            f"{kept} of 200 records in the journal; the next agent answered its first "
            f"Allocate {_ms(loaded)} after registering"]


def _attributed(node: Node) -> int:
    """Records attributed to a pod in the node's journal (0 while it is unreadable: the bad
    one before it is set aside)."""
    try:
        journal = read_journal(os.path.join(node.state, JOURNAL_FILE))
    except CheckpointError:
        return 0
    return sum(r.pod is not None for r in journal.records) if journal else 0


def _corrupt_journal() -> list[str]:
    with Node() as node:
        agent = node.agent()
        agent.wait_registered()
        for n in range(4):
            node.client.admit_pod(f"pod-{n}", {"main": {GPU: 2}})
        wait_until(lambda: _attributed(node) == 4, "4 attributed records")
        agent.stop()
        path = os.path.join(node.state, JOURNAL_FILE)
        with open(path, "rb") as f:
            bad = b"\x83 a checkpoint of some other program" + f.read()
        with open(path, "wb") as f:
            f.write(bad)
        t0 = time.monotonic()
        agent = node.agent()
        agent.wait_registered(2)
        registered = time.monotonic() - t0
        wait_until(lambda: _attributed(node) == 4, "the allocations adopted from podresources")
        adopted = time.monotonic() - t0
        aside = [n for n in os.listdir(node.state) if n.startswith(JOURNAL_FILE + ".bad-")]
        with open(os.path.join(node.state, aside[0]), "rb") as f:
            kept = f.read() == bad
        agent.stop()
    return ["A corrupt journal at start (4 pods running)",
            f"registered {_ms(registered)} after the start; 4 of 4 running pods' allocations "
            f"adopted from podresources {_ms(adopted)} after it; the bad file kept aside "
            f"{'byte for byte' if kept else 'CHANGED'}"]


def _unknown_files() -> list[str]:
    strangers = {"notes.txt": b"an operator's note\n", "allocations.journal.bak": b"x\n",
                 "health.json.old": b"{}"}
    with Node() as node:
        write_files(node.state, strangers)
        agent = node.agent()
        agent.wait_registered()
        agent.allocate([UUIDS[0]])
        agent.stop()
        kept = len(strangers) - len(changed_files(node.state, strangers))
    return ["Unknown files in the state directory",
            f"{kept} of {len(strangers)} left byte for byte after a start, an Allocate and a stop"]


def _init_recovers() -> list[str]:
    with Node() as node:
        profile = node.profile_copy(faults="  init: DRIVER_NOT_LOADED\n")
        agent = node.agent("--fail-on-init-error", "false",
                           env=node.env(GPU_AGENT_SIM_PROFILE=profile))
        agent.wait_log("retrying NVML in 1 s")
        t0 = time.monotonic_ns()
        node.profile_copy()  # the "driver" is loaded now
        agent.wait_registered(1)
        up = _when(node, t0, 8)
        agent.stop()
    return ["NVML init failing, then the driver loaded",
            f"registered with 8 GPUs {up:.2f} s after the driver came (retries at 1, 2, 4 "
            f"... 30 s)"]


def _full_disk() -> list[str]:
    what = "State directory full during Allocates"
    if os.geteuid() != 0:
        return [what, "not measured (mounting a small tmpfs needs root)"]
    with Node() as node:
        os.makedirs(node.state, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", node.state],
                       check=True)
        try:
            agent, allocating = _running(node)
            filler = os.open(os.path.join(node.state, "filler"), os.O_WRONLY | os.O_CREAT,
                             0o600)
            try:
                while True:
                    os.write(filler, b"x" * 512)
            except OSError:
                os.close(filler)
            while allocating.refused == 0:
                time.sleep(0.01)
            os.unlink(os.path.join(node.state, "filler"))
            back = allocating.next_answer()
            out = allocating.stop()
            agent.stop()
        finally:
            subprocess.run(["umount", "-l", node.state], check=False)
    return [what, f"Allocates refused (UNAVAILABLE, the reason given) while full, answered "
                  f"again {_ms(back)} after space was freed; {out}"]


def _read_only() -> list[str]:
    what = "State directory read-only at start"
    if os.geteuid() != 0:
        return [what, "not measured (a read-only bind mount needs root)"]
    with Node() as node:
        os.makedirs(node.state, exist_ok=True)
        with ReadOnlyMount(node.state):
            agent, allocating = _running(node)
            while allocating.refused < 100:
                time.sleep(0.01)
        back = allocating.next_answer()  # from the unmount on
        out = allocating.stop()
        agent.stop()
    return [what, f"Allocates refused (UNAVAILABLE: Read-only file system) while read-only; "
                  f"answered again {_ms(back)} after it was writable; {out}"]


SCENARIOS = [_xid_reset, _lost, _storm, _sighups, _flapping, _podresources_silent, _kill9,
             _corrupt_journal, _unknown_files, _init_recovers, _full_disk, _read_only]


def run() -> Section:
    section = Section(
        title="Faults: time to act and recover, requests refused, records kept",
        method=("Each fault of docs/reliability.md made as its test makes it (tests/"
                "daemon_harness.py: `gpu-agent run` on the simulated dgx1-v100 node and the "
                "simulated kubelet), once, with a thread calling Allocate on GPU 0 without "
                "pause where the fault happens during Allocates. Times from the fault (or its "
                "end) to the change the simulated kubelet recorded (its allocatable history, "
                "CLOCK_MONOTONIC), or to the first Allocate answered again. A GPU whose NVML "
                "calls hang: the section above."),
        header=["fault", "figure"],
    )
    section.rows = [scenario() for scenario in SCENARIOS]
    return section
