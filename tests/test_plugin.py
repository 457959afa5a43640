"""The parts under `gpu-agent run`, in-process: the preferred-allocation policy (properties),
resource naming by `resources.gpus` patterns, the ResourceManager's versions and waits, and
the PluginServer over a real unix socket (a health change reaches an open ListAndWatch stream,
stop ends streams and removes the socket, a stale socket is replaced, registration with the
simulated kubelet). No NVML here: devices are built from Gpu records.
"""

from __future__ import annotations

import os
import stat
import threading

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.config.file import ResourcePattern
from agent.errors import RequestError
from agent.kubelet.plugin import PluginServer, RegistrationError, socket_name
from agent.nvml.discovery import Gpu
from agent.rm.allocate import ResponseOptions
from agent.rm.devices import RESOURCE_GPU, devices_by_resource, full_gpu_devices, resource_name_for
from agent.rm.manager import PreferredRequest, ResourceManager
from agent.rm.preferred import preferred_allocation
from agent.rm.topology import TopologyModel
from agent.sim.kubelet import SimKubelet, SimKubeletClient
from tests.test_sim_kubelet import short_tmpdir_fixture


def make_gpus(numa: list[int | None], name: str = "Tesla V100-SXM2-16GB") -> list[Gpu]:
    return [Gpu(index=i, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", name=name, minor=i,
                pci_bus_id=f"00000000:{i + 6:02X}:00.0", numa_node=n, memory_total=16 << 30,
                compute_capability=(7, 0), mig_enabled=False) for i, n in enumerate(numa)]


DGX = full_gpu_devices(make_gpus([0, 0, 0, 0, 1, 1, 1, 1]))
KNOWN = {d.id: d for d in DGX}
IDS = [d.id for d in DGX]


def pick(available, size, must=(), impl=None):
    """The preferred allocation on DGX, searched by `impl` (a conftest FastImpl; None: live)."""
    return preferred_allocation(RESOURCE_GPU, available, must, size, KNOWN,
                                topology_module=impl and impl.topology)


# -- the preferred-allocation policy (with the compiled search, then its twin) -----------------


def test_a_pod_that_fits_one_numa_node_stays_on_it(fast_impl):
    assert pick(IDS, 4, impl=fast_impl) == IDS[:4]
    # node 0 has only 3 left: node 1 fits whole
    assert pick(IDS[1:], 4, impl=fast_impl) == IDS[4:]
    # the tightest node that fits (3 free < 4 free)
    assert pick(IDS[1:], 2, impl=fast_impl) == IDS[1:3]


def test_must_include_first_then_its_node(fast_impl):
    assert pick(IDS, 3, must=[IDS[6]], impl=fast_impl) == [IDS[6], IDS[4], IDS[5]]
    assert pick(IDS, 2, must=[IDS[7], IDS[0]], impl=fast_impl) == [IDS[7], IDS[0]]


def test_spreads_over_as_few_nodes_as_it_can(fast_impl):
    available = [IDS[0], IDS[4], IDS[5], IDS[6]]
    assert pick(available, 4, impl=fast_impl) == [IDS[4], IDS[5], IDS[6], IDS[0]]


def test_devices_without_numa_come_after_real_nodes(fast_impl):
    devices = full_gpu_devices(make_gpus([None, 1, 1]))
    known = {d.id: d for d in devices}
    ids = [d.id for d in devices]
    impl = fast_impl.topology
    assert preferred_allocation(RESOURCE_GPU, ids, [], 1, known, topology_module=impl) == \
        [ids[1]]
    assert preferred_allocation(RESOURCE_GPU, ids, [], 3, known, topology_module=impl) == \
        [ids[1], ids[2], ids[0]]


@pytest.mark.parametrize("available, must, size, problem", [
    pytest.param(IDS, [], 0, "allocation size 0 is less than 1", id="size-zero"),
    pytest.param(IDS[:2], [], 3, "allocation size 3 exceeds the 2 available devices",
                 id="too-many"),
    pytest.param(["GPU-nope"], [], 1, "unknown device: GPU-nope", id="unknown"),
    pytest.param(IDS[:2], [IDS[3]], 1, f"must-include device {IDS[3]} is not available",
                 id="must-not-available"),
    pytest.param(IDS, IDS[:3], 2, "3 must-include devices exceed the allocation size 2",
                 id="must-over-size"),
])
def test_impossible_requests_are_refused(available, must, size, problem):
    with pytest.raises(RequestError, match="invalid preferred allocation request for "
                                           "'nvidia.com/gpu': " + problem):
        pick(available, size, must)


@st.composite
def requests(draw):
    numa = draw(st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=1, max_size=16))
    devices = full_gpu_devices(make_gpus(numa))
    ids = [d.id for d in devices]
    available = draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
    size = draw(st.integers(1, len(available)))
    must = draw(st.lists(st.sampled_from(available), unique=True, max_size=size))
    return {d.id: d for d in devices}, available, must, size


@settings(max_examples=300, deadline=None)
@given(requests(), st.randoms(use_true_random=False))
def test_property_a_correct_deterministic_pick(fast_impl, case, rnd):
    known, available, must, size = case
    impl = fast_impl.topology
    got = preferred_allocation(RESOURCE_GPU, available, must, size, known, topology_module=impl)
    assert len(got) == size and len(set(got)) == size
    assert set(got) <= set(available)
    assert got[:len(must)] == must
    shuffled = list(available)
    rnd.shuffle(shuffled)
    assert preferred_allocation(RESOURCE_GPU, shuffled, must, size, known,
                                topology_module=impl) == got
    if not must:
        free = {}
        for i in available:
            free.setdefault(known[i].numa_node, []).append(i)
        if any(n is not None and len(ids) >= size for n, ids in free.items()):
            assert len({known[i].numa_node for i in got}) == 1  # one node when one fits


# -- resource names --------------------------------------------------------------------------


@pytest.mark.parametrize("pattern, product, matches", [
    ("*V100*", "Tesla V100-SXM2-16GB", True),
    ("Tesla V100-SXM2-16GB", "Tesla V100-SXM2-16GB", True),
    ("*v100*", "Tesla V100-SXM2-16GB", False),  # case matters, as in NVIDIA's plugin
    ("*A100*", "Tesla V100-SXM2-16GB", False),
    ("NVIDIA A100 (80GB)*", "NVIDIA A100 (80GB) PCIe", True),  # regex characters are literal
    ("NVIDIA A100.80GB*", "NVIDIA A100 80GB PCIe", False),
    ("*", "anything", True),
])
def test_resource_patterns_match_the_whole_product_name(pattern, product, matches):
    got = resource_name_for(product, [ResourcePattern(pattern, "nvidia.com/renamed")])
    assert got == ("nvidia.com/renamed" if matches else RESOURCE_GPU)


def test_first_matching_pattern_wins_and_others_keep_nvidia_gpu():
    gpus = make_gpus([0, 0]) + make_gpus([1], name="NVIDIA A100-SXM4-80GB")
    gpus[2] = gpus[2]._replace(index=2, uuid="GPU-a100")
    patterns = [ResourcePattern("*A100*", "nvidia.com/a100"),
                ResourcePattern("*", "nvidia.com/other")]
    grouped = devices_by_resource(gpus, patterns)
    assert {k: [d.gpu_index for d in v] for k, v in grouped.items()} == \
        {"nvidia.com/a100": [2], "nvidia.com/other": [0, 1]}
    assert list(devices_by_resource(gpus)) == [RESOURCE_GPU]


def test_socket_names_follow_the_resource():
    assert socket_name("nvidia.com/gpu") == "gpu-agent-gpu.sock"
    assert socket_name("nvidia.com/a100") == "gpu-agent-a100.sock"


# -- ResourceManager --------------------------------------------------------------------------


def test_manager_versions_health_and_waits():
    m = ResourceManager(RESOURCE_GPU, DGX, ResponseOptions())
    first = m.snapshot()
    assert all(h.healthy for h in first.devices) and m.healthy_count == 8
    assert m.wait_for_change(first.version, 0.01).version == first.version  # times out
    threading.Timer(0.05, m.set_health, (IDS[3], False, "XID 79")).start()
    changed = m.wait_for_change(first.version, 10)
    assert changed.version == first.version + 1
    assert [(h.device.id, h.reason) for h in changed.devices if not h.healthy] == \
        [(IDS[3], "XID 79")]
    assert not m.set_health(IDS[3], False)  # no change, no new version
    assert not m.set_health("GPU-nope", False)
    m.close()
    assert m.wait_for_change(changed.version, 10).closed


def test_manager_answers_allocate_and_preferred_in_request_order(fast_impl):
    m = ResourceManager(RESOURCE_GPU, DGX, ResponseOptions(id_strategy="index"),
                        topology=TopologyModel.numa_only(DGX, topology_module=fast_impl.topology))
    answers = m.allocate([[IDS[2]], [IDS[5], IDS[4]]])
    assert [r.envs["NVIDIA_VISIBLE_DEVICES"] for _, r in answers] == ["2", "5,4"]
    assert [[d.id for d in devices] for devices, _ in answers] == [[IDS[2]], [IDS[5], IDS[4]]]
    with pytest.raises(RequestError, match="duplicate device"):
        m.allocate([[IDS[0]], [IDS[1], IDS[1]]])
    assert m.preferred([PreferredRequest(IDS, [], 2), PreferredRequest(IDS[4:], [IDS[7]], 2)]) \
        == [IDS[:2], [IDS[7], IDS[4]]]


# -- PluginServer over a real socket --------------------------------------------------------------


sockdir = short_tmpdir_fixture("gp", "sockdir")


@pytest.fixture
def served(sockdir):
    manager = ResourceManager(RESOURCE_GPU, DGX, ResponseOptions())
    server = PluginServer(manager, sockdir)
    server.start()
    channel = grpc.insecure_channel(f"unix:{server.path}")
    yield manager, server, dp_grpc.DevicePluginStub(channel)
    channel.close()
    server.stop()


def test_a_health_change_reaches_an_open_list_and_watch_stream(served):
    manager, server, stub = served
    stream = stub.ListAndWatch(dp.Empty(), timeout=20)
    first = next(stream)
    assert [d.health for d in first.devices] == ["Healthy"] * 8
    manager.set_health(IDS[2], False, "XID 79")
    second = next(stream)
    assert {d.ID: d.health for d in second.devices}[IDS[2]] == "Unhealthy"
    assert len(second.devices) == 8  # always the full list
    manager.set_health(IDS[2], True)
    assert all(d.health == "Healthy" for d in next(stream).devices)
    stream.cancel()


def test_stop_ends_open_streams_and_removes_the_socket(served):
    _manager, server, stub = served
    stream = stub.ListAndWatch(dp.Empty(), timeout=20)
    next(stream)
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    server.stop()
    with pytest.raises((StopIteration, grpc.RpcError)):  # ended (or cancelled), not hanging
        next(stream)
    assert not os.path.lexists(server.path)
    server.stop()  # twice is harmless


def test_start_replaces_a_stale_socket_file_and_stop_leaves_a_foreign_one(sockdir):
    manager = ResourceManager(RESOURCE_GPU, DGX, ResponseOptions())
    path = os.path.join(sockdir, socket_name(RESOURCE_GPU))
    open(path, "w").close()  # left by a crash
    server = PluginServer(manager, sockdir)
    server.start()
    assert stat.S_ISSOCK(os.stat(path).st_mode) and server.owns_socket()
    os.unlink(path)
    open(path, "w").close()  # someone else's file now
    assert not server.owns_socket()
    server.stop()
    assert os.path.exists(path)


def test_registration_with_the_simulated_kubelet(sockdir):
    with SimKubelet(sockdir, dial_timeout=5) as kubelet, SimKubeletClient(sockdir) as client:
        manager = ResourceManager(RESOURCE_GPU, DGX, ResponseOptions())
        server = PluginServer(manager, sockdir)
        server.start()
        try:
            with grpc.insecure_channel(f"unix:{kubelet.kubelet_socket}") as channel:
                server.register(channel, kubelet.kubelet_socket)
            state = client.wait_for(lambda s: s.resource(RESOURCE_GPU) is not None
                                    and len(s.resource(RESOURCE_GPU).devices) == 8,
                                    what="the device list")
            res = state.resource(RESOURCE_GPU)
            assert res.endpoint == "gpu-agent-gpu.sock" and res.get_preferred_allocation_available
        finally:
            server.stop()
        nobody = os.path.join(sockdir, "nobody.sock")
        with grpc.insecure_channel(f"unix:{nobody}") as channel, \
                pytest.raises(RegistrationError, match="registering nvidia.com/gpu with kubelet"):
            server.register(channel, nobody, timeout=2)


def test_a_repeated_allocate_is_recorded_each_time_and_answered_anew_after_a_reload(sockdir,
                                                                                   tmp_path):
    # the plugin keeps its answers by the request's bytes: each repeat is still recorded, a
    # reload answers anew, and with passDeviceSpecs nothing is kept (nvidia-uvm appears on
    # first use, and the next container must get it)
    recorded = []
    manager = ResourceManager(RESOURCE_GPU, DGX, ResponseOptions(),
                              journal=lambda res, hits: recorded.append(hits[0].devices[0].id))
    server = PluginServer(manager, sockdir)
    server.start()
    channel = grpc.insecure_channel(f"unix:{server.path}")
    stub = dp_grpc.DevicePluginStub(channel)
    request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(
        devices_ids=[IDS[3]])])
    try:
        first, again = (stub.Allocate(request, timeout=10).container_responses[0]
                        for _ in range(2))
        assert first == again and not first.mounts and recorded == [IDS[3]] * 2
        manager.reconfigure(DGX, ResponseOptions(("volume-mounts",)))
        assert stub.Allocate(request, timeout=10).container_responses[0].mounts
        (tmp_path / "dev").mkdir()
        (tmp_path / "dev" / "nvidiactl").touch()
        manager.reconfigure(DGX, ResponseOptions(pass_device_specs=True, dev_root=str(tmp_path)))
        before = stub.Allocate(request, timeout=10).container_responses[0]
        (tmp_path / "dev" / "nvidia-uvm").touch()
        after = stub.Allocate(request, timeout=10).container_responses[0]
        assert [d.container_path for d in before.devices] == ["/dev/nvidiactl", "/dev/nvidia3"]
        assert [d.container_path for d in after.devices] == ["/dev/nvidiactl", "/dev/nvidia-uvm",
                                                             "/dev/nvidia3"]
        assert recorded == [IDS[3]] * 5
    finally:
        channel.close()
        server.stop()
