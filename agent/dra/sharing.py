"""How each device of a claim is shared: NVIDIA's opaque configs and consumable capacity.

Owns: reading the opaque configs of a claim's allocation meant for gpu.nvidia.com as NVIDIA's
kubelet plugin reads them (resource.nvidia.com/v1beta1 `GpuConfig` and `MigDeviceConfig`,
decoded strictly: an unknown field, kind or value is refused with its path named; NVIDIA's
api/nvidia.com/resource/v1beta1 sharing.go, gpuconfig.go, migconfig.go, validate.go); which
config applies to which allocated device (the last one, class configs before the claim's,
that either names its request or names no request and is of the device's kind; a GpuConfig
naming a MIG device's request, or a MigDeviceConfig naming a GPU's, refused:
cmd/gpu-kubelet-plugin/device_state.go:727-768);
and the Share each device gets: exclusive, TimeSlicing with its interval (Default when
unset), or MPS with its limits, from the config, or from the capacity the scheduler charged
an allocation of a shareable GPU (agent.dra.slices.gpu_device: its memory, and its `cores` or
else the same fraction of its SMs as of its memory); and the MPS daemons the prepared claims
need (`mps_plan`). Must not start daemons or run tools (agent.dra.claims applies a Share).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from agent.dra.slices import CORES, DRIVER, MEMORY, parse_quantity
from agent.errors import ClaimError
from agent.rm.sharing import MIB, MpsGpu

API = "resource.nvidia.com/v1beta1"  # api.go:27-28
GPU_CONFIG, MIG_CONFIG = "GpuConfig", "MigDeviceConfig"
KIND_OF_DEVICE = {"gpu": GPU_CONFIG, "mig": MIG_CONFIG}
TIME_SLICING, MPS = "TimeSlicing", "MPS"  # sharing.go:29-30
# sharing.go TimeSliceInterval.Int: what nvidia-smi compute-policy --set-timeslice is given
INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
_MPS_FIELDS = ("defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit",
               "defaultPerDevicePinnedMemoryLimit")
_SHARING_FIELDS = {GPU_CONFIG: ("strategy", "timeSlicingConfig", "mpsConfig"),
                   MIG_CONFIG: ("strategy", "mpsConfig")}


class SharingError(ClaimError):
    """A claim's config that cannot be applied as written."""


class Share(NamedTuple):
    """How one allocated device is shared."""

    strategy: str = ""  # "" (not shared by the agent), TIME_SLICING or MPS
    interval: str = ""  # TimeSlicing of a full GPU: a key of INTERVALS
    threads: int | None = None  # MPS: the active thread percentage (None: all)
    memory_mib: int | None = None  # MPS: the pinned device memory limit (None: all)
    share_id: str = ""  # the allocation's shareID (consumable capacity)

    def record(self) -> list:
        return list(self)


class Config(NamedTuple):
    """One opaque config of a claim for this driver, read and checked."""

    requests: tuple[str, ...]  # empty: every request
    kind: str
    sharing: dict | None


def read_configs(configs: Iterable[dict], where: str) -> list[Config]:
    """The claim's configs for this driver (status.allocation.devices.config, class configs
    first as the API server lists them), checked; `where` names the claim in errors."""
    out = []
    for i, c in enumerate(configs):
        opaque = c.get("opaque") or {}
        if opaque.get("driver") != DRIVER:
            continue
        at = f"{where}: config[{i}] (from {c.get('source', 'the claim')}) parameters"
        params = opaque.get("parameters")
        if not isinstance(params, dict):
            raise SharingError(f"{at}: expected an object, got {params!r}")
        if params.get("apiVersion") != API:
            raise SharingError(f"{at}.apiVersion: {params.get('apiVersion')!r}: gpu-agent reads "
                               f"{API} (NVIDIA's DRA driver's)")
        kind = params.get("kind")
        if kind not in _SHARING_FIELDS:
            raise SharingError(f"{at}.kind: {kind!r}: gpu-agent takes {GPU_CONFIG} and "
                               f"{MIG_CONFIG}")
        _only(params, ("apiVersion", "kind", "sharing"), at)
        sharing = params.get("sharing")
        if sharing is not None:
            sharing = _sharing(sharing, kind, f"{at}.sharing")
        out.append(Config(tuple(c.get("requests") or ()), kind, sharing))
    return out


def _only(obj: Any, fields: Sequence[str], at: str) -> None:
    if not isinstance(obj, dict):
        raise SharingError(f"{at}: expected an object, got {obj!r}")
    for key in obj:
        if key not in fields:
            raise SharingError(f"{at}.{key}: unknown field (known: {', '.join(fields)})")


def _sharing(sharing: Any, kind: str, at: str) -> dict:
    """sharing.go GpuSharing / MigDeviceSharing, normalized (gpuconfig.go Normalize) and
    validated (validate.go)."""
    _only(sharing, _SHARING_FIELDS[kind], at)
    strategy = sharing.get("strategy")
    if strategy not in (TIME_SLICING, MPS):
        raise SharingError(f"{at}.strategy: unknown GPU sharing strategy {strategy!r}, "
                           f"supported GPU sharing strategies: {TIME_SLICING}, {MPS}")
    out: dict = {"strategy": strategy}
    if strategy == TIME_SLICING:
        if sharing.get("mpsConfig") is not None:
            raise SharingError(f"{at}.mpsConfig: cannot use MpsConfig with the "
                               f"'{TIME_SLICING}' strategy")
        config = sharing.get("timeSlicingConfig") or {}
        _only(config, ("interval",), f"{at}.timeSlicingConfig")
        interval = config.get("interval", "Default")
        if interval not in INTERVALS:
            raise SharingError(f"{at}.timeSlicingConfig.interval: unknown time-slice interval "
                               f"{interval!r}, supported time-slice intervals: "
                               f"{', '.join(INTERVALS)}")
        out["interval"] = interval if kind == GPU_CONFIG else ""
        return out
    if sharing.get("timeSlicingConfig") is not None:
        raise SharingError(f"{at}.timeSlicingConfig: cannot use TimeSlicingConfig with the "
                           f"'{MPS}' strategy")
    config = sharing.get("mpsConfig") or {}
    _only(config, _MPS_FIELDS, f"{at}.mpsConfig")
    threads = config.get("defaultActiveThreadPercentage")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool)
                                or not 0 <= threads <= 100):
        raise SharingError(f"{at}.mpsConfig.defaultActiveThreadPercentage: {threads!r}: an "
                           f"active thread percentage is an integer from 0 to 100")
    out["threads"] = threads
    limit = config.get("defaultPinnedDeviceMemoryLimit")
    out["memory_mib"] = None if limit is None else _mib(
        limit, f"{at}.mpsConfig.defaultPinnedDeviceMemoryLimit")
    per_device = config.get("defaultPerDevicePinnedMemoryLimit") or {}
    if not isinstance(per_device, dict):
        raise SharingError(f"{at}.mpsConfig.defaultPerDevicePinnedMemoryLimit: expected a map "
                           f"of device index or UUID to a quantity, got {per_device!r}")
    out["per_device"] = {str(k): _mib(v, f"{at}.mpsConfig.defaultPerDevicePinnedMemoryLimit."
                                         f"{k}") for k, v in per_device.items()}
    return out


def _mib(value: Any, at: str) -> int:
    """A pinned memory limit in MiB, as sharing.go limit.Megabyte: at least 1."""
    try:
        mib = int(parse_quantity(value) // MIB)
    except ValueError as exc:
        raise SharingError(f"{at}: {exc}") from None
    if mib <= 0:
        raise SharingError(f"{at}: invalid limit: value set too low: {value!r} (at least 1Mi)")
    return mib


def shares(results: Sequence[dict], configs: Sequence[Config], devices: Mapping[str, Any],
           where: str) -> list[Share]:
    """The Share of each of `results` (the claim's allocation results for this node);
    `devices`: name -> agent.dra.claims.NodeDevice."""
    chosen = [_config_of(r, devices[r["device"]], configs, where) for r in results]
    out = []
    for r, config in zip(results, chosen):
        device = devices[r["device"]]
        uuids = [devices[x["device"]].uuid for x, c in zip(results, chosen) if c is config]
        out.append(_with_capacity(_from_config(config, device, uuids, where), r, device, where))
    mps_gpus = {devices[r["device"]].uuid for r, s in zip(results, out) if s.strategy == MPS}
    if len(mps_gpus) > 1:
        raise SharingError(f"{where}: MPS on {len(mps_gpus)} devices of one claim: each GPU "
                           f"has its own MPS control daemon and a container connects to one; "
                           f"ask for the devices in separate claims")
    return out


def _config_of(result: dict, device: Any, configs: Sequence[Config], where: str
               ) -> Config | None:
    request = result["request"]
    for c in reversed(configs):
        if request in c.requests or request.split("/")[0] in c.requests:
            if c.kind != KIND_OF_DEVICE[device.kind]:
                raise SharingError(f"{where}: cannot apply {c.kind} to device "
                                   f"{result['device']} of type {device.kind!r} (request: "
                                   f"{request})")
            return c
        if not c.requests and c.kind == KIND_OF_DEVICE[device.kind]:
            return c
    return None


def _from_config(config: Config | None, device: Any, uuids: list[str], where: str) -> Share:
    if config is None or config.sharing is None:
        return Share()
    sharing = config.sharing
    if sharing["strategy"] == TIME_SLICING:
        return Share(TIME_SLICING, sharing["interval"])
    memory = sharing["memory_mib"]
    for key, mib in sharing["per_device"].items():  # sharing.go uuidSet.Normalize
        if key in uuids:
            uuid = key
        elif key.isdigit() and int(key) < len(uuids):
            uuid = uuids[int(key)]
        else:
            raise SharingError(f"{where}: defaultPerDevicePinnedMemoryLimit: invalid device "
                               f"{key!r}: neither a UUID nor an index of the config's "
                               f"{len(uuids)} devices")
        if uuid == device.uuid:
            memory = mib
    return Share(MPS, "", sharing["threads"], memory)


def _with_capacity(share: Share, result: dict, device: Any, where: str) -> Share:
    """A share of a shareable GPU (consumedCapacity and a shareID): all of its memory is the
    GPU whole, less is an MPS share with that much memory and its cores (else the same
    fraction of the SMs), within the config's own MPS limits."""
    consumed, share_id = result.get("consumedCapacity"), result.get("shareID")
    if not consumed or not share_id:
        return share
    try:
        memory = parse_quantity(consumed.get(MEMORY, device.memory))
        cores = parse_quantity(consumed.get(CORES, 0))
    except ValueError as exc:
        raise SharingError(f"{where}: consumedCapacity of {result['device']}: {exc}") from None
    if memory >= device.memory:
        return share._replace(share_id=share_id)
    if share.strategy == TIME_SLICING:
        raise SharingError(f"{where}: {result['device']} is shared by capacity (MPS): a "
                           f"TimeSlicing config does not apply to a share of it")
    threads = math.ceil(cores) if cores > 0 else math.ceil(100 * memory / device.memory)
    mib = int(memory // MIB)
    return Share(MPS, "", min(threads, share.threads if share.threads is not None else 100),
                 min(mib, share.memory_mib or mib), share_id)


def mps_plan(held: Iterable[tuple[Any, Share]]) -> dict[str, MpsGpu]:
    """The MPS control daemons of the prepared claims (`held`: (NodeDevice, Share) of every
    prepared device), by device UUID: each with the largest limits its claims have (a client
    lowers its own through its environment; the daemon's defaults cap every client)."""
    plan: dict[str, MpsGpu] = {}
    for device, share in held:
        if share.strategy != MPS:
            continue
        threads = 100 if share.threads is None else share.threads
        memory = device.memory // MIB if share.memory_mib is None else share.memory_mib
        old = plan.get(device.uuid)
        plan[device.uuid] = MpsGpu(device.uuid, device.index, (old.replicas if old else 0) + 1,
                                   (), max(threads, old.thread_percentage if old else 0),
                                   max(memory, old.memory_limit_mib if old else 0))
    return plan
