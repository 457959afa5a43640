"""`gpu-agent run` as a real subprocess against the simulated NVML and the simulated kubelet:
registration, ListAndWatch, GetPreferredAllocation, Allocate for every device-list and
device-ID strategy and passDeviceSpecs, bad requests (refused, and the agent keeps serving),
the socket's mode, `gpu-agent status`, and a clean stop. Lifecycle (kubelet restarts, SIGHUP,
init failures, bad config, systemd) is in test_daemon_lifecycle.py.
"""

from __future__ import annotations

import json
import os
import signal
import stat

import grpc
import pytest

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent.sim import control
from agent.sim.profile import load_profile
from tests.conftest import run_gpu_agent, wants_twins
from tests.daemon_harness import GPU, SOCKET, Node, NotifySocket, clean_env

PROFILE = load_profile("dgx1-v100")
GPUS = PROFILE["gpus"]
UUIDS = [g["uuid"] for g in GPUS]
NUMA = {g["uuid"]: g["numa_node"] for g in GPUS}
INDEX = {g["uuid"]: g["index"] for g in GPUS}
MINOR = {g["uuid"]: g["minor"] for g in GPUS}


def started(node: Node):
    """An agent on `node` once it sent READY=1, when `systemctl start` (Type=notify) returns
    and an operator runs `gpu-agent status`: status.json is written before READY, while the
    registration comes earlier (wait_registered alone raced the first write)."""
    notify = NotifySocket(node)
    try:
        agent = node.agent(env=node.env(NOTIFY_SOCKET=notify.address))
        notify.wait_key("READY", "1")
    finally:
        notify.close()
    agent.wait_registered()
    return agent


@pytest.fixture
def node(request):
    """A node; its agents run agent._fast's twins in the "python" run of a test that takes
    `fast_impl` (conftest), the compiled modules otherwise."""
    with Node(pure_python=wants_twins(request)) as n:
        yield n


def admit(node: Node, name: str, count: int, container: str = "main"):
    """Admit a pod with `count` GPUs through the simulated kubelet; its allocation."""
    pod = node.client.admit_pod(name, {container: {GPU: count}})
    return pod.container(container).allocation(GPU)


# -- registration and ListAndWatch ------------------------------------------------------------


def test_registers_every_gpu_with_its_numa_node_and_options(node):
    agent = node.agent()
    res = agent.wait_registered()
    assert res.endpoint == SOCKET
    assert res.get_preferred_allocation_available and not res.pre_start_required
    assert {d.id: d.numa_nodes for d in res.devices} == {u: (NUMA[u],) for u in UUIDS}
    assert res.healthy_ids == tuple(sorted(UUIDS))
    # GetDevicePluginOptions says what RegisterRequest said
    options = agent.stub().GetDevicePluginOptions(dp.Empty(), timeout=10)
    assert options.get_preferred_allocation_available and not options.pre_start_required
    # the socket is the agent's alone
    mode = os.stat(node.plugin_socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert agent.alive()


def test_list_and_watch_sends_the_full_list_to_every_stream(node):
    agent = node.agent()
    agent.wait_registered()
    call = agent.stub().ListAndWatch(dp.Empty(), timeout=10)
    first = next(call)
    call.cancel()
    assert sorted(d.ID for d in first.devices) == sorted(UUIDS)
    assert all(d.health == "Healthy" for d in first.devices)
    assert {d.ID: [n.ID for n in d.topology.nodes] for d in first.devices} == \
        {u: [NUMA[u]] for u in UUIDS}


def test_status_reports_the_running_agent(node):
    agent = started(node)
    out = run_gpu_agent("status", "--state-dir", node.state, env=clean_env(), check=False).stdout
    assert f"agent: running (pid {agent.pid}" in out
    assert f"{GPU}: registered (1 registrations) on {node.plugin_socket}" in out
    assert f"GPU 3 {UUIDS[3]} NUMA 0: healthy" in out
    doc = json.loads(run_gpu_agent("status", "--json", "--state-dir", node.state,
                                   env=clean_env()).stdout)["agent"]
    assert doc["running"] and doc["nvml"]["up"] and doc["resources"][0]["registered"]
    assert doc["summary"] == f"{GPU}: 8/8 healthy, registered (1)"


def test_status_exits_as_systemctl_status_does(node):
    # 3 before the agent ever ran there, 0 running with every GPU in, 1 with one withdrawn,
    # 3 once stopped; --json keeps exiting 0 (its document says it all)
    status = ("status", "--state-dir", node.state)
    assert run_gpu_agent(*status, env=clean_env(), check=False).returncode == 3
    agent = started(node)
    assert run_gpu_agent(*status, env=clean_env(), check=False).returncode == 0
    control.inject_xid(node.ctl, 5, 79)
    node.status_with(f"GPU 5 {UUIDS[5]} NUMA 0: unhealthy")
    assert run_gpu_agent(*status, env=clean_env(), check=False).returncode == 1
    assert run_gpu_agent(*status, "--json", env=clean_env(), check=False).returncode == 0
    assert agent.stop() == 0
    proc = run_gpu_agent(*status, env=clean_env(), check=False)
    assert proc.returncode == 3 and "agent: not running" in proc.stdout


def test_mig_enabled_gpus_are_advertised_whole_with_mig_strategy_none():
    # NVIDIA's plugin under migStrategy none: every GPU is a full nvidia.com/gpu, MIG-enabled
    # or not (k8s-device-plugin internal/rm/device_map.go, buildGPUDeviceMap: a MIG-enabled
    # GPU is skipped only when the strategy is not none; buildDeviceMapFromConfigResources
    # returns before any MIG device is looked at under none).
    with Node("a100-mig") as node:
        profile = load_profile("a100-mig")
        agent = node.agent()
        res = agent.wait_registered()
        assert sorted(d.id for d in res.devices) == sorted(g["uuid"] for g in profile["gpus"])
        assert not [d for d in res.devices if d.id.startswith("MIG-")]
        mig_on = [g for g in profile["gpus"] if g.get("mig", {}).get("mode") == "enabled"]
        assert mig_on and all(f"GPU {g['index']} {g['uuid']}" in agent.log for g in mig_on)
        assert "MIG enabled: advertised whole with migStrategy none" in agent.log
        alloc = node.client.admit_pod("p", {"main": {GPU: 8}}).container("main").allocation(GPU)
        visible = alloc.container_response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert sorted(visible) == sorted(g["uuid"] for g in profile["gpus"])


def test_resources_gpus_renames_the_resource_and_its_socket(node):
    config = node.write("config.yaml", "version: v1\nresources:\n  gpus:\n"
                                       "    - pattern: '*V100*'\n      name: v100\n")
    agent = node.agent("--config", config)
    res = agent.wait_registered(resource="nvidia.com/v100")
    assert res.endpoint == "gpu-agent-v100.sock" and len(res.devices) == 8
    assert node.client.state().resource(GPU) is None
    alloc = node.client.admit_pod("p", {"main": {"nvidia.com/v100": 1}}).devices("nvidia.com/v100")
    assert len(alloc) == 1


# -- Allocate: device-list strategies, ID strategies, device specs --------------------------------


@pytest.mark.parametrize("strategy", [
    "envvar", "volume-mounts", "cdi-annotations", "cdi-cri", "envvar,cdi-cri"])
def test_device_list_strategy(node, strategy):
    agent = node.agent("--device-list-strategy", strategy)
    agent.wait_registered()
    alloc = admit(node, "p", 2)
    ids = list(alloc.device_ids)
    r = alloc.container_response
    assert len(alloc.allocate_response.container_responses) == 1
    names = [f"nvidia.com/gpu={i}" for i in ids]
    strategies = strategy.split(",")
    if "envvar" in strategies:
        assert r.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(ids)
    if "volume-mounts" in strategies:
        assert r.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
        assert [(m.container_path, m.host_path) for m in r.mounts] == \
            [(f"/var/run/nvidia-container-devices/{i}", "/dev/null") for i in ids]
    else:
        assert not r.mounts
    if "cdi-annotations" in strategies:
        ((key, value),) = r.annotations.items()
        assert key.startswith("cdi.k8s.io/gpu-agent_") and value == ",".join(names)
    else:
        assert not r.annotations
    if "cdi-cri" in strategies:
        assert [c.name for c in r.cdi_devices] == names
    else:
        assert not r.cdi_devices
    if not {"envvar", "volume-mounts"} & set(strategies):
        assert "NVIDIA_VISIBLE_DEVICES" not in r.envs
    assert not r.devices  # passDeviceSpecs is off by default


@pytest.mark.parametrize("id_strategy", ["uuid", "index"])
def test_device_id_strategy_names_devices_in_env_and_cdi(node, id_strategy):
    env = node.env(DEVICE_ID_STRATEGY=id_strategy, DEVICE_LIST_STRATEGY="envvar,cdi-cri")
    agent = node.agent(env=env)
    agent.wait_registered()
    alloc = admit(node, "p", 2)
    ids = [u if id_strategy == "uuid" else str(INDEX[u]) for u in alloc.device_ids]
    r = alloc.container_response
    assert r.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(ids)
    assert [c.name for c in r.cdi_devices] == [f"nvidia.com/gpu={i}" for i in ids]
    # kubelet always sees UUIDs: the strategy names devices to the runtime only
    assert all(d in UUIDS for d in alloc.device_ids)


def test_pass_device_specs_under_the_dev_root(node):
    dev_root = node.path("devroot")
    os.makedirs(os.path.join(dev_root, "dev"))
    for name in ("nvidiactl", "nvidia-uvm"):  # no nvidia-uvm-tools, no nvidia-modeset here
        open(os.path.join(dev_root, "dev", name), "w").close()
    agent = node.agent("--pass-device-specs", "--dev-root", dev_root)
    agent.wait_registered()
    alloc = admit(node, "p", 2)
    specs = [(s.container_path, s.host_path, s.permissions)
             for s in alloc.container_response.devices]
    expected = [("/dev/nvidiactl", f"{dev_root}/dev/nvidiactl", "rw"),
                ("/dev/nvidia-uvm", f"{dev_root}/dev/nvidia-uvm", "rw")]
    expected += [(f"/dev/nvidia{MINOR[u]}", f"{dev_root}/dev/nvidia{MINOR[u]}", "rw")
                 for u in alloc.device_ids]
    assert specs == expected
    # a control node that appears later is in the next answer to the very same request
    # (the agent keeps answers by the request's bytes, but not these)
    ids = list(alloc.device_ids)
    before = agent.allocate(ids).container_responses[0]
    assert "/dev/nvidia-uvm-tools" not in [s.container_path for s in before.devices]
    open(os.path.join(dev_root, "dev", "nvidia-uvm-tools"), "w").close()
    after = agent.allocate(ids).container_responses[0]
    assert "/dev/nvidia-uvm-tools" in [s.container_path for s in after.devices]


# -- GetPreferredAllocation -------------------------------------------------------------------


def test_preferred_allocation_keeps_a_pod_on_one_numa_node(node, fast_impl):
    agent = node.agent()
    agent.wait_registered()
    agent.wait_log(f"implementation {fast_impl.name}")
    first = admit(node, "a", 4)
    second = admit(node, "b", 4)
    for alloc in (first, second):
        assert alloc.preferred_called
        assert list(alloc.device_ids) == list(alloc.preferred_device_ids)
        assert len({NUMA[d] for d in alloc.device_ids}) == 1
    assert {NUMA[first.device_ids[0]], NUMA[second.device_ids[0]]} == {0, 1}
    # must-include devices come first, the rest from their NUMA node
    request = dp.PreferredAllocationRequest(container_requests=[
        dp.ContainerPreferredAllocationRequest(available_deviceIDs=UUIDS,
                                               must_include_deviceIDs=[UUIDS[5]],
                                               allocation_size=3)])
    picked = list(agent.stub().GetPreferredAllocation(request, timeout=10)
                  .container_responses[0].deviceIDs)
    assert picked[0] == UUIDS[5] and {NUMA[d] for d in picked} == {NUMA[UUIDS[5]]}


def test_impossible_preferred_allocation_is_refused_and_the_agent_keeps_serving(node):
    agent = node.agent()
    agent.wait_registered()
    request = dp.PreferredAllocationRequest(container_requests=[
        dp.ContainerPreferredAllocationRequest(available_deviceIDs=UUIDS[:2],
                                               allocation_size=3)])
    with pytest.raises(grpc.RpcError) as err:
        agent.stub().GetPreferredAllocation(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "allocation size 3 exceeds the 2 available devices" in err.value.details()
    assert len(admit(node, "p", 3).device_ids) == 3


# -- bad requests ---------------------------------------------------------------------------


@pytest.mark.parametrize("containers, reason", [
    pytest.param([[]], "no device IDs", id="empty"),
    pytest.param([["GPU-nope"]], "unknown device: GPU-nope", id="unknown"),
    pytest.param([[UUIDS[0], UUIDS[1], UUIDS[0]]], f"duplicate device: {UUIDS[0]}",
                 id="duplicate"),
    pytest.param([[UUIDS[0]], []], "no device IDs", id="second-container-empty"),
])
def test_bad_allocate_requests_are_refused_and_the_agent_keeps_serving(node, containers, reason):
    agent = node.agent()
    agent.wait_registered()
    with pytest.raises(grpc.RpcError) as err:
        agent.allocate(*containers)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"invalid allocation request for '{GPU}': {reason}"
    assert "refused Allocate" in agent.log
    # still serving: a good request with two containers gets two responses, in order
    good = agent.allocate([UUIDS[0]], [UUIDS[6], UUIDS[7]])
    assert [r.envs["NVIDIA_VISIBLE_DEVICES"] for r in good.container_responses] == \
        [UUIDS[0], f"{UUIDS[6]},{UUIDS[7]}"]
    # one INFO line per container
    line = (f"INFO agent.kubelet.plugin: {GPU}: allocated to a container: "
            f"{UUIDS[6]} (GPU 6), {UUIDS[7]} (GPU 7)")
    agent.wait_log(line)
    assert f"allocated to a container: {UUIDS[0]} (GPU 0)" in agent.log
    # the same request again: its answer is kept, and so is its line's text
    agent.allocate([UUIDS[6], UUIDS[7]])
    agent.wait_log(line, times=2)
    assert len(admit(node, "p", 1).device_ids) == 1
    res = node.client.state().resource(GPU)
    assert res.connected and res.registrations == 1


# -- memory ---------------------------------------------------------------------------------


def _thread_heaps(pid: int) -> int:
    """glibc's per-thread malloc arenas in process `pid`: anonymous mappings at a 64 MiB
    boundary, read-write, with the reserved rest (---p) after them making 64 MiB in all."""
    regions = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) == 5:  # no path: anonymous
                start, end = (int(x, 16) for x in fields[0].split("-"))
                regions.append((start, end, fields[1]))
    reserved = {start: end for start, end, perm in regions if perm == "---p"}
    size = 64 << 20
    return sum(1 for start, end, perm in regions
               if perm == "rw-p" and start % size == 0 and reserved.get(end, end) - start == size)


def test_the_agent_keeps_one_malloc_arena_unless_the_operator_sets_malloc_arena_max(node):
    """agent/arenas.py: glibc's arenas held to one (less memory after many Allocates,
    docs/benchmarks.md); an operator's MALLOC_ARENA_MAX is glibc's to read and is left alone."""
    agent = node.agent()
    agent.wait_registered()
    for _ in range(20):
        agent.allocate([UUIDS[0]])
    assert _thread_heaps(agent.pid) == 0
    agent.stop()
    chosen = node.agent(env=node.env(MALLOC_ARENA_MAX="4"))
    chosen.wait_registered()
    for _ in range(20):
        chosen.allocate([UUIDS[0]])
    assert 1 <= _thread_heaps(chosen.pid) <= 3  # glibc's own arena is the fourth


# -- stopping ------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_removes_the_socket_and_exits_zero(node, signum):
    agent = node.agent()
    agent.wait_registered()
    assert agent.stop(signum) == 0
    assert not os.path.lexists(node.plugin_socket)
    state = node.client.wait_for(lambda s: not s.resource(GPU).connected,
                                 what="the stream to end")
    assert state.resource(GPU).allocatable == 0  # kubelet marks the devices unhealthy
    assert f"{signal.Signals(signum).name}: stopping" in agent.log
    out = run_gpu_agent("status", "--state-dir", node.state, env=clean_env(), check=False).stdout
    assert f"agent: not running (pid {agent.pid}, phase stopped" in out
