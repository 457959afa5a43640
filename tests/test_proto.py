"""The gRPC APIs: committed generated code is fresh, and it says what kubelet says.

Checks that agent/_proto matches a fresh `scripts/gen_proto.py` run with the pinned generator,
that the kubelet APIs and our control API load together into one descriptor pool, and that
method paths, streaming kinds, field numbers and wire bytes are kubelet's.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version as dist_version
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent._proto.deviceplugin.v1beta1 import constants as dp_constants
from agent._proto.dra.v1 import api_pb2 as dra
from agent._proto.dra.v1 import api_pb2_grpc as dra_grpc
from agent._proto.dra.v1 import constants as dra_constants
from agent._proto.dra.v1beta1 import api_pb2 as dra_beta
from agent._proto.dra.v1beta1 import api_pb2_grpc as dra_beta_grpc
from agent._proto.dra.v1beta1 import constants as dra_beta_constants
from agent._proto.pluginregistration.v1 import api_pb2 as reg
from agent._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from agent._proto.pluginregistration.v1 import constants as reg_constants
from agent._proto.podresources.v1 import api_pb2 as pr
from agent._proto.podresources.v1 import api_pb2_grpc as pr_grpc
from agent._proto.simkubelet.v1 import control_pb2 as ctl
from agent._proto.simkubelet.v1 import control_pb2_grpc as ctl_grpc

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "agent" / "_proto"
API_MODULES = [dp, pr, ctl, reg, dra, dra_beta]


def _pinned_generator() -> str:
    text = (ROOT / "requirements-dev.txt").read_text()
    match = re.search(r"^grpcio-tools==(\S+)", text, re.MULTILINE)
    assert match, "requirements-dev.txt must pin grpcio-tools (the staleness check needs one generator)"
    return match.group(1)


def _tree(root: Path) -> dict[str, bytes]:
    """Generated files under root (the top-level hand-written __init__.py excluded)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        and p.relative_to(root).as_posix() != "__init__.py"
    }


def test_installed_generator_is_the_pinned_one():
    pinned = _pinned_generator()
    installed = dist_version("grpcio-tools")
    assert installed == pinned, (
        f"grpcio-tools {installed} is installed but {pinned} is pinned in requirements-dev.txt; "
        "reinstall (make venv) before judging whether agent/_proto is stale"
    )
    committed = (GENERATED / "deviceplugin" / "v1beta1" / "api_pb2_grpc.py").read_text()
    assert f"GRPC_GENERATED_VERSION = '{pinned}'" in committed


def test_committed_code_matches_a_fresh_generation(tmp_path: Path):
    out = tmp_path / "proto_out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"gen_proto.py failed:\n{proc.stdout}\n{proc.stderr}"
    fresh, committed = _tree(out), _tree(GENERATED)
    missing = sorted(set(fresh) - set(committed))
    extra = sorted(set(committed) - set(fresh))
    changed = sorted(k for k in set(fresh) & set(committed) if fresh[k] != committed[k])
    assert not (missing or extra or changed), (
        "agent/_proto is stale; run `make proto` and commit the result.\n"
        f"  not committed: {missing}\n  no longer generated: {extra}\n  differ: {changed}"
    )


def test_gen_proto_leaves_the_package_docstring_alone():
    text = (GENERATED / "__init__.py").read_text()
    assert text.startswith('"""Code generated from proto/ by `make proto`')


def test_all_apis_load_into_one_fresh_pool():
    pool = descriptor_pool.DescriptorPool()
    for module in API_MODULES:  # dependencies first: control.proto imports the device-plugin API
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        pool.Add(proto)
    names = {
        pool.FindMessageTypeByName(n).file.name
        for n in ("v1beta1.TopologyInfo", "v1.TopologyInfo", "v1beta1.CDIDevice", "v1.CDIDevice")
    }
    assert names == {
        "agent/_proto/deviceplugin/v1beta1/api.proto",
        "agent/_proto/podresources/v1/api.proto",
    }


def test_all_apis_import_together_in_a_fresh_interpreter():
    code = (
        "import agent._proto.deviceplugin.v1beta1.api_pb2_grpc, "
        "agent._proto.podresources.v1.api_pb2_grpc, agent._proto.simkubelet.v1.control_pb2_grpc, "
        "agent._proto.pluginregistration.v1.api_pb2_grpc, agent._proto.dra.v1.api_pb2_grpc, "
        "agent._proto.dra.v1beta1.api_pb2_grpc"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


class _RecordingChannel:
    """Stands in for a grpc.Channel: records the method path and kind each stub method uses."""

    def __init__(self):
        self.methods: dict[str, str] = {}

    def _record(self, kind):
        def make(path, *args, **kwargs):
            self.methods[path] = kind
            return lambda *a, **k: None
        return make

    def __getattr__(self, kind):
        if kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            return self._record(kind)
        raise AttributeError(kind)


# Each service: its stub, its full name, and every method as (name, kind, request, response),
# the message types in the service's package. Kubelet's services list all their methods.
_KUBELET_SERVICES = [
    (dp_grpc.RegistrationStub, "v1beta1.Registration", [
        ("Register", "unary_unary", "RegisterRequest", "Empty"),
    ]),
    (dp_grpc.DevicePluginStub, "v1beta1.DevicePlugin", [
        ("GetDevicePluginOptions", "unary_unary", "Empty", "DevicePluginOptions"),
        ("ListAndWatch", "unary_stream", "Empty", "ListAndWatchResponse"),
        ("GetPreferredAllocation", "unary_unary", "PreferredAllocationRequest",
         "PreferredAllocationResponse"),
        ("Allocate", "unary_unary", "AllocateRequest", "AllocateResponse"),
        ("PreStartContainer", "unary_unary", "PreStartContainerRequest",
         "PreStartContainerResponse"),
    ]),
    (pr_grpc.PodResourcesListerStub, "v1.PodResourcesLister", [
        ("List", "unary_unary", "ListPodResourcesRequest", "ListPodResourcesResponse"),
        ("GetAllocatableResources", "unary_unary", "AllocatableResourcesRequest",
         "AllocatableResourcesResponse"),
        ("Get", "unary_unary", "GetPodResourcesRequest", "GetPodResourcesResponse"),
    ]),
    # k8s.io/kubelet@v0.37.2 pkg/apis/pluginregistration/v1/api.proto: package
    # "pluginregistration" (not ".v1"), which names the service on the wire
    (reg_grpc.RegistrationStub, "pluginregistration.Registration", [
        ("GetInfo", "unary_unary", "InfoRequest", "PluginInfo"),
        ("NotifyRegistrationStatus", "unary_unary", "RegistrationStatus",
         "RegistrationStatusResponse"),
    ]),
    # k8s.io/kubelet@v0.37.2 pkg/apis/dra/v1/api.proto and dra/v1beta1/api.proto
    *[(stub, f"k8s.io.kubelet.pkg.apis.dra.{v}.DRAPlugin", [
        ("NodePrepareResources", "unary_unary", "NodePrepareResourcesRequest",
         "NodePrepareResourcesResponse"),
        ("NodeUnprepareResources", "unary_unary", "NodeUnprepareResourcesRequest",
         "NodeUnprepareResourcesResponse"),
    ]) for stub, v in ((dra_grpc.DRAPluginStub, "v1"), (dra_beta_grpc.DRAPluginStub, "v1beta1"))],
]
_SERVICES = _KUBELET_SERVICES + [
    (ctl_grpc.SimKubeletControlStub, "simkubelet.v1.SimKubeletControl", [
        ("Watch", "unary_stream", "WatchRequest", "Event"),
    ]),
]
_METHODS = [
    (stub, f"/{service}/{name}", kind, f"{service.rpartition('.')[0]}.{request}",
     f"{service.rpartition('.')[0]}.{response}")
    for stub, service, methods in _SERVICES
    for name, kind, request, response in methods
]


@pytest.mark.parametrize("stub, path, kind, request_type, response_type", _METHODS,
                         ids=[path.strip("/").split(".")[-1] for _, path, *_ in _METHODS])
def test_method_path_kind_and_types(stub, path, kind, request_type, response_type):
    channel = _RecordingChannel()
    stub(channel)
    assert channel.methods.get(path) == kind, f"stub methods: {channel.methods}"

    service_name, method_name = path.strip("/").split("/")
    service = descriptor_pool.Default().FindServiceByName(service_name)
    method = service.methods_by_name[method_name]
    assert method.input_type.full_name == request_type
    assert method.output_type.full_name == response_type
    assert method.server_streaming == (kind == "unary_stream")
    assert not method.client_streaming


@pytest.mark.parametrize("service, methods", [(s, m) for _, s, m in _KUBELET_SERVICES],
                         ids=[s for _, s, _ in _KUBELET_SERVICES])
def test_services_have_exactly_kubelets_methods(service, methods):
    pool = descriptor_pool.Default()
    assert sorted(pool.FindServiceByName(service).methods_by_name) == sorted(m[0] for m in methods)


_T = descriptor_pb2.FieldDescriptorProto


_FIELDS = [
    ("v1beta1.DevicePluginOptions", "get_preferred_allocation_available", 2, _T.TYPE_BOOL, False),
    ("v1beta1.RegisterRequest", "resource_name", 3, _T.TYPE_STRING, False),
    ("v1beta1.RegisterRequest", "options", 4, _T.TYPE_MESSAGE, False),
    ("v1beta1.Device", "ID", 1, _T.TYPE_STRING, False),
    ("v1beta1.Device", "topology", 3, _T.TYPE_MESSAGE, False),
    ("v1beta1.NUMANode", "ID", 1, _T.TYPE_INT64, False),
    ("v1beta1.ContainerPreferredAllocationRequest", "must_include_deviceIDs", 2, _T.TYPE_STRING, True),
    ("v1beta1.ContainerPreferredAllocationRequest", "allocation_size", 3, _T.TYPE_INT32, False),
    ("v1beta1.ContainerPreferredAllocationResponse", "deviceIDs", 1, _T.TYPE_STRING, True),
    ("v1beta1.ContainerAllocateRequest", "devices_ids", 1, _T.TYPE_STRING, True),
    ("v1beta1.ContainerAllocateResponse", "annotations", 4, _T.TYPE_MESSAGE, True),
    ("v1beta1.ContainerAllocateResponse", "cdi_devices", 5, _T.TYPE_MESSAGE, True),
    ("v1beta1.Mount", "read_only", 3, _T.TYPE_BOOL, False),
    ("v1beta1.DeviceSpec", "permissions", 3, _T.TYPE_STRING, False),
    ("v1.AllocatableResourcesResponse", "cpu_ids", 2, _T.TYPE_INT64, True),
    ("v1.ContainerResources", "dynamic_resources", 5, _T.TYPE_MESSAGE, True),
    ("v1.ContainerMemory", "size", 2, _T.TYPE_UINT64, False),
    ("v1.ContainerDevices", "device_ids", 2, _T.TYPE_STRING, True),
    ("v1.DynamicResource", "claim_name", 2, _T.TYPE_STRING, False),
    ("v1.ClaimResource", "device_name", 4, _T.TYPE_STRING, False),
    ("v1.GetPodResourcesRequest", "pod_name", 1, _T.TYPE_STRING, False),
    ("v1.GetPodResourcesRequest", "pod_namespace", 2, _T.TYPE_STRING, False),
    ("v1.GetPodResourcesResponse", "pod_resources", 1, _T.TYPE_MESSAGE, False),
    ("pluginregistration.PluginInfo", "type", 1, _T.TYPE_STRING, False),
    ("pluginregistration.PluginInfo", "endpoint", 3, _T.TYPE_STRING, False),
    ("pluginregistration.PluginInfo", "supported_versions", 4, _T.TYPE_STRING, True),
    ("pluginregistration.RegistrationStatus", "plugin_registered", 1, _T.TYPE_BOOL, False),
    ("pluginregistration.RegistrationStatus", "error", 2, _T.TYPE_STRING, False),
    *[(f"k8s.io.kubelet.pkg.apis.dra.{v}.{m}", f, n, t, r) for v in ("v1", "v1beta1")
      for m, f, n, t, r in (
          ("NodePrepareResourcesRequest", "claims", 1, _T.TYPE_MESSAGE, True),
          ("NodePrepareResourcesResponse", "claims", 1, _T.TYPE_MESSAGE, True),  # a map
          ("NodePrepareResourceResponse", "devices", 1, _T.TYPE_MESSAGE, True),
          ("NodePrepareResourceResponse", "error", 2, _T.TYPE_STRING, False),
          ("Device", "request_names", 1, _T.TYPE_STRING, True),
          ("Device", "pool_name", 2, _T.TYPE_STRING, False),
          ("Device", "device_name", 3, _T.TYPE_STRING, False),
          ("Device", "cdi_device_ids", 4, _T.TYPE_STRING, True),
          ("NodeUnprepareResourceResponse", "error", 1, _T.TYPE_STRING, False),
          ("Claim", "namespace", 1, _T.TYPE_STRING, False),
          ("Claim", "uid", 2, _T.TYPE_STRING, False),
          ("Claim", "name", 3, _T.TYPE_STRING, False),
      )],
    # consumable capacity (Kubernetes 1.36+): v1 only
    ("k8s.io.kubelet.pkg.apis.dra.v1.Device", "share_id", 5, _T.TYPE_STRING, False),
]


@pytest.mark.parametrize("message, field, number, type_, repeated", _FIELDS,
                         ids=[f"{m}.{f}" for m, f, *_ in _FIELDS])
def test_field_number_and_type(message, field, number, type_, repeated):
    proto = descriptor_pb2.DescriptorProto()
    descriptor_pool.Default().FindMessageTypeByName(message).CopyToProto(proto)
    f = next(f for f in proto.field if f.name == field)
    assert (f.number, f.type, f.label == _T.LABEL_REPEATED) == (number, type_, repeated)


def test_dynamic_resource_keeps_field_one_reserved():
    proto = descriptor_pb2.DescriptorProto()
    pr.DynamicResource.DESCRIPTOR.CopyToProto(proto)
    assert [(r.start, r.end) for r in proto.reserved_range] == [(1, 2)]


def test_register_request_wire_bytes_are_kubelets():
    """Bytes a Go plugin would send: fields 1..3 as length-delimited strings, 4 a message."""
    msg = dp.RegisterRequest(
        version="v1beta1", endpoint="g.sock", resource_name="a.b/c",
        options=dp.DevicePluginOptions(get_preferred_allocation_available=True),
    )
    expected = (b"\x0a\x07v1beta1" b"\x12\x06g.sock" b"\x1a\x05a.b/c" b"\x22\x02\x10\x01")
    assert msg.SerializeToString() == expected
    assert dp.RegisterRequest.FromString(expected) == msg


def test_device_plugin_constants():
    assert (dp_constants.VERSION, dp_constants.HEALTHY, dp_constants.UNHEALTHY) == (
        "v1beta1", "Healthy", "Unhealthy")
    assert dp_constants.KUBELET_SOCKET_PATH == "/var/lib/kubelet/device-plugins/kubelet.sock"


def test_dra_share_id_is_optional_in_v1_and_absent_in_v1beta1():
    assert dra.Device.DESCRIPTOR.fields_by_name["share_id"].has_presence
    assert "share_id" not in dra_beta.Device.DESCRIPTOR.fields_by_name


def test_plugin_registration_and_dra_constants():
    """k8s.io/kubelet@v0.37.2 pluginregistration/v1/constants.go, dra/v1/types.go,
    dra/v1beta1/types.go: the names kubelet's plugin watcher and DRA manager compare."""
    assert reg_constants.DRA_PLUGIN == "DRAPlugin"
    assert (dra_constants.DRA_PLUGIN_SERVICE, dra_beta_constants.DRA_PLUGIN_SERVICE) == (
        "v1.DRAPlugin", "v1beta1.DRAPlugin")


def test_dra_prepare_response_wire_bytes_are_kubelets():
    """A map entry (key 1, value 2) of a response with one device, as Go's encoder writes it."""
    msg = dra.NodePrepareResourcesResponse(claims={"u": dra.NodePrepareResourceResponse(
        devices=[dra.Device(pool_name="n", device_name="gpu-0", cdi_device_ids=["a/b=c"])])})
    device = b"\x12\x01n" b"\x1a\x05gpu-0" b"\x22\x05a/b=c"
    entry = b"\x0a\x01u" + b"\x12" + bytes([len(device) + 2]) + b"\x0a" + bytes([len(device)]) + device
    assert msg.SerializeToString() == b"\x0a" + bytes([len(entry)]) + entry
