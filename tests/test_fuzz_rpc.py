"""Fuzzing the device-plugin API of a running agent: Hypothesis makes GetDevicePluginOptions,
GetPreferredAllocation, Allocate and PreStartContainer requests (random and real device IDs,
duplicates, unicode, empty lists, sizes past what is available, must-include IDs outside the
available ones) and sends them over the agent's real unix socket to one `gpu-agent run` on the
simulated node. Every answer must be a valid one or INVALID_ARGUMENT with a reason, and after
each request the agent must still answer a well-formed Allocate and keep its ListAndWatch
stream to the simulated kubelet. A few huge requests (10⁵ IDs) are sent as fixed cases, and
Allocate also gets arbitrary bytes (the agent decodes its requests itself).

Valid means what kubelet relies on: a preferred allocation of exactly the requested size,
from the available IDs, with every must-include ID; one Allocate response per container,
naming exactly the GPUs behind the IDs asked for in NVIDIA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent.sim.profile import load_profile
from tests.daemon_harness import GPU, Node

UUIDS = [g["uuid"] for g in load_profile("dgx1-v100")["gpus"]]
WAIT = 30.0

# IDs: the real ones mostly, then look-alikes, unicode and empty strings
ids = st.one_of(st.sampled_from(UUIDS), st.sampled_from(UUIDS).map(str.lower),
                st.sampled_from(UUIDS).map(lambda u: u + "::1"),
                st.text(max_size=60), st.just(""), st.just("GPU-" + "f" * 36))
id_lists = st.lists(ids, max_size=12)


@pytest.fixture(scope="module")
def agent():
    with Node() as node:
        running = node.agent()
        running.wait_registered()
        yield node, running
        assert running.stop() == 0


def still_serving(node, running) -> None:
    resp = running.allocate([UUIDS[0]])
    assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == UUIDS[0]
    res = node.client.state().resource(GPU)
    assert res.connected and res.registrations == 1


def refused_with_a_reason(exc: grpc.RpcError) -> None:
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
    assert exc.details()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(containers=st.lists(st.tuples(id_lists, id_lists, st.integers(-3, 12)), max_size=4))
def test_get_preferred_allocation_answers_validly_or_refuses(agent, containers):
    node, running = agent
    request = dp.PreferredAllocationRequest(container_requests=[
        dp.ContainerPreferredAllocationRequest(available_deviceIDs=available,
                                               must_include_deviceIDs=must,
                                               allocation_size=max(size, 0))
        for available, must, size in containers])
    try:
        resp = running.stub().GetPreferredAllocation(request, timeout=WAIT)
    except grpc.RpcError as exc:
        refused_with_a_reason(exc)
    else:
        assert len(resp.container_responses) == len(containers)
        for (available, must, size), got in zip(containers, resp.container_responses):
            picked = list(got.deviceIDs)
            assert len(picked) == max(size, 0) == len(set(picked))
            assert set(picked) <= set(available) and set(must) <= set(picked)
    still_serving(node, running)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(containers=st.lists(id_lists, max_size=4))
def test_allocate_answers_validly_or_refuses(agent, containers):
    node, running = agent
    try:
        resp = running.allocate(*containers) if containers else running.stub().Allocate(
            dp.AllocateRequest(), timeout=WAIT)
    except grpc.RpcError as exc:
        refused_with_a_reason(exc)
    else:
        assert len(resp.container_responses) == len(containers)
        for asked, got in zip(containers, resp.container_responses):
            visible = got.envs["NVIDIA_VISIBLE_DEVICES"]
            assert set(visible.split(",")) == set(asked), (asked, visible)
    still_serving(node, running)


def allocate_bytes(running, raw: bytes) -> bytes:
    """Allocate with `raw` as the request's bytes on the wire, as a client with another
    protobuf library (or a broken one) might send; the answer's bytes."""
    with grpc.insecure_channel(f"unix:{running.node.plugin_socket}",
                               options=[("grpc.enable_http_proxy", 0)]) as channel:
        return channel.unary_unary("/v1beta1.DevicePlugin/Allocate")(raw, timeout=WAIT)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.one_of(st.binary(max_size=120), id_lists.map(
    lambda ids: dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(
        devices_ids=ids)]).SerializeToString() + b"\x12\x03abc")))
def test_allocate_of_any_bytes_answers_as_their_request_or_refuses(agent, raw):
    # The agent decodes Allocate's bytes itself (agent.kubelet.plugin._add_servicer): bytes
    # that are no AllocateRequest are refused with a reason, and any others (unknown fields
    # included) answered as protobuf reads them.
    node, running = agent
    try:
        request = dp.AllocateRequest.FromString(raw)
    except DecodeError:
        request = None
    try:
        resp = dp.AllocateResponse.FromString(allocate_bytes(running, raw))
    except grpc.RpcError as exc:
        refused_with_a_reason(exc)
        if request is None:
            assert "not a valid AllocateRequest" in exc.details()
    else:
        assert request is not None, "bytes that are no AllocateRequest were answered"
        assert len(resp.container_responses) == len(request.container_requests)
        for asked, got in zip(request.container_requests, resp.container_responses):
            visible = got.envs["NVIDIA_VISIBLE_DEVICES"]
            assert set(visible.split(",")) == set(asked.devices_ids), (asked, visible)
    still_serving(node, running)


def test_the_same_request_bytes_again_get_the_same_answer(agent):
    node, running = agent
    raw = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(
        devices_ids=UUIDS[2:4])]).SerializeToString()
    first, again = allocate_bytes(running, raw), allocate_bytes(running, raw)
    assert first == again
    got = dp.AllocateResponse.FromString(again).container_responses[0]
    assert got.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(UUIDS[2:4])


@settings(max_examples=50, deadline=None)
@given(container_ids=id_lists)
def test_options_and_pre_start_container_always_answer(agent, container_ids):
    node, running = agent
    stub = running.stub()
    assert stub.GetDevicePluginOptions(dp.Empty(), timeout=WAIT).get_preferred_allocation_available
    stub.PreStartContainer(dp.PreStartContainerRequest(devices_ids=container_ids), timeout=WAIT)
    still_serving(node, running)


@pytest.mark.parametrize("size", [10 ** 3, 10 ** 5])
def test_huge_requests_are_answered_or_refused_and_the_agent_serves_on(agent, size):
    node, running = agent
    # mostly short unknown IDs: 10^5 of them stay under gRPC's 4 MiB message limit
    huge = [UUIDS[i % 8] if i % 50 == 0 else f"x{i}" for i in range(size)]
    stub = running.stub()
    for call in (lambda: running.allocate(huge),
                 lambda: stub.GetPreferredAllocation(dp.PreferredAllocationRequest(
                     container_requests=[dp.ContainerPreferredAllocationRequest(
                         available_deviceIDs=huge, must_include_deviceIDs=huge[:size // 2],
                         allocation_size=size)]), timeout=WAIT),
                 lambda: stub.GetPreferredAllocation(dp.PreferredAllocationRequest(
                     container_requests=[dp.ContainerPreferredAllocationRequest(
                         available_deviceIDs=UUIDS, allocation_size=size)]), timeout=WAIT)):
        with pytest.raises(grpc.RpcError) as info:
            call()
        refused_with_a_reason(info.value)
    still_serving(node, running)


def test_a_request_past_grpcs_message_limit_is_refused_by_grpc_and_the_agent_serves_on(agent):
    # 10^5 UUIDs are 4.9 MB, past gRPC's default 4 MiB limit for a received message (kubelet
    # sends a few hundred bytes): gRPC refuses it before the handler, with its reason
    node, running = agent
    with pytest.raises(grpc.RpcError) as info:
        running.allocate([UUIDS[i % 8] for i in range(10 ** 5)])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in info.value.details()
    still_serving(node, running)
