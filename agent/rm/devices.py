"""The device model: what the agent advertises to kubelet, and how each device maps to GPUs.

Owns: `Device` (one advertised device), building the full-GPU device list from discovered
GPUs, and naming the resource each one is advertised under (`resources.gpus` patterns, as
NVIDIA's plugin reads them). Later: MIG devices and shared replicas map onto the same record.
Must not call NVML (it gets `agent.nvml.discovery.Gpu` records) nor import grpc.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from agent.nvml.discovery import Gpu

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


def full_gpu_devices(gpus: Iterable[Gpu]) -> list[Device]:
    """One full-GPU device per GPU, in index order. With migStrategy none (the only one
    `gpu-agent run` takes so far) a MIG-enabled GPU is a full GPU too, as NVIDIA's
    plugin advertises it (internal/rm/device_map.go, buildGPUDeviceMap, skips MIG-enabled GPUs
    only when the strategy is not none); a container given it sees its MIG devices."""
    return [
        Device(
            id=gpu.uuid,
            index=str(gpu.index),
            gpu_uuid=gpu.uuid,
            gpu_index=gpu.index,
            numa_node=gpu.numa_node,
            paths=(f"/dev/nvidia{gpu.minor}",),
            name=gpu.name,
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


def devices_by_resource(gpus: Iterable[Gpu], patterns: Sequence[Any] = ()) -> dict[str, list[Device]]:
    """Full-GPU devices grouped by resource name (sorted by name; devices in index order).
    A resource appears only when at least one GPU maps to it."""
    out: dict[str, list[Device]] = {}
    for device in full_gpu_devices(gpus):
        out.setdefault(resource_name_for(device.name, patterns), []).append(device)
    return dict(sorted(out.items()))
