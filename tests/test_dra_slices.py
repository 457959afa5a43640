"""The ResourceSlice devices, read from the simulated NVML, as NVIDIA's DRA driver publishes
them: kubernetes-sigs/dra-driver-nvidia-gpu at tag v0.4.1 (764900e7833798a1528bd52a2af3e1b2d5f7a616),
cmd/gpu-kubelet-plugin, whose lines each test cites."""

from __future__ import annotations

import os

import pytest

from agent.dra import slices
from agent.nvml import discovery, driver, identity, mig

H100 = "GPU-64008294-1441-5920-b3ef-7b6b54153f7d"  # dgx-h100 GPU 0 (minor 0, bus 10:00.0)


def _devices(profile_gpus):
    info = driver.driver_info()
    shared = {g.uuid: slices.gpu_attributes(g, identity.gpu_identity(g), info, None)
              for g in profile_gpus}
    migs = [(m, identity.mig_placement(m)) for m in mig.read_mig_devices(profile_gpus)]
    return slices.node_devices(profile_gpus, migs, shared)


def test_a_full_gpu_is_named_by_its_minor_with_nvidias_attributes_and_memory(node):
    """deviceinfo.go:106-108 (gpu-<minor>), :152-198 (the attributes), partitions.go:34-43
    (memory in bytes, binary SI); nvlib.go:490-533 (where each value comes from)."""
    node("dgx-h100")
    devices = {d["name"]: d for d in _devices(discovery.discover())}
    assert sorted(devices) == [f"gpu-{i}" for i in range(8)]
    assert devices["gpu-0"] == {
        "name": "gpu-0",
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": H100},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Hopper"},
            "cudaComputeCapability": {"version": "9.0.0"},
            "driverVersion": {"version": "550.54.15"},
            "cudaDriverVersion": {"version": "12.4.0"},
            "resource.kubernetes.io/pciBusID": {"string": "0000:10:00.0"},
            # NVIDIA's v25.3.2 (deviceinfo.go:91-137) published these; selectors may use them
            "index": {"int": 0}, "minor": {"int": 0}, "pcieBusID": {"string": "0000:10:00.0"},
        },
        "capacity": {"memory": {"value": "81559Mi"}},
    }


def test_a_mig_gpu_publishes_its_mig_devices_named_by_profile_id_and_placement(node):
    """mig.go:111-114 (the name), :118-185 (the parent's attributes with type, uuid,
    parentUUID, profile), deviceinfo.go:209-232 (the GPU instance profile's counts and a
    memorySlice<i> per slice); nvlib.go:302-319 (a GPU in MIG mode: its MIG devices only)."""
    node("a100-mig")
    gpus = discovery.discover()
    devices = {d["name"]: d for d in _devices(gpus)}
    parent = next(g for g in gpus if g.index == 0)
    assert f"gpu-{parent.minor}" not in devices
    ours = sorted(n for n in devices if n.startswith("gpu-0-mig-"))
    assert ours == [f"gpu-0-mig-1g10gb-19-{start}" for start in range(7)]
    d = devices["gpu-0-mig-1g10gb-19-3"]
    assert d["attributes"]["type"] == {"string": "mig"}
    assert d["attributes"]["profile"] == {"string": "1g.10gb"}
    assert d["attributes"]["parentUUID"] == {"string": parent.uuid}
    assert d["attributes"]["uuid"]["string"].startswith("MIG-")
    assert d["attributes"]["architecture"] == {"string": "Ampere"}
    assert d["attributes"]["cudaComputeCapability"] == {"version": "8.0.0"}
    assert d["attributes"]["resource.kubernetes.io/pciBusID"] == {
        "string": parent.short_bus_id}
    assert "index" not in d["attributes"] and "minor" not in d["attributes"]
    assert d["capacity"] == {
        "multiprocessors": {"value": "14"}, "copyEngines": {"value": "1"},
        "decoders": {"value": "0"}, "encoders": {"value": "0"}, "jpegEngines": {"value": "0"},
        "ofaEngines": {"value": "0"}, "memory": {"value": "9728Mi"},
        "memorySlice3": {"value": "1"},
    }


def test_the_slice_is_one_pool_named_after_the_node():
    """driver.go:473-486: one pool, the node's name, one slice."""
    spec = slices.slice_spec("node-1", [], 3)
    assert spec == {"driver": "gpu.nvidia.com", "nodeName": "node-1",
                    "pool": {"name": "node-1", "generation": 3, "resourceSliceCount": 1},
                    "devices": []}


@pytest.mark.parametrize("text, written", [
    ("9.0", "9.0.0"), ("570.124.06", "570.124.6"), ("550.54.15", "550.54.15"), ("535", "535.0.0"),
])
def test_versions_are_written_as_masterminds_semver_writes_them(text, written):
    """deviceinfo.go:160-162 semver.MustParse(..).String() (vendored semver v3.5.0, which
    coerces: missing parts 0, leading zeros dropped)."""
    assert slices.semver(text) == written


def test_the_cuda_driver_version_is_major_minor_then_semver():
    """nvlib.go:610 fmt.Sprintf("%v.%v", v/1000, (v%1000)/10)."""
    assert [slices.cuda_version(v) for v in (12040, 12080, 11020)] == [
        "12.4.0", "12.8.0", "11.2.0"]


@pytest.mark.parametrize("n, written", [
    (85520809984, "81559Mi"), (1 << 30, "1Gi"), (16, "16"), (1, "1"), (0, "0"), (1536, "1536"),
])
def test_quantities_are_written_as_kubernetes_writes_binary_si(n, written):
    assert slices.quantity(n) == written


def test_the_pcie_root_is_the_first_directory_under_sys_devices(tmp_path):
    """k8s.io/dynamic-resource-allocation deviceattribute pci_linux.go:36-58: the root of the
    device's sysfs path; none when sysfs does not have the device."""
    real = tmp_path / "devices" / "pci0000:3a" / "0000:3a:00.0" / "0000:3b:00.0"
    real.mkdir(parents=True)
    links = tmp_path / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    os.symlink(real, links / "0000:3b:00.0")
    assert slices.pcie_root("0000:3b:00.0", str(tmp_path)) == "pci0000:3a"
    assert slices.pcie_root("0000:99:00.0", str(tmp_path)) is None


@pytest.mark.parametrize("reason, value", [
    ("XID 79 (GPU has fallen off the bus): reboot the node", "xid-79"),
    ("GPU is lost (NVML_ERROR_GPU_IS_LOST)", "gpu-is-lost-nvml-error-gpu-is-lost"),
    ("", "unhealthy"),
])
def test_a_withdrawals_reason_becomes_a_label_value(reason, value):
    assert slices.taint_value(reason) == value


def test_only_the_withdrawn_devices_are_tainted_and_the_rest_are_left_as_they_were():
    devices = [{"name": "gpu-0"}, {"name": "gpu-1"}]
    tainted = slices.with_taints(devices, {"gpu-1": ("XID 48 (DBE)", "2026-11-29T02:00:00Z",
                                                     "NoSchedule")})
    assert tainted[0] is devices[0]
    assert tainted[1]["taints"] == [{"key": "gpu.nvidia.com/unhealthy", "value": "xid-48",
                                     "effect": "NoSchedule",
                                     "timeAdded": "2026-11-29T02:00:00Z"}]
