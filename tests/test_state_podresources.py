"""The podresources v1 client and the reconciler (agent.kubelet.podresources, agent.state.reconciler) in-process,
against real gRPC servers on unix sockets: a kubelet too old for v1 (no such service:
UNIMPLEMENTED), one serving List (NUMA split) but not GetAllocatableResources (Kubernetes
1.20-1.22), and no socket at all. Each is reported with a reason; none stops the reconciler,
and records stay as they are. (The simulated kubelet's full v1 service is exercised end to end
in test_state_daemon.py.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from concurrent import futures

import grpc
import pytest

from agent._proto.podresources.v1 import api_pb2 as pr
from agent._proto.podresources.v1 import api_pb2_grpc as pr_grpc
from agent.errors import PodResourcesError
from agent.kubelet.podresources import PodResourcesClient
from agent.rm.allocate import ResponseOptions, container_response
from agent.rm.devices import Device
from agent.state.checkpoint import PodRef
from agent.state.journal import JOURNAL_FILE, Journal
from agent.state.reconciler import Reconciler

RES = "nvidia.com/gpu"
DEVICES = [Device(id=f"GPU-{i}", index=str(i), gpu_uuid=f"GPU-{i}", gpu_index=i,
                  numa_node=i // 4, paths=(f"/dev/nvidia{i}",)) for i in range(8)]


@pytest.fixture
def short_dir():
    d = tempfile.mkdtemp(prefix="gapr", dir="/tmp")  # unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


class _ListOnly(pr_grpc.PodResourcesListerServicer):
    """A kubelet of 1.20-1.22: List, but GetAllocatableResources is UNIMPLEMENTED (the
    generated base class answers that for every method not overridden)."""

    def List(self, request, context):
        return pr.ListPodResourcesResponse(pod_resources=[pr.PodResources(
            name="train", namespace="ml", containers=[pr.ContainerResources(
                name="main", devices=[
                    pr.ContainerDevices(resource_name=RES, device_ids=["GPU-0"]),
                    pr.ContainerDevices(resource_name=RES, device_ids=["GPU-5"]),  # NUMA split
                ])])])


def _serve(path: str, servicer=None) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    if servicer is not None:
        pr_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    assert server.add_insecure_port(f"unix:{path}")
    server.start()
    return server


def _journal(d: str) -> Journal:
    j = Journal(os.path.join(d, JOURNAL_FILE), boot="B")
    j.load()
    return j


def _allocate(j: Journal, *indexes: int):
    devices = [DEVICES[i] for i in indexes]
    rid, = j.record_allocation(RES, [(devices, container_response(devices, ResponseOptions()))])
    return next(r for r in j.records() if r.id == rid)


def _reconciler(j: Journal, socket: str) -> Reconciler:
    return Reconciler(j, socket, connect=PodResourcesClient, devices=lambda: {RES: DEVICES}, period=60.0)


def test_list_only_kubelet_attributes_and_reports_the_missing_method(short_dir):
    socket = os.path.join(short_dir, "kubelet.sock")
    server = _serve(socket, _ListOnly())
    try:
        j = _journal(short_dir)
        rec = _allocate(j, 0, 5)
        r = _reconciler(j, socket)
        outcome = r.run_once()
        assert outcome.listed and [x.pod for x in outcome.attributed] == [PodRef("ml", "train", "main")]
        assert j.records()[0].id == rec.id and j.records()[0].pod == PodRef("ml", "train", "main")
        status = r.status()
        assert status["answering"] and status["allocatable"] is None
        assert "does not serve podresources v1 GetAllocatableResources (it needs Kubernetes " \
               "1.23 or later)" in status["allocatableError"]
        r.client.close()
    finally:
        server.stop(None)


def test_a_kubelet_without_podresources_v1_is_reported_and_nothing_is_dropped(short_dir):
    socket = os.path.join(short_dir, "kubelet.sock")
    server = _serve(socket)  # a gRPC server without the v1 service, as an old kubelet
    try:
        client = PodResourcesClient(socket)
        with pytest.raises(PodResourcesError) as info:
            client.list()
        assert info.value.kind == "unimplemented"
        assert "does not serve podresources v1 List (it needs Kubernetes 1.20 or later)" in \
            str(info.value)
        client.close()
        j = _journal(short_dir)
        rec = _allocate(j, 3)
        r = _reconciler(j, socket)
        outcome = r.run_once()
        assert not outcome.listed and outcome.dropped == ()
        assert j.records() == (rec,)
        assert r.status()["errorKind"] == "unimplemented" and not r.status()["answering"]
        r.client.close()
    finally:
        server.stop(None)


def test_no_socket_is_reported_as_missing(short_dir):
    j = _journal(short_dir)
    rec = _allocate(j, 1)
    r = _reconciler(j, os.path.join(short_dir, "absent.sock"))
    assert not r.run_once().listed
    assert r.status()["errorKind"] == "missing"
    assert "absent.sock does not exist" in r.status()["error"]
    assert j.records() == (rec,)


class _SlowList(pr_grpc.PodResourcesListerServicer):
    """A kubelet whose List answers only when the test lets it: the listing it gives (pod
    "old" holding GPU-2) is what kubelet saw when it was asked, before the Allocate below."""

    def __init__(self):
        self.asked = threading.Event()
        self.answer = threading.Event()

    def List(self, request, context):
        self.asked.set()
        assert self.answer.wait(30)
        return pr.ListPodResourcesResponse(pod_resources=[pr.PodResources(
            name="old", namespace="ml", containers=[pr.ContainerResources(
                name="main", devices=[pr.ContainerDevices(resource_name=RES,
                                                          device_ids=["GPU-2"])])])])


def test_an_allocate_during_a_reconciliation_is_not_dropped_by_its_older_listing(short_dir):
    # kubelet freed GPU-2 from pod "old" and handed it to a new container: the Allocate lands
    # while podresources is being asked, and the answer still shows "old" holding GPU-2. Judged
    # by that listing the new record would be dropped ("its devices are now held by ml/old")
    # and its container later adopted without the response it was given.
    socket = os.path.join(short_dir, "kubelet.sock")
    slow = _SlowList()
    server = _serve(socket, slow)
    try:
        j = _journal(short_dir)
        r = _reconciler(j, socket)
        passed = []
        pass_thread = threading.Thread(target=lambda: passed.append(r.run_once()))
        pass_thread.start()
        assert slow.asked.wait(30)
        rec = _allocate(j, 2)  # answered while kubelet is being asked: no lock in the way
        r.configure(socket, 30.0)  # a SIGHUP meanwhile returns at once too
        slow.answer.set()
        pass_thread.join(30)
        [outcome] = passed
        assert outcome.listed and outcome.dropped == ()
        assert outcome.adopted == ()  # pod "old" is not adopted on that listing either
        assert j.records() == (rec,)  # untouched: not dropped, not given to pod "old"
        r.client.close()
    finally:
        slow.answer.set()
        server.stop(None)


def test_without_podresources_a_pass_still_sees_a_gpu_gone(short_dir):
    # passes without a listing skip the walk over the records while nothing they depend on
    # changed; a GPU that disappears is such a change
    j = _journal(short_dir)
    rec = _allocate(j, 3)
    advertised = {RES: DEVICES}
    r = Reconciler(j, os.path.join(short_dir, "absent.sock"), connect=PodResourcesClient,
                   devices=lambda: advertised, period=60.0)
    assert r.run_once().dropped == () and r.run_once().dropped == ()
    assert j.records() == (rec,)
    advertised = {RES: DEVICES[:3] + DEVICES[4:]}  # GPU 3 fell off the bus
    [(dropped, why)] = r.run_once().dropped
    assert dropped.id == rec.id and "GPU-3 (index 3) is no longer on this host" in why
    assert j.records() == ()


class _Listing(pr_grpc.PodResourcesListerServicer):
    """List answers the containers in `pods` (name -> device IDs) and counts its calls."""

    def __init__(self):
        self.pods: dict[str, list[str]] = {}
        self.cond = threading.Condition()

    def List(self, request, context):
        with self.cond:
            pods = dict(self.pods)
        return pr.ListPodResourcesResponse(pod_resources=[pr.PodResources(
            name=name, namespace="ml", containers=[pr.ContainerResources(
                name="main", devices=[pr.ContainerDevices(resource_name=RES, device_ids=ids)])])
            for name, ids in pods.items()])


def _attributed(j: Journal, rid: str, timeout: float = 30.0):
    """The pod record `rid` is attributed to, once a pass has attributed it (None if no pass
    did within `timeout`: the period is a minute, so only an Allocate asks for one sooner)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pod = next(r.pod for r in j.records() if r.id == rid)
        if pod is not None:
            return pod
        time.sleep(0.02)  # polled: a pass has no event of its own to wait on
    return None


def test_each_allocate_after_a_pass_asks_for_the_next_one(short_dir):
    # each Allocate asks the reconciler for a pass soon (Journal.on_allocate), which a pass
    # already due absorbs: the next Allocate after that pass must ask again, or its record
    # waits for the period (a minute here) to meet its pod
    socket = os.path.join(short_dir, "kubelet.sock")
    listing = _Listing()
    server = _serve(socket, listing)
    j = _journal(short_dir)
    r = _reconciler(j, socket)
    r.start()
    try:
        for n, pod in enumerate(("a", "b", "c"), 1):
            with listing.cond:
                listing.pods[pod] = [f"GPU-{n}"]  # kubelet lists the container...
            rec = _allocate(j, n)  # ...whose Allocate comes now
            assert _attributed(j, rec.id) == PodRef("ml", pod, "main"), pod
    finally:
        r.stop()
        server.stop(None)
