"""The devices of this node as NVIDIA's DRA driver publishes them in its ResourceSlice.

Owns: device names, attributes and capacities (`gpu_device`, `mig_device`, `node_devices`)
and the ResourceSlice spec that holds them (`slice_spec`), in resource.k8s.io/v1's JSON form,
so that DeviceClasses, ResourceClaimTemplates and CEL selectors written for NVIDIA's driver
(kubernetes-sigs/dra-driver-nvidia-gpu v0.4.1) select the same devices here:

- driver `gpu.nvidia.com`; one pool named after the node, one slice (cmd/gpu-kubelet-plugin
  driver.go:473-486);
- a full GPU is `gpu-<NVML minor>` (deviceinfo.go:106-108) with the attributes of
  deviceinfo.go:152-198 and a `memory` capacity in bytes (partitions.go:34-43); besides them
  `index`, `minor` and `pcieBusID`, which NVIDIA's v25.3 releases published and selectors
  written then may still use;
- a MIG device is `gpu-<parent minor>-mig-<profile, dots dropped>-<GPU instance profile ID>-
  <placement start>` (mig.go:111-114), with its parent's attributes, `type: mig`, `uuid`,
  `parentUUID` and `profile` (mig.go:118-185) and its GPU instance profile's counts as
  capacities, plus `memorySlice<i>: 1` for each memory slice it holds (deviceinfo.go:209-232);
  a GPU in MIG mode publishes its MIG devices only;
- a GPU named in agent.draSharedGpus is shareable (`gpu_device`): gpu-agent's own, as
  NVIDIA's driver has no consumable capacity;
- a MIG-enabled GPU named in agent.draDynamicMig is partitioned on demand (KEP-4815): each
  placement of each profile a device (`partition_device`, named as the MIG device it
  becomes), consuming counters of the GPU's counter set (`counter_set`), as NVIDIA's
  DynamicMIG mode publishes (partitions.go); the counters go in a slice of their own.

Versions are written as Masterminds semver writes them ("9.0" -> "9.0.0", "570.124.06" ->
"570.124.6"), quantities as Kubernetes writes a binary-SI quantity ("81559Mi").
Must not talk to NVML (agent.nvml reads what this is given) or to the API server.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable, Sequence
from fractions import Fraction
from typing import Any

DRIVER = "gpu.nvidia.com"
API_VERSION = "resource.k8s.io/v1"
# attributes in Kubernetes' own domain (k8s.io/dynamic-resource-allocation deviceattribute)
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"

# a shareable GPU's capacities (gpu_device)
MEMORY = "memory"
CORES = "cores"
MIN_SHARE_MEMORY = 1 << 30
COMPUTE_SLICES = "compute-slices"  # the counter of a partitioned GPU's compute slices

_BINARY_SUFFIXES = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


def quantity(n: int) -> str:
    """`n` as Kubernetes writes a binary-SI quantity: the largest power-of-1024 suffix that
    leaves a whole number (81559 MiB in bytes: "81559Mi"; 16: "16")."""
    for suffix, shift in _BINARY_SUFFIXES:
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m|n|u)|"
                       r"[eE]([+-]?\d+))?$")
_SCALES = {"Ki": Fraction(1 << 10), "Mi": Fraction(1 << 20), "Gi": Fraction(1 << 30),
           "Ti": Fraction(1 << 40), "Pi": Fraction(1 << 50), "Ei": Fraction(1 << 60),
           "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9),
           "T": Fraction(10**12), "P": Fraction(10**15), "E": Fraction(10**18),
           "m": Fraction(1, 10**3), "u": Fraction(1, 10**6), "n": Fraction(1, 10**9)}


def parse_quantity(text: Any) -> Fraction:
    """A Kubernetes quantity ("20Gi", "1.5G", "500m", "1e9", 7) as an exact number; ValueError
    for anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        return Fraction(text)
    match = _QUANTITY.match(text) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"{text!r} is not a quantity (a number with an optional suffix: "
                         f"Ki, Mi, Gi, Ti, k, M, G, T, m, or an exponent)")
    number, suffix, exponent = match.groups()
    value = Fraction(number)
    if suffix:
        value *= _SCALES[suffix]
    elif exponent:
        value *= Fraction(10) ** int(exponent)
    return value


def semver(text: str) -> str:
    """A dotted version as Masterminds semver v3 writes it after parsing (missing parts 0,
    leading zeros dropped): "9.0" -> "9.0.0", "570.124.06" -> "570.124.6"."""
    parts = [int(p) for p in text.split(".")[:3]]
    return ".".join(str(p) for p in parts + [0] * (3 - len(parts)))


def cuda_version(v: int) -> str:
    """nvmlSystemGetCudaDriverVersion's integer as NVIDIA's driver publishes it (nvlib.go:610:
    major.minor, then semver): 12040 -> "12.4.0"."""
    return semver(f"{v // 1000}.{v % 1000 // 10}")


def pcie_root(bus_id: str, sys_root: str = "/sys") -> str | None:
    """The PCIe root complex of the device at `bus_id` ("0000:3b:00.0") as Kubernetes'
    deviceattribute.GetPCIeRootAttributeByPCIBusID reads it: the first directory under
    /sys/devices of the device's sysfs path ("pci0000:3a"); None when sysfs does not say."""
    link = os.path.join(sys_root, "bus/pci/devices", bus_id)
    if not os.path.exists(link):
        return None
    target = os.path.realpath(link)
    devices = os.path.join(os.path.realpath(sys_root), "devices") + os.sep
    if not target.startswith(devices):
        return None
    root = target[len(devices):].split(os.sep, 1)[0]
    return root if root.startswith("pci") else None


def _rfc1123(name: str) -> str:
    """mig.go toRFC1123Compliant: lower case, anything else than [a-z0-9-.] a dash, no dash at
    either end, at most 253 characters."""
    return re.sub(r"[^a-z0-9.-]", "-", name.lower()).strip("-")[:253]


def _string(v: str) -> dict:
    return {"string": v}


def _int(v: int) -> dict:
    return {"int": v}


def _version(v: str) -> dict:
    return {"version": v}


def _capacity(values: dict[str, int]) -> dict:
    return {k: {"value": quantity(v)} for k, v in values.items()}


def gpu_attributes(gpu: Any, identity: Any, driver: Any, root: str | None) -> dict:
    """The attributes a full GPU and its MIG devices share (the parent's, for a MIG device).
    `gpu`: agent.nvml.discovery.Gpu; `identity`: agent.nvml.identity.GpuIdentity;
    `driver`: agent.nvml.driver.DriverInfo; `root`: its PCIe root or None."""
    attrs = {
        "productName": _string(gpu.name),
        "brand": _string(identity.brand),
        "architecture": _string(identity.architecture),
        "cudaComputeCapability": _version(semver("{}.{}".format(*gpu.compute_capability))),
        "driverVersion": _version(semver(driver.driver_version)),
        "cudaDriverVersion": _version(cuda_version(driver.cuda_driver_version)),
        PCI_BUS_ID: _string(gpu.short_bus_id),
    }
    if root:
        attrs[PCIE_ROOT] = _string(root)
    return attrs


def gpu_device(gpu: Any, shared: dict, shareable: bool = False) -> dict:
    """The device of a full GPU; `shared`: its gpu_attributes. A `shareable` one (KEP-5075,
    consumable capacity) allows several allocations, each consuming some of its `memory`
    (bytes, at least MIN_SHARE_MEMORY; all of it when a claim names none, so a claim that asks
    no capacity gets the GPU whole) and of its `cores` (percent of its SMs, 0 when a claim
    names none: the share's SMs then follow its memory, agent.dra.sharing); the scheduler
    keeps the sums within the values."""
    device = {
        "name": f"gpu-{gpu.minor}",
        "attributes": {
            "type": _string("gpu"), "uuid": _string(gpu.uuid), **shared,
            "index": _int(gpu.index), "minor": _int(gpu.minor),
            "pcieBusID": _string(gpu.short_bus_id),
        },
        "capacity": _capacity({"memory": gpu.memory_total}),
    }
    if shareable:
        memory = quantity(gpu.memory_total)
        device["allowMultipleAllocations"] = True
        device["capacity"] = {
            MEMORY: {"value": memory, "requestPolicy": {
                "default": memory, "validRange": {"min": quantity(MIN_SHARE_MEMORY)}}},
            CORES: {"value": "100", "requestPolicy": {
                "default": "0", "validRange": {"min": "0", "step": "1"}}},
        }
    return device


def _mig_name(parent_minor: int, profile: str, p: Any) -> str:
    return f"gpu-{parent_minor}-mig-{_rfc1123(profile.replace('.', ''))}-{p.profile_id}-{p.start}"


def _mig_capacity(p: Any) -> dict:
    return _capacity({
        "multiprocessors": p.multiprocessors, "copyEngines": p.copy_engines,
        "decoders": p.decoders, "encoders": p.encoders, "jpegEngines": p.jpegs,
        "ofaEngines": p.ofas, "memory": p.memory_mb << 20,
        **{f"memorySlice{i}": 1 for i in range(p.start, p.start + p.size)},
    })


def mig_device(mig: Any, placement: Any, parent_shared: dict) -> dict:
    """The device of a MIG device (agent.nvml.mig.MigDevice) in its GPU instance
    (agent.nvml.identity.MigPlacement); `parent_shared`: its GPU's gpu_attributes."""
    return {
        "name": _mig_name(mig.parent.minor, mig.profile, placement),
        "attributes": {
            "type": _string("mig"), "uuid": _string(mig.uuid),
            "parentUUID": _string(mig.parent.uuid), "profile": _string(mig.profile),
            **parent_shared,
        },
        "capacity": _mig_capacity(placement),
    }


def counter_set_name(gpu: Any) -> str:
    return f"gpu-{gpu.minor}-counter-set"  # NVIDIA's name (partitions.go:62-63)


def counter_set(gpu: Any, memory_slices: int, compute_slices: int) -> dict:
    """The shared counters of a GPU partitioned on demand (KEP-4815): one per memory slice
    (`memory-slice-<i>`, NVIDIA's names, partitions.go:246-247) and its compute slices."""
    return {"name": counter_set_name(gpu), "counters": {
        **{f"memory-slice-{i}": {"value": "1"} for i in range(memory_slices)},
        COMPUTE_SLICES: {"value": str(compute_slices)}}}


def partition_device(gpu: Any, profile: str, placement: Any, compute_slices: int,
                     parent_shared: dict) -> dict:
    """A MIG device GPU `gpu` can be given at prepare (agent.nvml.partitions.Partition): named,
    typed and sized as the MIG device it becomes, with no UUID yet, consuming the memory
    slices of its placement and its compute slices from the GPU's counter set, so that the
    scheduler never gives two claims overlapping placements."""
    return {
        "name": _mig_name(gpu.minor, profile, placement),
        "attributes": {
            "type": _string("mig"), "parentUUID": _string(gpu.uuid),
            "profile": _string(profile), **parent_shared,
        },
        "capacity": _mig_capacity(placement),
        "consumesCounters": [{"counterSet": counter_set_name(gpu), "counters": {
            **{f"memory-slice-{i}": {"value": "1"}
               for i in range(placement.start, placement.start + placement.size)},
            COMPUTE_SLICES: {"value": str(compute_slices)}}}],
    }


def node_devices(gpus: Sequence[Any], migs: Iterable[tuple[Any, Any]], shared: dict[str, dict],
                 shareable: Collection[str] = ()) -> list[dict]:
    """Every device of the node, by name: the GPUs not in MIG mode, and the MIG devices
    (`migs`: (MigDevice, MigPlacement) pairs) of those that are. `shared`: GPU UUID -> its
    gpu_attributes; `shareable`: the UUIDs of the GPUs shared by consumable capacity."""
    out = [gpu_device(g, shared[g.uuid], g.uuid in shareable) for g in gpus
           if not g.mig_enabled]
    out += [mig_device(m, p, shared[m.parent.uuid]) for m, p in migs]
    return sorted(out, key=lambda d: d["name"])


UNHEALTHY = f"{DRIVER}/unhealthy"  # the key of a withdrawn device's taint


def taint_value(reason: str) -> str:
    """A withdrawal's reason as a label value: "xid-79" for "XID 79 (...): ...", else its
    words, lower case, dashed, at most 63 characters."""
    match = re.match(r"XID (\d+)", reason)
    if match:
        return f"xid-{match.group(1)}"
    return re.sub(r"[^a-z0-9]+", "-", reason.lower())[:63].strip("-") or "unhealthy"


def with_taints(devices: list[dict], taints: dict[str, tuple[str, str, str]]) -> list[dict]:
    """`devices` with a taint (KEP-5055) on each one named in `taints` (device name ->
    (reason, since: RFC 3339 UTC, the time it was withdrawn, effect)): NoSchedule keeps new
    claims off it, NoExecute also evicts the pods using it; `timeAdded` stays the
    withdrawal's time on every write."""
    return [{**d, "taints": [{"key": UNHEALTHY, "value": taint_value(taints[d["name"]][0]),
                              "effect": taints[d["name"]][2],
                              "timeAdded": taints[d["name"]][1]}]}
            if d["name"] in taints else d for d in devices]


def slice_spec(node: str, devices: list[dict] | None, generation: int, count: int = 1,
               counters: list[dict] | None = None) -> dict:
    """The spec of one of this node's `count` ResourceSlices (its pool named after the node):
    its devices, or (a GPU partitioned on demand, KEP-4815) the shared counters, as 1.36+
    API servers take them: a slice holds one or the other."""
    spec = {
        "driver": DRIVER,
        "nodeName": node,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
    }
    if counters is not None:
        spec["sharedCounters"] = counters
    else:
        spec["devices"] = devices or []
    return spec
