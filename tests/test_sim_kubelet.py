"""The simulated kubelet, driven the way a device plugin and a cluster drive a real one.

`gpu-agent sim kubelet --dir DIR` runs as a real subprocess (killed by PID at teardown) and a
small device plugin written here with the generated stubs (`example.com/widget`: 4 devices on
2 NUMA nodes, offering GetPreferredAllocation) talks to it over real unix sockets. Every wait
is bounded; nothing asserts on timing.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent._proto.deviceplugin.v1beta1.constants import HEALTHY, UNHEALTHY, VERSION
from agent._proto.podresources.v1 import api_pb2 as pr
from agent._proto.podresources.v1 import api_pb2_grpc as pr_grpc
from agent.errors import SimError
from agent.sim.kubelet import (
    AllocatableChange,
    PodExists,
    PodNotFound,
    PodRejected,
    SimKubelet,
    SimKubeletClient,
    control_socket_path,
    extended_resource_problem,
    registrations_per_instance,
    zero_windows,
)
from tests.conftest import ROOT, gpu_agent_cmd, run_gpu_agent

RESOURCE = "example.com/widget"
NUMA = {"w0": 0, "w1": 0, "w2": 1, "w3": 1}
WAIT = 20.0  # upper bound of every wait; a healthy run needs far less


class WidgetPlugin(dp_grpc.DevicePluginServicer):
    """A device plugin for example.com/widget: 4 devices on NUMA nodes 0 and 1.

    `preference` says how it answers GetPreferredAllocation: "numa1-first" (NUMA 1 devices,
    highest id first, which kubelet's own fallback would never pick), "unknown-ids" (devices
    that do not exist), "one" (a single device). Every call it gets is recorded.
    """

    def __init__(self, kubelet_dir: str, endpoint: str = "widget.sock", preferred: bool = True,
                 pre_start: bool = False, preference: str = "numa1-first",
                 allocate_error: str = "", empty_allocate: bool = False):
        self.dir = kubelet_dir
        self.endpoint = endpoint
        self.socket = os.path.join(kubelet_dir, endpoint)
        self.options = dp.DevicePluginOptions(get_preferred_allocation_available=preferred,
                                              pre_start_required=pre_start)
        self.preference = preference
        self.allocate_error = allocate_error
        self.empty_allocate = empty_allocate
        self.health = {d: HEALTHY for d in NUMA}
        self.preferred_requests: list[dp.PreferredAllocationRequest] = []
        self.allocate_requests: list[dp.AllocateRequest] = []
        self.allocate_responses: list[dp.AllocateResponse] = []
        self.pre_start_requests: list[dp.PreStartContainerRequest] = []
        self.list_and_watch_calls = 0
        self.streams_open = 0
        self._cond = threading.Condition()
        self._version = 0
        self._end_generation = 0
        self._server: grpc.Server | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> WidgetPlugin:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        dp_grpc.add_DevicePluginServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix:{self.socket}")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self.end_streams()
            self._server.stop(grace=None).wait()
            self._server = None

    def register(self, version: str = VERSION, resource: str = RESOURCE,
                 endpoint: str | None = None) -> None:
        """Register with the kubelet in self.dir; raises grpc.RpcError when refused."""
        with grpc.insecure_channel(f"unix:{os.path.join(self.dir, 'kubelet.sock')}") as channel:
            dp_grpc.RegistrationStub(channel).Register(dp.RegisterRequest(
                version=version, endpoint=self.endpoint if endpoint is None else endpoint,
                resource_name=resource, options=self.options), timeout=WAIT)

    def set_health(self, device: str, health: str) -> None:
        """Change a device's health; open ListAndWatch streams send a new snapshot."""
        with self._cond:
            self.health[device] = health
            self._version += 1
            self._cond.notify_all()

    def end_streams(self) -> None:
        """Make every open ListAndWatch call return (as a crashing plugin's would)."""
        with self._cond:
            self._end_generation += 1
            self._cond.notify_all()

    def snapshot(self) -> dp.ListAndWatchResponse:
        return dp.ListAndWatchResponse(devices=[
            dp.Device(ID=d, health=self.health[d],
                      topology=dp.TopologyInfo(nodes=[dp.NUMANode(ID=NUMA[d])]))
            for d in sorted(NUMA)])

    # -- DevicePlugin service -----------------------------------------------------------------

    def GetDevicePluginOptions(self, request, context):
        return self.options

    def ListAndWatch(self, request, context):
        with self._cond:
            self.list_and_watch_calls += 1
            self.streams_open += 1
            generation, sent = self._end_generation, None
        try:
            while context.is_active():
                with self._cond:
                    self._cond.wait_for(lambda sent=sent: self._version != sent
                                        or self._end_generation != generation, timeout=0.1)
                    if self._end_generation != generation:
                        return
                    if self._version == sent:
                        continue
                    sent, response = self._version, self.snapshot()
                yield response
        finally:
            with self._cond:
                self.streams_open -= 1
                self._cond.notify_all()

    def GetPreferredAllocation(self, request, context):
        self.preferred_requests.append(request)
        response = dp.PreferredAllocationResponse()
        for creq in request.container_requests:
            if self.preference == "unknown-ids":
                ids = ["nope0", "nope1"]
            elif self.preference == "one":
                ids = sorted(creq.available_deviceIDs)[-1:]
            else:
                ranked = sorted(creq.available_deviceIDs, key=lambda d: (NUMA[d], d), reverse=True)
                must = list(creq.must_include_deviceIDs)
                ids = (must + [d for d in ranked if d not in must])[:creq.allocation_size]
            response.container_responses.add(deviceIDs=ids)
        return response

    def Allocate(self, request, context):
        self.allocate_requests.append(request)
        if self.allocate_error:
            context.abort(grpc.StatusCode.INTERNAL, self.allocate_error)
        response = dp.AllocateResponse()
        if not self.empty_allocate:
            for creq in request.container_requests:
                ids = list(creq.devices_ids)
                response.container_responses.add(
                    envs={"WIDGET_VISIBLE_DEVICES": ",".join(ids)},
                    devices=[dp.DeviceSpec(container_path=f"/dev/{d}", host_path=f"/dev/{d}",
                                           permissions="rw") for d in ids],
                    annotations={"example.com/widgets": str(len(ids))},
                    cdi_devices=[dp.CDIDevice(name=f"{RESOURCE}={d}") for d in ids],
                )
        self.allocate_responses.append(response)
        return response

    def PreStartContainer(self, request, context):
        self.pre_start_requests.append(request)
        return dp.PreStartContainerResponse()


# -- fixtures ---------------------------------------------------------------------------------


def short_tmpdir_fixture(prefix: str, name: str):
    """A fixture `name` giving a new directory under /tmp, removed afterwards: unix socket
    paths are limited to 107 bytes, less than pytest's tmp_path leaves. test_plugin uses it too."""
    def short_tmpdir() -> Iterator[str]:
        path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    return pytest.fixture(short_tmpdir, name=name)


kdir = short_tmpdir_fixture("gk", "kdir")  # the device-plugin directory


@pytest.fixture
def kubelet_proc(kdir):
    """`gpu-agent sim kubelet --dir kdir` as a subprocess; SIGTERM then SIGKILL by PID at the end."""
    log_path = Path(kdir + ".log")
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            gpu_agent_cmd("--log-level", "debug", "sim", "kubelet", "--dir", kdir,
                          "--dial-timeout", "2"),
            cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        print(f"--- simulated kubelet (pid {proc.pid}, exit {proc.returncode}) log:\n"
              f"{log_path.read_text(errors='replace')[-20000:]}")
        log_path.unlink()


@pytest.fixture
def kubelet(kubelet_proc, kdir):
    """A client of the running simulated kubelet."""
    with SimKubeletClient(kdir) as client:
        deadline = time.monotonic() + WAIT
        while True:
            try:
                client.wait_ready(timeout=0.5)
                break
            except TimeoutError as err:
                if kubelet_proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"simulated kubelet did not come up (exit code "
                                f"{kubelet_proc.poll()}): {err}")
        yield client


@pytest.fixture
def plugin(kubelet, kdir):
    """The widget plugin, serving (not yet registered)."""
    p = WidgetPlugin(kdir).start()
    yield p
    p.stop()


def registered(client: SimKubeletClient, plugin: WidgetPlugin, allocatable: int = 4):
    """Register `plugin` and wait until kubelet has its first snapshot."""
    plugin.register()
    return client.wait_for(
        lambda s: s.resource(RESOURCE) is not None and s.resource(RESOURCE).connected
        and s.resource(RESOURCE).allocatable == allocatable, WAIT,
        what=f"{RESOURCE} connected with allocatable {allocatable}")


def podresources(kdir: str):
    channel = grpc.insecure_channel(f"unix:{os.path.join(kdir, 'pod-resources', 'kubelet.sock')}")
    return channel, pr_grpc.PodResourcesListerStub(channel)


def _is_socket(path: str) -> bool:
    return os.path.exists(path) and stat.S_ISSOCK(os.lstat(path).st_mode)


# -- registration -----------------------------------------------------------------------------


def test_plugin_registers_and_kubelet_sees_capacity_and_allocatable(kubelet, plugin):
    state = registered(kubelet, plugin)
    widget = state.resource(RESOURCE)
    assert state.registrations == (widget,)
    assert (widget.capacity, widget.allocatable, widget.allocated) == (4, 4, 0)
    assert widget.endpoint == "widget.sock"
    assert widget.registrations == 1
    assert widget.get_preferred_allocation_available and not widget.pre_start_required
    assert {d.id: d.numa_nodes for d in widget.devices} == {d: (n,) for d, n in NUMA.items()}
    assert all(d.healthy for d in widget.devices)
    assert plugin.list_and_watch_calls == 1


def test_unhealthy_device_in_a_new_snapshot_drops_allocatable(kubelet, plugin):
    first = registered(kubelet, plugin).resource(RESOURCE).snapshot_seq
    plugin.set_health("w1", UNHEALTHY)
    state = kubelet.wait_for(lambda s: s.resource(RESOURCE).allocatable == 3, WAIT)
    widget = state.resource(RESOURCE)
    assert widget.capacity == 4
    assert widget.device("w1").health == UNHEALTHY
    assert widget.snapshot_seq == first + 1
    assert [(d.id, d.health) for d in widget.latest_snapshot.devices] == [
        ("w0", HEALTHY), ("w1", UNHEALTHY), ("w2", HEALTHY), ("w3", HEALTHY)]

    plugin.set_health("w1", HEALTHY)
    kubelet.wait_for(lambda s: s.resource(RESOURCE).allocatable == 4, WAIT)
    history = kubelet.snapshots(RESOURCE)
    assert [(s.capacity, s.allocatable) for s in history] == [(4, 4), (4, 3), (4, 4)]
    assert [s.seq for s in history] == [first, first + 1, first + 2]
    assert all(s.registration == 1 for s in history)


BAD_REGISTRATIONS = [
    pytest.param({"version": "v1alpha"}, "requested API version 'v1alpha' is not supported",
                 id="version-v1alpha"),
    pytest.param({"resource": "cpu"}, "no domain prefix", id="resource-cpu"),
    pytest.param({"resource": "kubernetes.io/x"}, "kubernetes.io/", id="resource-kubernetes.io"),
    pytest.param({"resource": "requests.example.com/x"}, "reserved for resource quota",
                 id="resource-requests-prefix"),
    pytest.param({"resource": "Example.com/x"}, "DNS-1123", id="resource-uppercase-domain"),
    pytest.param({"endpoint": "nobody-listens.sock"}, "failed to dial device plugin",
                 id="unreachable-endpoint"),
]


@pytest.mark.parametrize("change, reason", BAD_REGISTRATIONS)
def test_bad_registration_is_refused_with_a_reason(kubelet, plugin, change, reason):
    with pytest.raises(grpc.RpcError) as info:
        plugin.register(**change)
    assert info.value.code() == grpc.StatusCode.UNKNOWN  # kubelet returns plain Go errors
    assert reason in info.value.details()
    state = kubelet.state()
    assert state.registration_failures == 1
    # The kubelet keeps serving: the same plugin registers properly afterwards.
    state = registered(kubelet, plugin)
    assert state.resource(RESOURCE).registrations == 1
    assert set(state.resources) == {RESOURCE}


@pytest.mark.parametrize("name, valid", [
    ("example.com/widget", True), ("nvidia.com/gpu", True), ("nvidia.com/mig-1g.10gb", True),
    ("a/b", True), ("cpu", False), ("kubernetes.io/x", False), ("foo.kubernetes.io/x", False),
    ("requests.a/b", False), ("a/b/c", False), ("a/", False), ("-a.com/x", False),
    ("a.com/-x", False), ("a.com/" + "x" * 64, False),
])
def test_extended_resource_name_rules(name, valid):
    assert (extended_resource_problem(name) is None) == valid


def test_a_second_registration_answers_allocate_and_the_first_stream_runs_on(kubelet, plugin,
                                                                            kdir):
    # kubelet 1.34 and 1.37 alike (tests/e2e/test_migration.py): the replaced registration's
    # stream stays open and its device lists still count; Allocate goes to the newest
    registered(kubelet, plugin)
    second = WidgetPlugin(kdir, endpoint="widget-2.sock", preferred=False).start()
    try:
        second.register()
        state = kubelet.wait_for(lambda s: s.resource(RESOURCE).registrations == 2
                                 and s.resource(RESOURCE).snapshot_seq == 2, WAIT)
        widget = state.resource(RESOURCE)
        assert widget.connected and widget.endpoint == "widget-2.sock"
        assert not widget.get_preferred_allocation_available
        assert plugin.streams_open == 1 and second.streams_open == 1
        plugin.set_health("w0", UNHEALTHY)  # the first plugin's list still counts
        kubelet.wait_for(lambda s: s.resource(RESOURCE).allocatable == 3, WAIT)
        kubelet.admit_pod("p", {"main": {RESOURCE: 1}})
        assert (len(second.allocate_requests), len(plugin.allocate_requests)) == (1, 0)
    finally:
        second.stop()


def test_up_to_1_36_the_replaced_streams_end_disconnects_the_newer_registration(kubelet,
                                                                                plugin, kdir):
    # kubelet <= 1.36, plugin/v1beta1/handler.go runClient: the client found by resource name
    # is the newer one, and it is disconnected; seen on kubelet 1.34 in tests/e2e
    registered(kubelet, plugin)
    second = WidgetPlugin(kdir, endpoint="widget-2.sock").start()
    try:
        second.register()
        seq = kubelet.wait_for(lambda s: s.resource(RESOURCE).registrations == 2, WAIT) \
            .last_event_seq
        plugin.stop()
        ended = kubelet.wait_for_event(lambda e: e.kind == e.STREAM_ENDED
                                       and "disconnect the registration that replaced it (2)"
                                       in e.message, after_seq=seq, timeout=WAIT)
        assert "unhealthy" in ended.message
        widget = kubelet.state().resource(RESOURCE)
        assert not widget.connected and widget.allocatable == 0
        with second._cond:
            assert second._cond.wait_for(lambda: second.streams_open == 0, WAIT)
        registered(kubelet, second)  # the newer plugin must register again
    finally:
        second.stop()


def test_from_1_37_the_replaced_streams_end_leaves_the_newer_registration(kdir):
    with SimKubelet(kdir, kubelet_version="1.37"), SimKubeletClient(kdir) as client:
        first = WidgetPlugin(kdir).start()
        second = WidgetPlugin(kdir, endpoint="widget-2.sock").start()
        try:
            registered(client, first)
            with pytest.raises(grpc.RpcError, match="device plugin already connected"):
                first.register()  # one endpoint per socket path
            second.register()
            seq = client.wait_for(lambda s: s.resource(RESOURCE).registrations == 2, WAIT) \
                .last_event_seq
            first.stop()
            client.wait_for_event(lambda e: e.kind == e.STREAM_ENDED, after_seq=seq,
                                  timeout=WAIT)
            widget = client.state().resource(RESOURCE)
            assert widget.connected and widget.endpoint == "widget-2.sock"
            assert widget.allocatable == 4 and second.streams_open == 1
            client.admit_pod("p", {"main": {RESOURCE: 1}})
            assert len(second.allocate_requests) == 1
        finally:
            first.stop()
            second.stop()


# -- allocation -------------------------------------------------------------------------------


def test_admit_pod_asks_for_a_preference_then_allocates_one_container(kubelet, plugin):
    registered(kubelet, plugin)
    pod = kubelet.admit_pod("trainer", {"main": {RESOURCE: 2, "cpu": 4}})

    assert len(plugin.preferred_requests) == 1
    (creq,) = plugin.preferred_requests[0].container_requests
    assert sorted(creq.available_deviceIDs) == ["w0", "w1", "w2", "w3"]
    assert list(creq.must_include_deviceIDs) == []
    assert creq.allocation_size == 2

    assert len(plugin.allocate_requests) == 1
    (areq,) = plugin.allocate_requests[0].container_requests
    assert list(areq.devices_ids) == ["w3", "w2"]  # the plugin's preference, in its order

    allocation = pod.container("main").allocation(RESOURCE)
    assert allocation.device_ids == ("w3", "w2")
    assert allocation.allocate_response == plugin.allocate_responses[0]
    assert allocation.container_response.envs["WIDGET_VISIBLE_DEVICES"] == "w3,w2"
    assert allocation.preferred_called and allocation.preferred_device_ids == ("w3", "w2")
    assert not allocation.pre_start_called

    widget = kubelet.state().resource(RESOURCE)
    assert widget.allocated == 2
    assert {d.id for d in widget.devices if d.allocated} == {"w2", "w3"}


@pytest.mark.parametrize("options, expected, preferred_calls", [
    pytest.param({"preferred": False}, ("w0", "w1"), 0, id="no-preferred-option"),
    pytest.param({"preference": "unknown-ids"}, ("w0", "w1"), 1, id="preference-names-unknown-ids"),
    pytest.param({"preference": "one"}, ("w3", "w0"), 1, id="preference-too-short"),
])
def test_kubelet_fills_what_the_preference_does_not_give(kubelet, kdir, options, expected,
                                                         preferred_calls):
    p = WidgetPlugin(kdir, **options).start()
    try:
        registered(kubelet, p)
        pod = kubelet.admit_pod("p", {"main": {RESOURCE: 2}})
        assert pod.devices(RESOURCE) == expected
        assert len(p.preferred_requests) == preferred_calls
        assert [list(r.container_requests[0].devices_ids) for r in p.allocate_requests] == \
            [list(expected)]
    finally:
        p.stop()


def test_pre_start_container_is_called_when_the_plugin_asks(kubelet, kdir):
    p = WidgetPlugin(kdir, pre_start=True).start()
    try:
        registered(kubelet, p)
        pod = kubelet.admit_pod("p", {"main": {RESOURCE: 1}})
        assert [list(r.devices_ids) for r in p.pre_start_requests] == [list(pod.devices(RESOURCE))]
        assert pod.container("main").allocation(RESOURCE).pre_start_called
    finally:
        p.stop()


def test_each_container_gets_its_own_allocate_call(kubelet, plugin):
    registered(kubelet, plugin)
    pod = kubelet.admit_pod("two", {"a": {RESOURCE: 1}, "b": {RESOURCE: 2}, "c": {}})
    assert [len(r.container_requests) for r in plugin.allocate_requests] == [1, 1]
    assert len(set(pod.devices(RESOURCE))) == 3
    # Container b was offered only what container a left.
    assert pod.container("a").devices(RESOURCE)[0] not in \
        plugin.preferred_requests[1].container_requests[0].available_deviceIDs
    assert pod.container("c").allocations == ()


@pytest.mark.parametrize("held, asked, resource, reason", [
    pytest.param(0, 5, RESOURCE, "requested number of devices unavailable for example.com/widget. "
                 "Requested: 5, Available: 4", id="more-than-capacity"),
    pytest.param(3, 2, RESOURCE, "Requested: 2, Available: 1", id="more-than-left"),
    pytest.param(0, 1, "example.com/none", "Node didn't have enough resource: example.com/none",
                 id="unknown-resource"),
])
def test_pod_asking_too_much_is_rejected_with_a_reason(kubelet, plugin, held, asked, resource,
                                                       reason):
    registered(kubelet, plugin)
    if held:
        kubelet.admit_pod("holder", {"main": {RESOURCE: held}})
    calls = len(plugin.allocate_requests)
    with pytest.raises(PodRejected, match="rejected") as info:
        kubelet.admit_pod("greedy", {"main": {resource: asked}})
    assert reason in str(info.value)
    assert len(plugin.allocate_requests) == calls  # the plugin was never asked
    state = kubelet.state()
    assert state.pod("greedy") is None
    assert state.resource(RESOURCE).allocated == held
    # Still serving: a pod that fits is admitted.
    assert len(kubelet.admit_pod("modest", {"main": {RESOURCE: 1}}).devices(RESOURCE)) == 1


@pytest.mark.parametrize("options, reason", [
    pytest.param({"allocate_error": "widget firmware busy"},
                 "device plugin Allocate rpc failed with err: rpc error: code = INTERNAL desc = "
                 "widget firmware busy", id="allocate-fails"),
    pytest.param({"empty_allocate": True}, "no containers return in allocation response",
                 id="empty-response"),
])
def test_plugin_allocate_failure_rejects_the_pod(kubelet, kdir, options, reason):
    p = WidgetPlugin(kdir, **options).start()
    try:
        registered(kubelet, p)
        with pytest.raises(PodRejected) as info:
            kubelet.admit_pod("p", {"main": {RESOURCE: 1}})
        assert reason in str(info.value)
        assert kubelet.state().resource(RESOURCE).allocated == 0
    finally:
        p.stop()


def test_delete_pod_frees_its_devices(kubelet, plugin):
    registered(kubelet, plugin)
    kubelet.admit_pod("all", {"main": {RESOURCE: 4}})
    with pytest.raises(PodRejected):
        kubelet.admit_pod("late", {"main": {RESOURCE: 1}})
    with pytest.raises(PodExists):
        kubelet.admit_pod("all", {"main": {RESOURCE: 1}})
    deleted = kubelet.delete_pod("all")
    assert sorted(deleted.devices(RESOURCE)) == ["w0", "w1", "w2", "w3"]
    assert kubelet.state().resource(RESOURCE).allocated == 0
    assert len(kubelet.admit_pod("late", {"main": {RESOURCE: 1}}).devices(RESOURCE)) == 1
    with pytest.raises(PodNotFound, match="pod all in namespace default not found"):
        kubelet.delete_pod("all")


# -- podresources -----------------------------------------------------------------------------


def test_podresources_reports_pods_and_allocatable_devices(kubelet, plugin, kdir):
    registered(kubelet, plugin)
    kubelet.admit_pod("trainer", {"main": {RESOURCE: 2}, "sidecar": {}}, namespace="ml")
    channel, stub = podresources(kdir)
    with channel:
        (listed,) = stub.List(pr.ListPodResourcesRequest(), timeout=WAIT).pod_resources
        assert (listed.name, listed.namespace) == ("trainer", "ml")
        assert [c.name for c in listed.containers] == ["main", "sidecar"]
        (devices,) = listed.containers[0].devices  # w2 and w3 share NUMA node 1
        assert devices.resource_name == RESOURCE
        assert sorted(devices.device_ids) == ["w2", "w3"]
        assert [n.ID for n in devices.topology.nodes] == [1]
        assert list(listed.containers[1].devices) == []

        got = stub.Get(pr.GetPodResourcesRequest(pod_name="trainer", pod_namespace="ml"),
                       timeout=WAIT).pod_resources
        assert got == listed
        with pytest.raises(grpc.RpcError) as info:
            stub.Get(pr.GetPodResourcesRequest(pod_name="trainer", pod_namespace="default"),
                     timeout=WAIT)
        assert "pod trainer in namespace default not found" in info.value.details()

        allocatable = stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=WAIT)
        assert sorted((d.resource_name, tuple(d.device_ids), d.topology.nodes[0].ID)
                      for d in allocatable.devices) == \
            [(RESOURCE, (d,), n) for d, n in sorted(NUMA.items())]

        plugin.set_health("w0", UNHEALTHY)
        kubelet.wait_for(lambda s: s.resource(RESOURCE).allocatable == 3, WAIT)
        allocatable = stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=WAIT)
        assert sorted(d.device_ids[0] for d in allocatable.devices) == ["w1", "w2", "w3"]


def test_podresources_splits_a_containers_devices_by_numa_node(kubelet, plugin, kdir):
    registered(kubelet, plugin)
    kubelet.admit_pod("wide", {"main": {RESOURCE: 3}})
    channel, stub = podresources(kdir)
    with channel:
        (pod,) = stub.List(pr.ListPodResourcesRequest(), timeout=WAIT).pod_resources
    by_node = {d.topology.nodes[0].ID: sorted(d.device_ids) for d in pod.containers[0].devices}
    assert by_node == {0: ["w1"], 1: ["w2", "w3"]}


# -- stream end and restart -------------------------------------------------------------------


def test_stream_that_ends_makes_devices_unhealthy_until_the_plugin_registers_again(kubelet,
                                                                                   plugin):
    seq = registered(kubelet, plugin).last_event_seq
    plugin.end_streams()
    ended = kubelet.wait_for_event(lambda e: e.kind == e.STREAM_ENDED, after_seq=seq,
                                   timeout=WAIT, what="STREAM_ENDED")
    assert ended.resource_name == RESOURCE and "unhealthy" in ended.message
    state = kubelet.state()
    assert state.registrations == ()
    widget = state.resource(RESOURCE)
    assert (widget.capacity, widget.allocatable) == (4, 0)
    assert {d.health for d in widget.devices} == {UNHEALTHY}
    assert "closed the ListAndWatch stream" in widget.stream_end_reason
    with pytest.raises(PodRejected, match="no healthy devices present"):
        kubelet.admit_pod("p", {"main": {RESOURCE: 1}})
    assert plugin.list_and_watch_calls == 1  # kubelet never reopens a stream on its own

    state = registered(kubelet, plugin)
    assert state.resource(RESOURCE).registrations == 2
    assert plugin.list_and_watch_calls == 2


def test_restart_deletes_sockets_keeps_pods_and_the_plugin_registers_again(kubelet, plugin, kdir):
    registered(kubelet, plugin)
    kubelet.admit_pod("survivor", {"main": {RESOURCE: 2}})
    Path(kdir, "kubelet_internal_checkpoint").write_text("{}")  # a regular file: kept
    assert _is_socket(plugin.socket)

    removed = kubelet.restart()

    assert sorted(os.path.basename(p) for p in removed) == ["kubelet.sock", "widget.sock"]
    assert not os.path.exists(plugin.socket)
    assert _is_socket(os.path.join(kdir, "kubelet.sock"))  # listening again
    assert _is_socket(control_socket_path(kdir))
    assert os.path.isfile(os.path.join(kdir, "kubelet_internal_checkpoint"))
    state = kubelet.state()
    widget = state.resource(RESOURCE)
    assert state.restarts == 1
    assert (widget.connected, widget.capacity, widget.allocatable) == (False, 0, 0)
    assert state.pod("survivor").devices(RESOURCE) == ("w3", "w2")
    channel, stub = podresources(kdir)
    with channel:  # like a real kubelet, it lists its pods again only a while later
        assert list(stub.List(pr.ListPodResourcesRequest(), timeout=WAIT).pod_resources) == []

    # The plugin notices its socket is gone, serves again and registers again.
    plugin.stop()
    plugin.start()
    state = registered(kubelet, plugin)
    assert state.resource(RESOURCE).registrations == 2
    assert state.resource(RESOURCE).allocated == 2
    with pytest.raises(PodRejected, match="Requested: 3, Available: 2"):
        kubelet.admit_pod("greedy", {"main": {RESOURCE: 3}})
    channel, stub = podresources(kdir)
    deadline = time.monotonic() + WAIT
    with channel:
        while not (listed := stub.List(pr.ListPodResourcesRequest(), timeout=WAIT)
                   .pod_resources) and time.monotonic() < deadline:
            time.sleep(0.05)
    (pod,) = listed
    assert pod.name == "survivor"


# -- allocatable history ----------------------------------------------------------------------


def _steps(history: list[AllocatableChange]) -> list[tuple]:
    return [(c.cause, c.capacity, c.allocatable, c.instance, c.registration) for c in history]


def test_history_records_snapshots_that_change_the_counts(kubelet, plugin):
    before = time.monotonic_ns()
    state = registered(kubelet, plugin)
    plugin.set_health("w1", UNHEALTHY)
    kubelet.wait_for(lambda s: s.resource(RESOURCE).allocatable == 3, WAIT)
    plugin.set_health("w1", UNHEALTHY)  # the same list again: a snapshot, not a change
    kubelet.wait_for(lambda s: s.resource(RESOURCE).snapshot_seq == 3, WAIT)
    plugin.set_health("w1", HEALTHY)
    kubelet.wait_for(lambda s: s.resource(RESOURCE).allocatable == 4, WAIT)

    history = kubelet.allocatable_history(RESOURCE)
    assert _steps(history) == [("registered", 0, 0, 0, 1), ("snapshot", 4, 4, 0, 1),
                               ("snapshot", 4, 3, 0, 1), ("snapshot", 4, 4, 0, 1)]
    assert [c.seq for c in history] == [1, 2, 3, 4]
    assert all(c.resource == RESOURCE for c in history)
    assert history[0].wall_ns == state.resource(RESOURCE).registered_ns
    times = [c.monotonic_ns for c in history]
    assert before <= times[0] and times == sorted(times)
    assert kubelet.allocatable_history(after_seq=2) == history[2:]
    assert kubelet.allocatable_history("example.com/other") == []
    assert kubelet.zero_windows(RESOURCE) == []
    assert kubelet.registrations_per_instance(RESOURCE) == {0: 1}


def test_history_records_a_stream_end_as_a_zero_window_until_the_next_snapshot(kubelet, plugin):
    registered(kubelet, plugin)
    plugin.end_streams()
    kubelet.wait_for(lambda s: not s.resource(RESOURCE).connected, WAIT)
    (window,) = kubelet.zero_windows(RESOURCE)
    assert (window.start.cause, window.start.capacity, window.start.allocatable) == \
        ("stream-ended", 4, 0)
    assert window.end is None and window.duration_ns is None

    registered(kubelet, plugin)
    assert _steps(kubelet.allocatable_history(RESOURCE)) == [
        ("registered", 0, 0, 0, 1), ("snapshot", 4, 4, 0, 1), ("stream-ended", 4, 0, 0, 1),
        ("registered", 4, 0, 0, 2), ("snapshot", 4, 4, 0, 2)]
    (window,) = kubelet.zero_windows(RESOURCE)
    assert (window.end.cause, window.end.allocatable, window.end.registration) == \
        ("snapshot", 4, 2)
    assert window.duration_ns > 0
    assert kubelet.zero_windows(RESOURCE, since_ns=window.end.monotonic_ns) == []
    assert kubelet.registrations_per_instance(RESOURCE) == {0: 2}


def test_history_counts_restarts_as_instances_and_registrations_in_each(kubelet, plugin):
    registered(kubelet, plugin)
    kubelet.restart()
    kubelet.restart()  # before the plugin registers again: an instance without a registration
    plugin.stop()
    plugin.start()
    registered(kubelet, plugin)

    history = kubelet.allocatable_history(RESOURCE)
    assert _steps(history) == [
        ("registered", 0, 0, 0, 1), ("snapshot", 4, 4, 0, 1), ("restarted", 0, 0, 1, 1),
        ("restarted", 0, 0, 2, 1), ("registered", 0, 0, 2, 2), ("snapshot", 4, 4, 2, 2)]
    assert kubelet.registrations_per_instance(RESOURCE) == {0: 1, 1: 0, 2: 1}
    (window,) = kubelet.zero_windows(RESOURCE)
    assert (window.start.cause, window.start.instance, window.end.seq) == \
        ("restarted", 1, history[-1].seq)
    # No zero window begins after the registration of the last instance.
    assert kubelet.zero_windows(RESOURCE, since_ns=history[-2].monotonic_ns) == []


def _change(seq: int, allocatable: int, cause: str = "snapshot", instance: int = 0):
    return AllocatableChange(seq, RESOURCE, cause, seq, seq * 10, 4, allocatable, instance, 1)


@pytest.mark.parametrize("counts, since_ns, expected", [
    pytest.param([0, 4, 4], 0, [], id="never-zero-after-up"),
    pytest.param([0, 0], 0, [], id="never-up"),
    pytest.param([4, 0, 0, 3], 0, [(2, 4)], id="one-closed"),
    pytest.param([4, 0, 2, 0], 0, [(2, 3), (4, None)], id="closed-then-open"),
    pytest.param([4, 0, 2, 0], 30, [(4, None)], id="since-skips-earlier-starts"),
    pytest.param([4, 0, 2], 21, [], id="since-after-a-start-inside-the-window"),
])
def test_zero_windows_from_a_history(counts, since_ns, expected):
    history = [_change(i + 1, n) for i, n in enumerate(counts)]
    windows = zero_windows(history, since_ns)
    assert [(w.start.seq, w.end.seq if w.end else None) for w in windows] == expected


def test_registrations_per_instance_from_a_history():
    history = [_change(1, 0, "registered"), _change(2, 4), _change(3, 0, "restarted", 1),
               _change(4, 0, "restarted", 2), _change(5, 0, "registered", 2),
               _change(6, 0, "registered", 2)]
    assert registrations_per_instance(history) == {0: 1, 1: 0, 2: 2}
    assert registrations_per_instance([]) == {}


# -- events, CLI, in-process ------------------------------------------------------------------


def test_watch_reports_each_step_with_timestamps(kubelet, plugin):
    start = kubelet.state().last_event_seq
    registered(kubelet, plugin)
    kubelet.admit_pod("p", {"main": {RESOURCE: 1}})
    kubelet.delete_pod("p")
    kinds = []
    for event in kubelet.events(after_seq=start, timeout=WAIT):
        kinds.append(event.Kind.Name(event.kind))
        if event.kind == event.POD_DELETED:
            break
    assert kinds == ["REGISTERED", "SNAPSHOT", "ALLOCATED", "POD_DELETED"]
    events = list(kubelet.events(after_seq=start, timeout=1))
    assert [e.seq for e in events] == list(range(start + 1, start + 5))
    assert all(a.time.monotonic_ns <= b.time.monotonic_ns for a, b in zip(events, events[1:]))
    assert events[1].snapshot.allocatable == 4
    assert list(events[2].device_ids) == ["w3"]


def test_cli_admits_shows_and_deletes_pods(kubelet, plugin, kdir):
    registered(kubelet, plugin)
    out = run_gpu_agent("sim", "admit", "--dir", kdir, "--name", "cli-pod",
                        "--request", f"main:{RESOURCE}=2").stdout
    assert "pod default/cli-pod" in out and "w3, w2" in out
    out = run_gpu_agent("sim", "kubelet-state", "--dir", kdir).stdout
    assert "capacity 4, allocatable 4, allocated 2" in out
    proc = run_gpu_agent("sim", "admit", "--dir", kdir, "--name", "too-big",
                         "--request", f"{RESOURCE}=9", check=False)
    assert proc.returncode == 2 and "Requested: 9, Available: 2" in proc.stderr
    run_gpu_agent("sim", "delete-pod", "--dir", kdir, "--name", "cli-pod")
    assert kubelet.state().pods == ()


def test_sim_kubelet_exits_0_on_sigterm_and_removes_its_sockets(kubelet, kubelet_proc, kdir):
    os.kill(kubelet_proc.pid, signal.SIGTERM)
    assert kubelet_proc.wait(timeout=WAIT) == 0
    assert not os.path.exists(os.path.join(kdir, "kubelet.sock"))
    assert not os.path.exists(control_socket_path(kdir))


def test_in_process_sim_kubelet_with_its_own_podresources_socket(kdir):
    pr_socket = os.path.join(kdir, "pr", "api.sock")
    with SimKubelet(kdir, podresources_socket=pr_socket) as sim, SimKubeletClient(kdir) as client:
        p = WidgetPlugin(kdir).start()
        try:
            registered(client, p)
            pod = client.admit_pod("p", {"main": {RESOURCE: 1}})
            assert sim.state().pods[0].containers[0].resources[0].device_ids == \
                list(pod.devices(RESOURCE))
            with grpc.insecure_channel(f"unix:{pr_socket}") as channel:
                listed = pr_grpc.PodResourcesListerStub(channel).List(
                    pr.ListPodResourcesRequest(), timeout=WAIT).pod_resources
            assert [pod.name for pod in listed] == ["p"]
            assert client.state().podresources_socket == pr_socket
            restarts, removed = sim.restart()
            assert restarts == 1 and os.path.join(kdir, "widget.sock") in removed
            assert _is_socket(pr_socket)
        finally:
            p.stop()
    assert not os.path.exists(os.path.join(kdir, "kubelet.sock"))
    assert not os.path.exists(pr_socket)


def test_sim_kubelet_refuses_a_directory_too_long_for_unix_sockets():
    with pytest.raises(SimError, match="use a shorter --dir"):
        SimKubelet("/tmp/" + "d" * 100)


def test_cli_reports_a_directory_it_cannot_create():
    proc = run_gpu_agent("sim", "kubelet", "--dir", "/proc/gk-cannot-exist", check=False)
    assert proc.returncode == 2
    assert "cannot start the simulated kubelet in /proc/gk-cannot-exist" in proc.stderr


def test_wait_for_times_out_with_the_last_state(kubelet, plugin):
    registered(kubelet, plugin)
    with pytest.raises(TimeoutError) as info:
        kubelet.wait_for(lambda s: s.restarts == 5, timeout=0.2, what="five restarts")
    message = str(info.value)
    assert "five restarts" in message and "example.com/widget: endpoint widget.sock" in message
