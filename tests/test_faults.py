"""Faults from outside the agent, end to end: `gpu-agent run` on the simulated NVML and the
simulated kubelet, with the fault made while kubelet (here: this test) keeps calling Allocate.

Covers a podresources server that accepts connections and never answers (its calls time out,
the failure is reported, and Allocate, ListAndWatch and the stop never wait on it); an XID
storm during Allocates (exactly the GPUs struck by a withdrawing XID are withdrawn, every
Allocate on the others is answered); 50 SIGHUPs sent back to back during Allocates (none
refused, the resource never drops to 0, the last config is the one live); a GPU lost and
restored during Allocates on another; kubelet flapping 100 times without waiting for the
agent (it ends registered once with the last kubelet); unknown files in the state
directory (left as they are); and a GPU whose NVML calls hang (`gpu-agent sim hang`), at run
time and at start: it is withdrawn as "NVML not answering" while Allocate, ListAndWatch,
reloads, scrapes and the systemd watchdog go on, and returns (or is discovered) once it
answers; and a state directory made read-only (a read-only bind mount, as when the kernel
remounts a failing disk read-only) while the agent runs and at its start: nothing answered is
lost, and what could not be written is written once the directory is writable again. The
full disk, the corrupt state files, kill -9 and NVML init failing then recovering have their
tests beside the code they exercise (test_state_daemon, test_daemon_lifecycle). Nothing here
asserts on timing.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import urllib.request

import grpc
import pytest

from agent.sim import control
from agent.sim.profile import load_profile
from agent.state.journal import JOURNAL_FILE, read_journal
from tests.daemon_harness import (
    GPU,
    Node,
    NotifySocket,
    ReadOnlyMount,
    changed_files,
    unhealthy,
    write_files,
)

UUIDS = [g["uuid"] for g in load_profile("dgx1-v100")["gpus"]]


@pytest.fixture
def node():
    with Node() as n:
        yield n


class _Allocating:
    """A thread calling Allocate for `ids` on `agent` until stopped; every answer and error
    is kept."""

    def __init__(self, agent, ids: list[str]):
        self.agent, self.ids = agent, ids
        self.answered = 0
        self.errors: list[grpc.RpcError] = []
        self.started = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self.started.wait()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                resp = self.agent.allocate(self.ids)
                assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"]
                self.answered += 1
            except grpc.RpcError as exc:
                self.errors.append(exc)
            self.started.set()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.answered


def _silent_server(path: str) -> tuple[socket.socket, list[socket.socket]]:
    """A unix socket that accepts every connection and never sends a byte."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed by the test
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return listener, held


def test_a_podresources_server_that_never_answers_times_out_and_nothing_else_waits(node):
    path = node.path("silent-podresources.sock")
    listener, held = _silent_server(path)
    try:
        agent = node.agent("--pod-resources-socket", path)
        agent.wait_registered()
        allocating = _Allocating(agent, [UUIDS[0]])
        failed = f"podresources List on {path} failed: DEADLINE_EXCEEDED"
        agent.wait_log(failed)  # the first reconcile pass waited its deadline out
        assert held, "the agent connected to the silent server"
        assert allocating.answered > 0  # ... while Allocates were answered
        allocating.stop()
        assert failed in node.status_with(failed)  # reported where operators look
        assert allocating.errors == []
        assert node.client.state().resource(GPU).connected  # the stream never ended
        assert agent.stop() == 0  # a call in flight does not hold up the stop
    finally:
        listener.close()
        for conn in held:
            conn.close()


def test_an_xid_storm_during_allocates_withdraws_exactly_the_struck_gpus(node):
    agent = node.agent("--recovery-quiet-period", "600s")
    agent.wait_registered()
    allocating = _Allocating(agent, [UUIDS[0]])
    struck = {UUIDS[1], UUIDS[2], UUIDS[3]}
    for i in range(300):  # GPUs 1-3 take a double-bit ECC XID, 4-7 an application error
        gpu = 1 + i % 7
        control.inject_xid(node.ctl, gpu, 48 if gpu <= 3 else 13)
    agent.wait_for(lambda s: unhealthy(s.resource(GPU).latest_snapshot) == struck,
                   "GPUs 1-3 withdrawn")
    answered = allocating.stop()
    assert answered > 0 and allocating.errors == []
    assert node.client.state().resource(GPU).allocatable == 5
    res = node.client.state().resource(GPU)
    assert res.connected and res.registrations == 1  # served through it all, one stream
    out = node.status_with("ignored XIDs")
    assert "unhealthy: " in out
    assert agent.alive()
    assert agent.stop() == 0


def test_fifty_sighups_back_to_back_during_allocates_refuse_nothing(node):
    strategies = ["envvar", "volume-mounts"]
    config = node.write("config.yaml", "version: v1\n")
    agent = node.agent("--config", config)
    agent.wait_registered()
    since = time.monotonic_ns()
    allocating = _Allocating(agent, [UUIDS[0]])
    for n in range(50):  # as fast as the writes go: signals may merge into fewer reloads
        node.write("config.yaml", "version: v1\nflags:\n  plugin:\n    deviceListStrategy: "
                                  f"{strategies[n % 2]}\n")
        agent.send(signal.SIGHUP)
    # the last config is the one live: volume-mounts answers with the mount-list path
    agent.wait_for(lambda s: agent.allocate([UUIDS[1]]).container_responses[0].envs[
        "NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices", "the last config live")
    answered = allocating.stop()
    assert answered > 0 and allocating.errors == []
    assert node.client.zero_windows(GPU, since) == []
    res = node.client.state().resource(GPU)
    assert res.connected and res.registrations == 1 and res.allocatable == 8
    assert "Traceback" not in agent.log and agent.stop() == 0


def test_a_gpu_lost_and_restored_during_allocates_on_another(node):
    agent = node.agent("--recovery-quiet-period", "0.5s")
    agent.wait_registered()
    allocating = _Allocating(agent, [UUIDS[0]])
    control.lose(node.ctl, 2)
    agent.wait_for(lambda s: {d.id for d in s.resource(GPU).devices if not d.healthy} ==
                   {UUIDS[2]}, "GPU 2 withdrawn")
    control.restore(node.ctl, 2)
    agent.wait_for(lambda s: s.resource(GPU).allocatable == 8, "GPU 2 back")
    answered = allocating.stop()
    assert answered > 0 and allocating.errors == []
    assert agent.allocate([UUIDS[2]]).container_responses[0].envs[
        "NVIDIA_VISIBLE_DEVICES"] == UUIDS[2]
    assert agent.stop() == 0


def test_kubelet_flapping_a_hundred_times_ends_with_one_registration_to_the_last(node):
    agent = node.agent()
    agent.wait_registered()
    first = node.client.state().restarts
    for _ in range(100):  # without waiting for the agent in between
        node.client.restart()
    last = first + 100
    agent.wait_for(lambda s: s.restarts == last and s.resource(GPU).connected
                   and s.resource(GPU).allocatable == 8, "registered with the last kubelet")
    assert agent.alive()
    per_instance = node.client.registrations_per_instance(GPU)
    assert per_instance[last] == 1 and all(n <= 1 for n in per_instance.values()), per_instance
    assert agent.allocate([UUIDS[0]]).container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"]
    assert "Traceback" not in agent.log and agent.stop() == 0


def test_unknown_files_in_the_state_directory_are_left_as_they_are(node):
    strangers = {"notes.txt": b"an operator's note\n", "notes.d/x": b"\x00\xff",
                 "allocations.journal.bak": b"not ours to judge\n"}
    write_files(node.state, strangers)
    agent = node.agent()
    agent.wait_registered()
    agent.allocate([UUIDS[0]])
    assert agent.stop() == 0
    assert changed_files(node.state, strangers) == []
    assert "ERROR" not in agent.log


# -- a GPU whose NVML calls hang ---------------------------------------------------------------

WATCHDOG_USEC = 3_000_000  # the agent pings every 1.5 s; systemd would kill it after 3 s without


def _metrics_port(node) -> int:
    doc = node.status_when(lambda d: (d.get("metrics") or {}).get("listening"),
                           "the metrics endpoint listening")
    return doc["metrics"]["port"]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return r.read().decode()


def _watchdog_gaps(notify) -> list[float]:
    """Seconds between consecutive WATCHDOG=1 pings."""
    times = [t for m, t in zip(notify.messages, notify.times) if m.get("WATCHDOG") == "1"]
    return [b - a for a, b in zip(times, times[1:])]


def test_a_gpu_whose_nvml_calls_hang_is_withdrawn_and_nothing_waits_on_it(node):
    notify = NotifySocket(node)
    try:
        agent = node.agent("--nvml-call-timeout", "500ms", "--recovery-quiet-period", "600s",
                           env=node.env(NOTIFY_SOCKET=notify.address,
                                        WATCHDOG_USEC=str(WATCHDOG_USEC)))
        agent.wait_registered()
        port = _metrics_port(node)
        allocating = _Allocating(agent, [UUIDS[0]])
        control.hang(node.ctl, 3, 600)
        hung_at = len(notify.messages)
        agent.send(signal.SIGHUP)  # the reload reads the GPUs again: GPU 3 does not answer
        agent.wait_for(lambda s: unhealthy(s.resource(GPU).latest_snapshot) == {UUIDS[3]},
                       "GPU 3 withdrawn")
        node.status_when(lambda d: d.get("reloads") == 1, "the reload done")
        out = node.status_with("NVML not answering")
        assert f"GPU 3 {UUIDS[3]}" in out
        text = _scrape(port)  # answers, without GPU 3's telemetry
        assert f'gpu_agent_gpu_temperature_celsius{{gpu="0",uuid="{UUIDS[0]}"}}' in text
        assert f'uuid="{UUIDS[3]}"}} ' not in text.split("gpu_agent_gpu_temperature")[1]
        agent.send(signal.SIGHUP)  # a reload while it still hangs does not wait on it either
        node.status_when(lambda d: d.get("reloads") == 2, "the second reload done")
        res = node.client.state().resource(GPU)
        assert res.allocatable == 7 and len(res.devices) == 8 and res.registrations == 1
        notify.wait(lambda m: sum(x.get("WATCHDOG") == "1" for x in m[hung_at:]) >= 3,
                    "three watchdog pings while GPU 3 hangs")
        control.hang(node.ctl, 3, 0)
        agent.wait_for(lambda s: s.resource(GPU).allocatable == 8, "GPU 3 back once it answers")
        answered = allocating.stop()
        assert answered > 0 and allocating.errors == []
        assert "answers NVML again" in agent.log
        assert agent.stop() == 0
        gaps = _watchdog_gaps(notify)  # none as long as systemd's limit, hang or not
        assert len(gaps) >= 3 and max(gaps) < WATCHDOG_USEC / 1e6, gaps
        assert "Traceback" not in agent.log
    finally:
        notify.close()


def test_a_gpu_that_hangs_at_start_is_left_out_and_advertised_once_it_answers(node):
    control.hang(node.ctl, 5, 600)
    agent = node.agent("--nvml-call-timeout", "500ms")
    devices = agent.wait_registered().devices
    assert UUIDS[5] not in {d.id for d in devices} and len(devices) == 7
    assert "GPU index 5: GPU discovery: NVML not answering" in agent.log
    assert agent.allocate([UUIDS[0]]).container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"]
    control.hang(node.ctl, 5, 0)
    agent.wait_for(lambda s: s.resource(GPU).allocatable == 8, "GPU 5 discovered")
    assert agent.allocate([UUIDS[5]]).container_responses[0].envs[
        "NVIDIA_VISIBLE_DEVICES"] == UUIDS[5]
    assert agent.stop() == 0 and "Traceback" not in agent.log


# -- a read-only state directory ---------------------------------------------------------------


def test_a_read_only_state_directory_loses_nothing_and_is_written_once_writable(node):
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root (CI runs as root)")
    agent = node.agent()
    agent.wait_registered()
    allocating = _Allocating(agent, [UUIDS[0]])
    with ReadOnlyMount(node.state):
        control.inject_xid(node.ctl, 2, 79)  # reboot class: kept in health.json, if it can be
        agent.wait_log(f"cannot write the health state {node.state}/health.json")
        agent.wait_for(lambda s: unhealthy(s.resource(GPU).latest_snapshot) == {UUIDS[2]},
                       "GPU 2 withdrawn")
    agent.wait_log(f"health state {node.state}/health.json is written again")
    answered = allocating.stop()
    assert answered > 0 and allocating.errors == []  # the journal's open file kept its writes
    assert agent.stop() == 0
    held = len(read_journal(os.path.join(node.state, JOURNAL_FILE)).records)
    assert held >= 1

    with ReadOnlyMount(node.state):  # at start: the journal cannot be rewritten
        agent = node.agent()
        res = agent.wait_registered(registrations=2)
        assert {d.id for d in res.devices if not d.healthy} == {UUIDS[2]}  # health.json kept it
        with pytest.raises(grpc.RpcError) as info:
            agent.allocate([UUIDS[1]])
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "Read-only file system" in info.value.details()
    agent.allocate([UUIDS[1]])  # by itself once writable
    records = read_journal(os.path.join(node.state, JOURNAL_FILE)).records
    assert len(records) == held + 1 and records[-1].devices == (UUIDS[1],)
    assert agent.stop() == 0 and "Traceback" not in agent.log
