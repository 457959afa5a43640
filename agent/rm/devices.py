"""The device model: what the agent advertises to kubelet, and how each device maps to GPUs.

Owns: `Device` (one advertised device), the device map of a MIG strategy (which GPUs and MIG
devices are advertised, under which resource names, and which layouts a strategy refuses), and
naming resources (`resources.gpus` / `resources.mig` patterns, as NVIDIA's plugin reads them).
Shared replicas are these records under another ID (agent.rm.sharing). Must not call NVML (it gets
`agent.nvml.discovery.Gpu` and `agent.nvml.mig.MigDevice` records) nor import grpc.

The MIG rules are NVIDIA's, from k8s-device-plugin internal/rm/device_map.go
(buildDeviceMapFromConfigResources, buildGPUDeviceMap, buildMigDeviceMap,
assertAllMigDevicesAreValid) and internal/rm/rm.go AddDefaultResourcesToConfig; each rule
below names its function, and the messages are NVIDIA's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from agent.errors import MigLayoutError
from agent.nvml.discovery import Gpu
from agent.nvml.mig import MigDevice

log = logging.getLogger(__name__)

RESOURCE_GPU = "nvidia.com/gpu"


class Device(NamedTuple):
    """One device advertised to kubelet under a resource name."""

    id: str  # the ID kubelet sees: the GPU UUID for a full GPU
    index: str  # the ID under DEVICE_ID_STRATEGY=index: "3" for GPU 3
    gpu_uuid: str  # the physical GPU behind it
    gpu_index: int
    numa_node: int | None
    paths: tuple[str, ...]  # device nodes the container needs, e.g. ("/dev/nvidia3",)
    name: str = ""  # product name, for status and logs
    # MIG instance placement (GPU / compute instance ids) for health events; None: a full GPU.
    gi: int | None = None
    ci: int | None = None
    # A shared replica (agent.rm.sharing): the ID of the GPU or MIG device it shares, which
    # is what a container is given, and how many replicas that device has; "" and 0 for a
    # device advertised whole.
    replica_of: str = ""
    replicas: int = 0
    memory: int = 0  # bytes of the GPU or MIG device (MPS memory limits)

    def describe(self) -> str:
        """The device for a log line: its ID, and the GPU (UUID and index) behind it."""
        if self.replica_of:
            shared = f"GPU {self.index}" if self.gi is None else \
                f"MIG {self.index} on GPU {self.gpu_index}"
            return f"{self.id} (replica of {shared} {self.gpu_uuid})"
        if self.gi is None:
            return f"{self.gpu_uuid} (GPU {self.gpu_index})"
        return f"{self.id} (MIG {self.index} on GPU {self.gpu_index} {self.gpu_uuid})"


def full_gpu_devices(gpus: Iterable[Gpu]) -> list[Device]:
    """One full-GPU device per GPU, in index order, MIG-enabled or not (the caller leaves out
    what a strategy does not advertise whole)."""
    return [
        Device(
            id=gpu.uuid,
            index=str(gpu.index),
            gpu_uuid=gpu.uuid,
            gpu_index=gpu.index,
            numa_node=gpu.numa_node,
            paths=(f"/dev/nvidia{gpu.minor}",),
            name=gpu.name,
            memory=gpu.memory_total,
        )
        for gpu in sorted(gpus, key=lambda g: g.index)
    ]


def _pattern_regex(pattern: str) -> re.Pattern:
    """NVIDIA's wildcard match: `*` is any run of characters, everything else literal, and
    the pattern must match the whole product name (case-sensitive)."""
    return re.compile("^" + ".*".join(re.escape(part) for part in pattern.split("*")) + "$")


def resource_name_for(product: str, patterns: Sequence[Any]) -> str:
    """The resource a GPU named `product` is advertised under: the `name` of the first
    `resources.gpus` pattern (objects with `.pattern` and `.name`) that matches, else
    nvidia.com/gpu."""
    for p in patterns:
        if _pattern_regex(p.pattern).match(product):
            return p.name
    return RESOURCE_GPU


def mig_device(m: MigDevice) -> Device:
    """The advertised device of a MIG device: its UUID, NVIDIA's `i:j` index, its device nodes
    (the parent's and the GPU and compute instance capabilities', internal/rm/nvml_devices.go
    GetPaths) and its GPU / compute instance for health events."""
    return Device(id=m.uuid, index=m.index_id, gpu_uuid=m.parent.uuid, gpu_index=m.parent.index,
                  numa_node=m.parent.numa_node, paths=(f"/dev/nvidia{m.parent.minor}", *m.caps),
                  name=f"{m.parent.name} MIG {m.profile}", gi=m.gi, ci=m.ci,
                  memory=m.memory_mb << 20)


def default_mig_resource(strategy: str, profile: str) -> str | None:
    """The resource a MIG device of `profile` gets when no `resources.mig` pattern names it
    (rm.go AddDefaultResourcesToConfig): under single every profile is nvidia.com/gpu; under
    mixed a profile whose compute instance is its whole GPU instance is
    nvidia.com/mig-<profile> with `+` written `.` (1g.10gb+me -> mig-1g.10gb.me), and a smaller
    compute instance (1c.3g.20gb) has none."""
    if strategy == "single":
        return RESOURCE_GPU
    if strategy == "mixed" and not re.match(r"^\d+c\.", profile):
        return "nvidia.com/mig-" + profile.replace("+", ".")
    return None


def _invalid(problem: str) -> MigLayoutError:
    return MigLayoutError(f"error building device map from config.resources: invalid MIG "
                          f"configuration: {problem} (see docs/mig.md)")


def _check_mig_layout(strategy: str, gpus: Sequence[Gpu], migs: Sequence[MigDevice]) -> None:
    """assertAllMigDevicesAreValid: a MIG-enabled GPU without MIG devices is refused under
    single (a warning under mixed), and single takes one kind of MIG device on the node."""
    with_migs = {m.parent.index for m in migs}
    for gpu in sorted(gpus, key=lambda g: g.index):
        if gpu.mig_enabled and gpu.index not in with_migs:
            if strategy == "single":
                raise _invalid(f"at least one device with migEnabled=true was not configured "
                               f"correctly: device {gpu.index} has no MIG devices configured")
            log.warning("device %d has no MIG devices configured (GPU %s): it advertises "
                        "nothing under migStrategy mixed", gpu.index, gpu.uuid)
    if strategy == "single" and len({m.kind for m in migs}) > 1:
        raise _invalid("more than one MIG device type present on node")


def devices_by_resource(gpus: Iterable[Gpu], patterns: Sequence[Any] = (), *,
                        strategy: str = "none", migs: Sequence[MigDevice] = (),
                        mig_patterns: Sequence[Any] = ()) -> dict[str, list[Device]]:
    """The devices of each resource (sorted by name; full GPUs in index order, then MIG
    devices by GPU and handle index) under MIG `strategy`; `migs` are the node's MIG devices
    (read only when the strategy is not none). MigLayoutError, with NVIDIA's words, for a
    layout the strategy refuses. A resource appears only when a device maps to it."""
    gpus = list(gpus)
    out: dict[str, list[Device]] = {}
    for device, gpu in zip(full_gpu_devices(gpus), sorted(gpus, key=lambda g: g.index)):
        if gpu.mig_enabled and strategy != "none":  # buildGPUDeviceMap
            continue
        out.setdefault(resource_name_for(device.name, patterns), []).append(device)
    if strategy == "none":
        return dict(sorted(out.items()))
    mig_map: dict[str, list[Device]] = {}
    for m in migs:  # buildMigDeviceMap: the configured patterns first, then the defaults
        name = next((p.name for p in mig_patterns if _pattern_regex(p.pattern).match(m.profile)),
                    None) or default_mig_resource(strategy, m.profile)
        if name is None:
            raise MigLayoutError(f"error building device map from config.resources: error "
                                 f"building MIG device map: MIG profile '{m.profile}' does not "
                                 f"match any resource patterns (MIG device {m.uuid} on GPU "
                                 f"{m.parent.index}; see docs/mig.md)")
        mig_map.setdefault(name, []).append(mig_device(m))
    _check_mig_layout(strategy, gpus, migs)
    if strategy == "single" and out and mig_map:  # buildDeviceMapFromConfigResources
        raise _invalid_single_mix()
    for name, devices in mig_map.items():
        out.setdefault(name, []).extend(devices)
    return dict(sorted(out.items()))


def _invalid_single_mix() -> MigLayoutError:
    return MigLayoutError("error building device map from config.resources: all devices on the "
                          "node must be configured with the same migEnabled value (see "
                          "docs/mig.md)")
