"""What kubelet's device manager sees across reloads and kubelet restarts, `gpu-agent run` as a
real subprocess against the simulated kubelet, judged on the kubelet's own record of every
allocatable change (SimKubeletClient.allocatable_history):
- 50 SIGHUPs mixing unchanged configs, other strategies and other health settings: the
  resource never drops to 0 allocatable and its ListAndWatch stream never ends;
- a resource renamed by a reload: the new one is registered before the old one goes;
- 100 kubelet restarts, 20 of them double starts 0-150 ms apart (the second start wiping the
  directory at every moment of the agent's own restart, socket creation included): the agent
  never exits, registers exactly once with every kubelet instance it outlives, and the resource
  has no zero window after a registration within an instance.
No fixed sleeps: every wait is for an event the kubelet or the agent reports.
"""

from __future__ import annotations

import select
import signal
import time

import pytest

from agent.dirwatch import CREATED, DirWatch
from agent.sim import control
from agent.sim.profile import load_profile
from tests.daemon_harness import GPU, SOCKET, WAIT, Node

UUIDS = {g["index"]: g["uuid"] for g in load_profile("dgx1-v100")["gpus"]}
# (config text, what an Allocate answers with it): strategies and health settings, cycled.
HEALTH = "agent:\n  health:\n"
CONFIGS = [
    ("version: v1\n", "envvar"),
    (f"version: v1\n{HEALTH}    xidActions: {{79: reset, 48: ignore}}\n", "envvar"),
    ("version: v1\nflags:\n  plugin:\n    deviceListStrategy: cdi-cri\n", "cdi-cri"),
    ("version: v1\nflags:\n  plugin:\n    deviceIDStrategy: index\n", "index"),
    (f"version: v1\n{HEALTH}    recoveryQuietPeriod: 2m\n", "envvar"),
    ("version: v1\nflags:\n  plugin:\n    deviceListStrategy: volume-mounts\n", "volume-mounts"),
    (f"version: v1\n{HEALTH}    disableHealthchecks: [48, 63]\n", "envvar"),
]


def answer_kind(response) -> str:
    """Which config shaped this container's Allocate response."""
    if response.cdi_devices:
        return "cdi-cri"
    visible = response.envs.get("NVIDIA_VISIBLE_DEVICES", "")
    if visible == "/var/run/nvidia-container-devices":
        return "volume-mounts"
    return "index" if visible.isdigit() else "envvar"


@pytest.fixture
def node():
    with Node() as n:
        yield n


def test_fifty_sighups_never_take_the_resource_away(node):
    config = node.write("config.yaml", CONFIGS[0][0])
    agent = node.agent("--config", config)
    agent.wait_registered(1)
    since = time.monotonic_ns()
    pods = 0
    for n in range(1, 51):
        text, kind = CONFIGS[n % len(CONFIGS)] if n % 3 else CONFIGS[(n - 1) % len(CONFIGS)]
        node.write("config.yaml", text)  # every third reload: the config it already has
        agent.send(signal.SIGHUP)
        agent.wait_log(f"configuration reloaded (reload {n})")
        if n % 10 == 0:  # the new setting is live, through kubelet
            pods += 1
            pod = node.client.admit_pod(f"p{n}", {"main": {GPU: 1}})
            assert answer_kind(pod.container("main").allocation(GPU).container_response) == kind
            node.client.delete_pod(f"p{n}")
    assert agent.alive()
    assert node.client.zero_windows(GPU, since) == []
    history = node.client.allocatable_history(GPU)
    assert [c for c in history if c.monotonic_ns >= since and c.cause != "snapshot"] == []
    res = node.client.state().resource(GPU)  # one stream all along: never ended, never replaced
    assert res.connected and res.registrations == 1 and res.allocatable == 8
    assert pods == 5 and "Traceback" not in agent.log
    # the health monitor handed over at each health change is the one that acts now: the last
    # config ignores XID 48 and acts on 79
    assert CONFIGS[50 % len(CONFIGS)][0].endswith("xidActions: {79: reset, 48: ignore}\n")
    control.inject_xid(node.ctl, 2, 48)
    control.inject_xid(node.ctl, 3, 79)
    agent.wait_log("unhealthy [xid=79 action=reset]")
    state = agent.wait_for(lambda s: s.resource(GPU).allocatable == 7, "GPU 3 withdrawn")
    assert {d.id for d in state.resource(GPU).devices if not d.healthy} == {UUIDS[3]}
    assert "xid=48" not in agent.log


def test_a_renamed_resource_is_served_before_the_old_name_goes(node):
    config = node.write("config.yaml", "version: v1\n")
    agent = node.agent("--config", config)
    agent.wait_registered(1)
    node.write("config.yaml", "version: v1\nresources:\n  gpus:\n"
                              "  - pattern: '*V100*'\n    name: nvidia.com/v100\n")
    agent.send(signal.SIGHUP)
    agent.wait_registered(1, resource="nvidia.com/v100")
    agent.wait_for(lambda s: not s.resource(GPU).connected, "the old resource's stream to end")
    history = node.client.allocatable_history()
    registered_new = next(c.seq for c in history
                          if c.resource == "nvidia.com/v100" and c.cause == "registered")
    old_gone = next(c.seq for c in history if c.resource == GPU and c.cause == "stream-ended")
    assert registered_new < old_gone
    assert agent.alive() and agent.stop() == 0


def test_a_reload_to_another_kubelet_moves_every_server_there(node):
    with Node() as other:
        def config(n: Node) -> str:
            return node.write("config.yaml", f"version: v1\nflags:\n  plugin:\n"
                                             f"    kubeletSocket: {n.kubelet_socket}\n"
                                             f"agent:\n  podResourcesSocket: "
                                             f"{n.podresources_socket}\n")
        agent = node.agent("--config", config(node), kubelet=False)
        agent.wait_registered(1)
        config(other)
        agent.send(signal.SIGHUP)
        agent.wait_log("configuration reloaded (reload 1)")
        res = other.client.wait_for(
            lambda s: s.resource(GPU) is not None and s.resource(GPU).allocatable == 8,
            timeout=WAIT, what="the agent registered with the other kubelet").resource(GPU)
        assert res.connected and res.registrations == 1
        pod = other.client.admit_pod("p", {"main": {GPU: 1}})  # its devices serve there
        assert len(pod.container("main").allocation(GPU).device_ids) == 1
        assert not node.client.state().resource(GPU).connected
        assert agent.alive() and agent.stop() == 0


def _restart_twice(node: Node, gap_s: float, after_our_socket: bool) -> None:
    """Two kubelet starts, as a service manager restarting a kubelet that failed right after
    it started: the second `gap_s` after the first, or `gap_s` after the agent re-created its
    socket for the first (so the wipe lands inside the agent's own restart)."""
    watch = DirWatch(node.kdir)
    try:
        node.client.restart()
        if after_our_socket:
            deadline = time.monotonic() + WAIT
            while not any(e.kind == CREATED and e.name == SOCKET for e in watch.read()):
                assert time.monotonic() < deadline, "the agent did not re-create its socket"
                select.select([watch.fileno()], [], [], 0.1)
    finally:
        watch.close()
    if gap_s:
        time.sleep(gap_s)  # the gap is the scenario itself, not a wait for an outcome
    node.client.restart()


def test_a_hundred_kubelet_restarts_twenty_of_them_double(node):
    agent = node.agent()
    agent.wait_registered(1)
    # 20 double starts whose second start lands 0..150 ms after the first (or after the agent
    # re-created its socket), spread evenly so that it hits every moment of the agent's own
    # restart; the other 80 are single.
    gaps = {i * 5: 0.150 * i / 19 for i in range(20)}
    finals = [0]  # the kubelet instances the agent must end up registered with
    for n in range(100):
        instance_before = node.client.state().restarts
        if n in gaps:
            _restart_twice(node, gaps[n], after_our_socket=n % 10 == 5)
            want = instance_before + 2
        else:
            node.client.restart()
            want = instance_before + 1
        agent.wait_for(lambda s, want=want: s.restarts == want and s.resource(GPU).connected
                       and s.resource(GPU).allocatable == 8,
                       f"registration with kubelet instance {want} (restart {n + 1})")
        finals.append(want)
    assert agent.alive()
    per_instance = node.client.registrations_per_instance(GPU)
    assert max(per_instance) == 120  # 100 restarts, 20 of them double
    # exactly one registration with every instance the agent outlived; the first start of a
    # double may have been replaced before the agent reached it (0 or 1 there, never 2)
    assert all(count <= 1 for count in per_instance.values()), per_instance
    assert [i for i in finals if per_instance[i] != 1] == [], per_instance
    history = node.client.allocatable_history(GPU)
    for instance in per_instance:
        # from the first device list on, allocatable stays up for as long as the instance
        # lives (a double start's first instance may die before any device list: no window)
        changes = [c for c in history if c.instance == instance]
        up = [i for i, c in enumerate(changes) if c.allocatable > 0]
        assert not up or all(c.allocatable > 0 for c in changes[up[0]:]), \
            f"kubelet instance {instance} saw a zero window after the registration: {changes}"
    assert node.client.state().resource(GPU).allocatable == 8  # the last one is up
    assert "Traceback" not in agent.log and "ERROR" not in agent.log
    assert agent.stop() == 0
