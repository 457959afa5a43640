"""The DRA driver's kubelet plugin (agent.dra.plugin) as kubelet sees it, over real unix
sockets and gRPC: the plugin watcher finds the registration socket where NVIDIA's driver puts
it and learns the DRA socket and versions from GetInfo (kubernetes-sigs/dra-driver-nvidia-gpu
v0.4.1 vendored k8s.io/dynamic-resource-allocation kubeletplugin/draplugin.go:691,697 and
registrationserver.go:48-51); NodePrepareResources and NodeUnprepareResources in v1 and
v1beta1 answer each claim, one failing claim failing alone."""

from __future__ import annotations

import os
import stat
import time

import grpc
import pytest

from agent._proto.dra.v1 import api_pb2 as v1
from agent._proto.dra.v1 import api_pb2_grpc as v1_grpc
from agent._proto.dra.v1beta1 import api_pb2 as v1beta1
from agent._proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from agent._proto.drahealth.v1 import api_pb2 as health_v1
from agent._proto.drahealth.v1 import api_pb2_grpc as health_v1_grpc
from agent._proto.drahealth.v1alpha1 import api_pb2 as health_v1alpha1
from agent._proto.drahealth.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from agent._proto.pluginregistration.v1 import api_pb2 as reg
from agent._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from agent.dra.plugin import DraPlugin, Prepared
from agent.errors import AgentError


class Claims:
    """What the plugin hands claims to: prepares a GPU per claim, refuses the claim "bad"."""

    def __init__(self):
        self.prepared: list[str] = []
        self.unprepared: list[str] = []

    def prepare(self, claim):
        if claim.name == "bad":
            raise AgentError("claim ml/bad asks for device gpu-9, which node n1 does not have")
        if claim.name == "bug":
            raise KeyError("gpu-0")
        self.prepared.append(claim.uid)
        return [Prepared(("gpu",), "n1", "gpu-0",
                         (f"k8s.gpu.nvidia.com/claim={claim.uid}-gpu-0",))]

    def unprepare(self, claim):
        self.unprepared.append(claim.uid)


@pytest.fixture
def plugin(tmp_path):
    p = DraPlugin(Claims(), kubelet_dir=str(tmp_path))
    p.start()
    yield p
    p.stop()


def _channel(path: str) -> grpc.Channel:
    return grpc.insecure_channel(f"unix:{path}", options=[("grpc.enable_http_proxy", 0)])


def test_the_registration_socket_names_the_driver_its_socket_and_versions(plugin, tmp_path):
    assert plugin.registration_socket == str(
        tmp_path / "plugins_registry" / "gpu.nvidia.com-reg.sock")
    assert plugin.socket == str(tmp_path / "plugins" / "gpu.nvidia.com" / "dra.sock")
    for path in (plugin.socket, plugin.registration_socket):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with _channel(plugin.registration_socket) as ch:
        stub = reg_grpc.RegistrationStub(ch)
        info = stub.GetInfo(reg.InfoRequest(), timeout=10)
        assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
            "DRAPlugin", "gpu.nvidia.com", plugin.socket,
            # the health service: kubelet 1.37 picks the first it knows (dra_plugin.go:59-62,
            # dra_plugin_manager.go pickHealthService); 1.34 ignores what it does not know
            ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth",
             "v1alpha1.DRAResourceHealth"])
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True),
                                      timeout=10)
        assert plugin.registered is True
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(
            plugin_registered=False, error="version not supported"), timeout=10)
        assert (plugin.registered, plugin.registration_error) == (False,
                                                                  "version not supported")


@pytest.mark.parametrize("api, api_grpc", [(v1, v1_grpc), (v1beta1, v1beta1_grpc)],
                         ids=["v1", "v1beta1"])
def test_prepare_answers_each_claim_and_a_failing_claim_fails_alone(plugin, api, api_grpc):
    claims = [api.Claim(namespace="ml", uid=uid, name=name)
              for uid, name in (("u-1", "train"), ("u-2", "bad"), ("u-3", "bug"))]
    with _channel(plugin.socket) as ch:
        stub = api_grpc.DRAPluginStub(ch)
        out = stub.NodePrepareResources(api.NodePrepareResourcesRequest(claims=claims),
                                        timeout=10)
        assert set(out.claims) == {"u-1", "u-2", "u-3"}
        good = out.claims["u-1"]
        assert good.error == ""
        assert [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
                for d in good.devices] == [
            (["gpu"], "n1", "gpu-0", ["k8s.gpu.nvidia.com/claim=u-1-gpu-0"])]
        assert out.claims["u-2"].error == \
            "claim ml/bad asks for device gpu-9, which node n1 does not have"
        assert not out.claims["u-2"].devices
        assert out.claims["u-3"].error.startswith("internal error: ")
        done = stub.NodeUnprepareResources(
            api.NodeUnprepareResourcesRequest(claims=claims[:1]), timeout=10)
        assert dict(done.claims) == {"u-1": api.NodeUnprepareResourceResponse()}
    assert plugin.claims.prepared == ["u-1"] and plugin.claims.unprepared == ["u-1"]


def test_stop_removes_both_sockets_and_a_stale_one_is_replaced(tmp_path):
    first = DraPlugin(Claims(), kubelet_dir=str(tmp_path))
    first.start()
    os.link(first.socket, str(tmp_path / "kept"))  # as if the agent had been killed
    first.stop()
    assert not os.path.lexists(first.socket)
    assert not os.path.lexists(first.registration_socket)
    os.rename(str(tmp_path / "kept"), first.socket)  # the killed agent's socket is there
    again = DraPlugin(Claims(), kubelet_dir=str(tmp_path))
    again.start()
    try:
        with _channel(again.registration_socket) as ch:
            info = reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest(), timeout=10)
            assert info.endpoint == again.socket
    finally:
        again.stop()


@pytest.mark.parametrize("api, api_grpc", [(health_v1, health_v1_grpc),
                                           (health_v1alpha1, health_v1alpha1_grpc)],
                         ids=["v1", "v1alpha1"])
def test_kubelet_watching_health_gets_every_device_then_each_change(plugin, api, api_grpc):
    """NodeWatchResources as kubelet reads it (pkg/kubelet/cm/dra/manager.go
    HandleWatchResourcesStream): the whole list first, then again when a device's health
    changes; a stream kubelet cancels ends, and the plugin's stop ends the others."""
    plugin.health.set({("n1", "gpu-0"): "", ("n1", "gpu-1"): ""})
    with _channel(plugin.socket) as ch:
        stream = api_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
            api.NodeWatchResourcesRequest(), timeout=30)
        first = next(stream)
        assert [(d.device.pool_name, d.device.device_name, d.health, d.message)
                for d in first.devices] == [("n1", "gpu-0", api.HEALTHY, ""),
                                             ("n1", "gpu-1", api.HEALTHY, "")]
        assert all(d.health_check_timeout_seconds > 60 and d.last_updated_time > 0
                   for d in first.devices)
        plugin.health.set({("n1", "gpu-0"): "", ("n1", "gpu-1"): "XID 79 (fell off the bus)"})
        changed = next(stream)
        assert [(d.device.device_name, d.health, d.message) for d in changed.devices] == [
            ("gpu-0", api.HEALTHY, ""), ("gpu-1", api.UNHEALTHY, "XID 79 (fell off the bus)")]
        stream.cancel()
        with pytest.raises(grpc.RpcError) as err:
            next(stream)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        deadline = time.monotonic() + 30  # the server's side of the stream ends too
        while plugin.health.streams and time.monotonic() < deadline:
            time.sleep(0.01)
        assert plugin.health.streams == 0
        second = api_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
            api.NodeWatchResourcesRequest(), timeout=30)
        assert len(next(second).devices) == 2
        plugin.stop()  # the open stream ends, it does not hold the stop
        with pytest.raises((grpc.RpcError, StopIteration)):
            next(second)
