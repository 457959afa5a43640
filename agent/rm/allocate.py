"""What a container gets for its devices: the Allocate response, as NVIDIA's plugin builds it.

Owns: request validation and the response for each device-list strategy (envvar,
volume-mounts, cdi-annotations, cdi-cri), each device-ID strategy (uuid, index) and
passDeviceSpecs. Plain data in and out; the gRPC layer copies it into protobuf. Must not
import grpc nor call NVML.

Compatibility notes (NVIDIA k8s-device-plugin behaviour kept on purpose):
- envvar: NVIDIA_VISIBLE_DEVICES=<id,id>; volume-mounts replaces that value with the mount
  root and adds one /dev/null mount per device ID, so with both, volume-mounts wins.
- CDI names are `nvidia.com/gpu=<id>` with <id> per the device-ID strategy: the names that
  `nvidia-ctk cdi generate` defines on the host (it emits both index and UUID names).
- cdi-annotations: one annotation `<prefix>gpu-agent_<unique>` whose value is the
  comma-separated CDI names; cdi-cri: the same names in `cdi_devices`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from agent.constants import (
    DEFAULT_CDI_ANNOTATION_PREFIX,
    DEFAULT_DEVICE_ID_STRATEGY,
    DEFAULT_DEVICE_LIST_STRATEGIES,
    DEFAULT_DRIVER_ROOT,
)
from agent.errors import RequestError
from agent.rm.devices import Device
from agent.rm.sharing import MIB, mps_pipe_dir, mps_shm_dir

DEVICE_LIST_ENVVAR = "NVIDIA_VISIBLE_DEVICES"
VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
VOLUME_MOUNT_HOST_PATH = "/dev/null"
CDI_KIND = "nvidia.com/gpu"
MPS_CONTAINER_ROOT = "/mps"  # cmd/mps-control-daemon/mps/root.go ContainerRoot
# Control device nodes passed with passDeviceSpecs where they exist under the dev root.
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                   "/dev/nvidia-modeset")


class Mount(NamedTuple):
    container_path: str
    host_path: str
    read_only: bool = False


class DeviceSpec(NamedTuple):
    container_path: str
    host_path: str
    permissions: str = "rw"


class ResponseOptions(NamedTuple):
    """The settings that shape an Allocate response (from the effective config)."""

    list_strategies: tuple[str, ...] = DEFAULT_DEVICE_LIST_STRATEGIES
    id_strategy: str = DEFAULT_DEVICE_ID_STRATEGY
    pass_device_specs: bool = False
    cdi_annotation_prefix: str = DEFAULT_CDI_ANNOTATION_PREFIX
    dev_root: str = DEFAULT_DRIVER_ROOT
    mps_root: str = ""  # sharing.mps: flags.mpsRoot (replicas get MPS's env and mounts)


class ContainerResponse:
    """One container's answer, filled in by build_response (then never changed)."""

    __slots__ = ("envs", "mounts", "devices", "annotations", "cdi_devices")

    def __init__(self) -> None:
        self.envs: dict[str, str] = {}
        self.mounts: list[Mount] = []
        self.devices: list[DeviceSpec] = []
        self.annotations: dict[str, str] = {}
        self.cdi_devices: list[str] = []

    def __repr__(self) -> str:
        return (f"ContainerResponse(envs={self.envs!r}, mounts={self.mounts!r}, "
                f"devices={self.devices!r}, annotations={self.annotations!r}, "
                f"cdi_devices={self.cdi_devices!r})")


def resolve_request(resource: str, ids: Sequence[str], known: Mapping[str, Device]) -> list[Device]:
    """The devices a container request names, in request order; RequestError if it is empty,
    repeats an ID, or names an ID this resource does not advertise."""
    if not ids:
        raise RequestError(f"invalid allocation request for '{resource}': no device IDs")
    seen: set[str] = set()
    for device_id in ids:
        if device_id in seen:
            raise RequestError(
                f"invalid allocation request for '{resource}': duplicate device: {device_id}")
        seen.add(device_id)
        if device_id not in known:
            raise RequestError(
                f"invalid allocation request for '{resource}': unknown device: {device_id}")
    return [known[i] for i in ids]


def check_shared_request(resource: str, devices: Sequence[Device]) -> None:
    """failRequestsGreaterThanOne: a container asking for more than one device, replicas
    among them, is refused with NVIDIA's words (internal/rm/rm.go ValidateRequest, wrapped
    by internal/plugin/server.go Allocate)."""
    if len(devices) > 1 and any(d.replica_of for d in devices):
        raise RequestError(f'invalid allocation request for "{resource}": invalid request: '
                           f'maximum request size for shared resources is 1; '
                           f'found {len(devices)}')


def _response_ids(devices: Sequence[Device], id_strategy: str) -> list[str]:
    """The IDs a container is given, each GPU or MIG device once however many of its
    replicas it holds (server.go uniqueDeviceIDsFromAnnotatedDeviceIDs, v0.18 on)."""
    if id_strategy == "index":
        ids = [d.index for d in devices]
    else:
        ids = [d.replica_of or d.id for d in devices]
    return list(dict.fromkeys(ids))


def _device_specs(devices: Sequence[Device], dev_root: str) -> list[DeviceSpec]:
    specs = []
    for path in CONTROL_DEVICES:
        host = os.path.join(dev_root, path.lstrip("/"))
        if os.path.exists(host):
            specs.append(DeviceSpec(path, host))
    paths = dict.fromkeys(path for device in devices for path in device.paths)
    for path in paths:  # replicas of one GPU share its nodes: each passed once
        specs.append(DeviceSpec(path, os.path.join(dev_root, path.lstrip("/"))))
    return specs


def _mps(response: ContainerResponse, devices: Sequence[Device], opts: ResponseOptions,
         resource: str) -> None:
    """What a container holding MPS replicas needs: NVIDIA's pipe directory (env and mount,
    internal/plugin/mps.go updateReponse: /mps/<resource>/pipe in the container) and shared
    /dev/shm, here from its GPU's own control daemon, and its share of the GPU: k of the GPU's
    N replicas give k/N of the SMs and of the memory, which its MPS server enforces (a client
    can lower the daemon's defaults, not raise them: agent.rm.sharing.mps_plan)."""
    shared = [d for d in devices if d.replica_of]
    if not shared:
        return
    gpus = dict.fromkeys(f"GPU {d.gpu_index}" for d in shared)
    if len(gpus) > 1:
        raise RequestError(f'invalid allocation request for "{resource}": MPS replicas of one '
                           f'container must be on one GPU (each GPU has its own MPS control '
                           f'daemon and a CUDA process connects to one); got {", ".join(gpus)}')
    d, k = shared[0], len(shared)
    pipe = f"{MPS_CONTAINER_ROOT}/{resource}/pipe"
    response.envs["CUDA_MPS_PIPE_DIRECTORY"] = pipe
    response.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(100 * k // d.replicas)
    response.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = \
        f"0={d.memory * k // d.replicas // MIB}MB"  # the container sees its GPU as device 0
    response.mounts = [*response.mounts,
                       Mount(pipe, mps_pipe_dir(opts.mps_root, d.gpu_uuid)),
                       Mount("/dev/shm", mps_shm_dir(opts.mps_root))]


def container_response(devices: Sequence[Device], opts: ResponseOptions,
                       response_id: str | None = None, resource: str = "") -> ContainerResponse:
    """The ContainerAllocateResponse for `devices` of `resource` under `opts`.

    `response_id` makes the CDI annotation key unique; a random UUID when not given.
    RequestError for MPS replicas on more than one GPU.
    """
    ids = _response_ids(devices, opts.id_strategy)
    response = ContainerResponse()
    strategies = set(opts.list_strategies)
    cdi_names = [f"{CDI_KIND}={i}" for i in ids]
    if "cdi-annotations" in strategies:
        import uuid  # off the start path (2 ms); the CDI strategies only

        key = f"{opts.cdi_annotation_prefix}gpu-agent_{response_id or uuid.uuid4()}"
        response.annotations[key] = ",".join(cdi_names)
    if "cdi-cri" in strategies:
        response.cdi_devices = cdi_names
    if "envvar" in strategies:
        response.envs[DEVICE_LIST_ENVVAR] = ",".join(ids)
    if "volume-mounts" in strategies:
        response.envs[DEVICE_LIST_ENVVAR] = VOLUME_MOUNT_ROOT
        response.mounts = [
            Mount(f"{VOLUME_MOUNT_ROOT}/{i}", VOLUME_MOUNT_HOST_PATH, False) for i in ids
        ]
    if opts.pass_device_specs:
        response.devices = _device_specs(devices, opts.dev_root)
    if opts.mps_root:
        _mps(response, devices, opts, resource)
    return response
