"""This node's ResourceSlice through the API server (agent.dra.publisher), against the fast
tests' API server (tests/kube_api.py): created once, replaced with the next pool generation
when the devices change, never rewritten when they do not (also by a restarted agent), owned
by the Node, and a conflict read again instead of overwritten."""

from __future__ import annotations

import pytest

from agent.dra.publisher import SlicePublisher
from agent.errors import KubeApiError
from agent.kubeapi.client import connect
from tests.kube_api import KubeApi

NODE = "gpu-node-1"
NAME = f"{NODE}-gpu.nvidia.com"


def _device(name: str, memory: str = "80Gi") -> dict:
    return {"name": name, "attributes": {"type": {"string": "gpu"}},
            "capacity": {"memory": {"value": memory}}}


@pytest.fixture
def api(tmp_path):
    server = KubeApi(NODE)
    client = connect(server.kubeconfig(str(tmp_path / "kubeconfig")))
    yield server, client
    client.close()
    server.stop()


def _writes(server: KubeApi) -> list[str]:
    return [m for m, path, _ in server.requests if "resourceslices" in path and m != "GET"]


def test_the_first_publish_creates_one_slice_owned_by_the_node_with_generation_one(api):
    server, client = api
    assert SlicePublisher(client, NODE).publish([_device("gpu-0"), _device("gpu-1")])
    held = server.slices[NAME]
    assert held["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert held["spec"]["nodeName"] == NODE and held["spec"]["driver"] == "gpu.nvidia.com"
    assert [d["name"] for d in held["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert held["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": server.uid,
         "controller": True}]


def test_unchanged_devices_write_nothing_and_a_change_writes_the_next_generation(api):
    server, client = api
    publisher = SlicePublisher(client, NODE)
    devices = [_device("gpu-0"), _device("gpu-1")]
    assert publisher.publish(devices)
    assert not publisher.publish([dict(d) for d in devices])
    assert _writes(server) == ["POST"]
    assert publisher.publish(devices[:1])  # GPU 1 gone
    assert _writes(server) == ["POST", "PUT"]
    assert server.slices[NAME]["spec"]["pool"]["generation"] == 2
    assert [d["name"] for d in server.slices[NAME]["spec"]["devices"]] == ["gpu-0"]


def test_a_restarted_agent_rewrites_nothing_unchanged_and_never_goes_back_a_generation(api):
    server, client = api
    first = SlicePublisher(client, NODE)
    first.publish([_device("gpu-0")])
    first.publish([_device("gpu-0", "40Gi")])  # generation 2
    again = SlicePublisher(client, NODE)  # the agent restarted
    assert not again.publish([_device("gpu-0", "40Gi")])
    assert _writes(server) == ["POST", "PUT"]
    assert again.publish([_device("gpu-0", "80Gi")])
    assert server.slices[NAME]["spec"]["pool"]["generation"] == 3


def test_a_slice_changed_meanwhile_is_a_conflict_then_read_again_and_replaced(api):
    server, client = api
    publisher = SlicePublisher(client, NODE)
    publisher.publish([_device("gpu-0")])
    server.change_slice(NAME)  # another writer: its resourceVersion moved on
    with pytest.raises(KubeApiError) as refused:
        publisher.publish([_device("gpu-1")])
    assert refused.value.code == 409
    assert publisher.publish([_device("gpu-1")])  # read again, then replaced
    assert server.slices[NAME]["spec"]["pool"]["generation"] == 2
    assert [d["name"] for d in server.slices[NAME]["spec"]["devices"]] == ["gpu-1"]


def test_a_refused_write_names_the_request_and_the_reason(api):
    server, client = api
    server.refuse.add("/apis/resource.k8s.io/v1/resourceslices")
    with pytest.raises(KubeApiError) as refused:
        SlicePublisher(client, NODE).publish([_device("gpu-0")])
    assert refused.value.code == 403
    assert "resourceslices" in str(refused.value) and "forbidden" in str(refused.value)
