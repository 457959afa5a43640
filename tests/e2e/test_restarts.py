"""Cases 3 and 4 of the real-Kubernetes issue: the real kubelet restarted (SIGTERM, SIGKILL, two
starts 0-150 ms apart) and the agent killed and restarted or reloaded while pods come and go.

kubelet's own log says how often a plugin registered with each kubelet process ("Connected to
new client" for nvidia.com/gpu, once per Register it accepted); the agent's is checked against
it. Running pods must keep their devices (podresources and what the container sees), new pods
must be admitted, and no pod may fail admission (UnexpectedAdmissionError) or get a GPU another
running pod holds.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from agent.errors import PodResourcesError
from tests.e2e.conftest import GPU, POLL, write_result

CONNECTED = '"Connected to new client" resource="nvidia.com/gpu"'


def _kubelet_registrations(cluster) -> list[int]:
    """Registrations of nvidia.com/gpu that kubelet accepted, per kubelet process (its log
    holds every process's output, each after a '--- started' line)."""
    runs = cluster.procs["kubelet"].log().split("--- started: ")[1:]
    return [run.count(CONNECTED) for run in runs]


def _restart_kubelet(node, signum: int, second_start_after: float | None = None) -> float:
    """Stop kubelet with `signum` and start it again (twice, `second_start_after` seconds
    apart, the first killed in between); the seconds from the last start until kubelet's
    device manager has the 8 GPUs healthy again."""
    cluster = node.cluster
    cluster.procs["kubelet"].stop(signum)
    if second_start_after is not None:
        first = cluster.start_kubelet()
        time.sleep(second_start_after)  # the gap between the two starts is the case itself
        first.stop(signal.SIGKILL)
    started = time.monotonic()
    cluster.start_kubelet()
    while len(_allocatable_or_none(node)) != 8:
        if time.monotonic() - started > 60:
            raise AssertionError(f"kubelet never had its 8 GPUs back\n{node.logs()}")
        time.sleep(POLL)
    return time.monotonic() - started


def _allocatable_or_none(node) -> set[str]:
    try:
        return node.allocatable_ids()
    except PodResourcesError:  # the new kubelet's podresources socket is not up yet
        return set()


def _assigned_when_listed(node, pod: str, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while not (held := node.assigned(pod)) and time.monotonic() < deadline:
        time.sleep(POLL)
    return held


def _disjoint(node, pods: list[str]) -> dict[str, list[str]]:
    listed = node.assigned_all()
    held = {p: sorted(listed.get(p, [])) for p in pods}
    flat = [u for ids in held.values() for u in ids]
    assert len(flat) == len(set(flat)), f"a GPU held by two running pods: {held}"
    return held


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "two starts 0 ms apart",
                                 "two starts 50 ms apart", "two starts 150 ms apart"])
def test_a_kubelet_restart_keeps_running_pods_and_registers_once(node, how):
    agent = node.agent("dgx1-v100", "--pass-device-specs")
    node.wait_allocatable(8)
    node.create_pod("before", {GPU: 2})
    node.wait_running("before")
    held = node.assigned("before")
    container = node.container_id("before")
    seen = node.seen("before").nodes

    gap = None if not how.startswith("two") else int(how.split()[2]) / 1000
    signum = signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL
    back = _restart_kubelet(node, signum, gap)
    write_result(node.results, f"kubelet_restart_{how.replace(' ', '_')}_to_allocatable_s",
                 round(back, 3))
    node.wait_allocatable(8)

    # the agent registered exactly once with the kubelet that runs now
    assert _kubelet_registrations(node.cluster)[-1] == 1, _kubelet_registrations(node.cluster)
    # the running pod kept its container and its devices (the new kubelet lists it once it
    # has read the pod from the API server again)
    assert node.container_id("before") == container
    assert sorted(_assigned_when_listed(node, "before")) == sorted(held)
    assert node.seen("before").nodes == seen
    # and a new pod is admitted, on other GPUs
    node.create_pod("after", {GPU: 2})
    node.wait_running("after")
    _disjoint(node, ["before", "after"])
    assert agent.proc.alive()
    # the agent kept the running pod's record through the restart (kubelet listed the pod
    # again only after reading it from the API server): neither dropped nor adopted anew
    agent.wait_log("attributed to pod default/after")
    assert "(pod default/before container main) dropped" not in agent.log()
    assert "to pod default/before container main adopted" not in agent.log()


def test_the_agent_killed_and_restarted_keeps_pods_and_admits_new_ones(node):
    node.agent("dgx1-v100", "--pass-device-specs")
    node.wait_allocatable(8)
    for name in ("a", "b"):
        node.create_pod(name, {GPU: 2})
    for name in ("a", "b"):
        node.wait_running(name)
    held = _disjoint(node, ["a", "b"])

    node.agents[-1].proc.stop(signal.SIGKILL)
    node.agent("dgx1-v100", "--pass-device-specs")  # the same state directory
    node.wait_allocatable(8)
    for name in ("c", "d"):
        node.create_pod(name, {GPU: 2})
    for name in ("c", "d"):
        node.wait_running(name)
    after = _disjoint(node, ["a", "b", "c", "d"])
    assert {p: after[p] for p in ("a", "b")} == held
    # the restarted agent found the pods of the first one in its journal and podresources
    node.agents[-1].wait_log("attributed to pod default/c")


def test_twenty_sighups_while_pods_are_created_fail_no_admission(node):
    agent = node.agent("dgx1-v100", "--pass-device-specs")
    node.wait_allocatable(8)
    stop = threading.Event()
    sent = []

    def hup() -> None:
        while len(sent) < 20 and not stop.is_set():
            agent.proc.send(signal.SIGHUP)
            sent.append(time.monotonic())
            stop.wait(0.1)  # pacing the load, not waiting for anything
    thread = threading.Thread(target=hup)
    thread.start()
    try:
        pods = [node.create_pod(f"p{i}", {GPU: 1}) for i in range(8)]
        for pod in pods:
            node.wait_running(pod)  # fails at once on a Failed pod (UnexpectedAdmissionError)
    finally:
        thread.join()
        stop.set()
    assert len(sent) == 20
    agent.wait_log("configuration reloaded (reload 20)")
    held = _disjoint(node, pods)
    assert len({u for ids in held.values() for u in ids}) == 8
    assert agent.proc.alive()
