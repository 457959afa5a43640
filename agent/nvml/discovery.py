"""GPU discovery and the link model, read through pynvml.

Owns: turning NVML's view of the node into plain, immutable records (`Gpu`, `Link`) that the
rest of the agent uses without touching NVML. Reads happen once per call of `discover()` /
`read_links()`; callers cache them. Each GPU is read under agent.nvml.guard's budget: one
that does not answer keeps the record read before (a reload), or is left out (at start).
Must not hold state, talk gRPC, or decide policy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import NamedTuple

import pynvml

from agent.errors import NvmlError, NvmlNotAnswering, nvml_error
from agent.nvml.guard import GUARD

log = logging.getLogger(__name__)

# NVML topology levels (nvmlGpuTopologyLevel_t) and their `nvidia-smi topo -m` names.
LEVEL_NAMES = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
LEVEL_SYSTEM = 50
NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
_REMOTE_GPU = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
_REMOTE_SWITCH = pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH


class Gpu(NamedTuple):
    """One physical GPU as NVML reports it."""

    index: int
    uuid: str
    name: str
    minor: int
    pci_bus_id: str  # NVML form, e.g. 00000000:06:00.0
    numa_node: int | None
    memory_total: int  # bytes
    compute_capability: tuple[int, int]
    mig_enabled: bool  # the current MIG mode: what the GPU is advertised by, as NVIDIA does
    mig_pending: bool | None = None  # the mode after the next GPU reset; None: not MIG capable

    @property
    def mig_pending_note(self) -> str:
        """"" or the line saying a MIG mode change waits for a GPU reset: the GPU is advertised
        by its current mode, as NVIDIA's plugin does (go-nvlib IsMigEnabled reads only it)."""
        if self.mig_pending is None or self.mig_pending == self.mig_enabled:
            return ""
        return (f"GPU {self.index} {self.uuid}: MIG mode change pending (MIG "
                f"{'enabled' if self.mig_pending else 'disabled'} after the next GPU reset); "
                f"advertised by its current mode (MIG "
                f"{'enabled' if self.mig_enabled else 'disabled'})")

    @property
    def short_bus_id(self) -> str:
        """The sysfs form of the bus id (4-digit domain, lower case): 0000:06:00.0."""
        domain, rest = self.pci_bus_id.split(":", 1)
        return f"{int(domain, 16):04x}:{rest.lower()}"


class Link(NamedTuple):
    """How two GPUs are joined: the PCIe common-ancestor level and the NVLinks between them."""

    level: int  # one of LEVEL_NAMES (0 for a GPU with itself)
    nvlinks: int = 0
    via_switch: bool = False

    @property
    def label(self) -> str:
        """The `nvidia-smi topo -m` cell for this pair: NV# when NVLinked, else the level."""
        return f"NV{self.nvlinks}" if self.nvlinks else LEVEL_NAMES.get(self.level, "SYS")


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _call(fn, *args):
    """Call a pynvml function, turning its NVMLError into agent.errors.NvmlError."""
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise nvml_error(exc.value, fn.__name__) from exc


def _numa_node(handle, bus_id: str, sys_root: str) -> int | None:
    """NUMA node of a GPU: sysfs first (what the kernel says), then NVML's memory affinity."""
    domain, rest = bus_id.split(":", 1)
    sysfs = os.path.join(sys_root, "bus/pci/devices", f"{int(domain, 16):04x}:{rest.lower()}",
                         "numa_node")
    try:
        with open(sysfs) as f:
            node = int(f.read().strip())
        return node if node >= 0 else None
    except (OSError, ValueError):
        pass
    try:
        mask = _call(pynvml.nvmlDeviceGetMemoryAffinity, handle, 1, pynvml.NVML_AFFINITY_SCOPE_NODE)
    except NvmlError as exc:
        log.debug("no NUMA node for %s: %s", bus_id, exc)
        return None
    word = int(mask[0])
    return (word & -word).bit_length() - 1 if word else None


def _read_gpu(index: int, sys_root: str) -> Gpu:
    handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
    pci = _call(pynvml.nvmlDeviceGetPciInfo, handle)
    bus_id = _text(pci.busId)
    try:
        current, pending = _call(pynvml.nvmlDeviceGetMigMode, handle)
        mig = current == pynvml.NVML_DEVICE_MIG_ENABLE
        mig_pending = pending == pynvml.NVML_DEVICE_MIG_ENABLE
    except NvmlError as exc:
        if not exc.is_not_supported:
            raise
        mig, mig_pending = False, None
    return Gpu(
        index=index,
        uuid=_text(_call(pynvml.nvmlDeviceGetUUID, handle)),
        name=_text(_call(pynvml.nvmlDeviceGetName, handle)),
        minor=_call(pynvml.nvmlDeviceGetMinorNumber, handle),
        pci_bus_id=bus_id,
        numa_node=_numa_node(handle, bus_id, sys_root),
        memory_total=int(_call(pynvml.nvmlDeviceGetMemoryInfo, handle).total),
        compute_capability=tuple(_call(pynvml.nvmlDeviceGetCudaComputeCapability, handle)),
        mig_enabled=mig,
        mig_pending=mig_pending,
    )


def discover(sys_root: str = "/sys", known: Sequence[Gpu] = ()) -> list[Gpu]:
    """Every physical GPU NVML reports, by index. NVML must be initialised.

    A GPU that NVML reports lost (fallen off the bus) cannot be identified, so it is left out
    with a warning and the others are still returned: one broken GPU must not take the node's
    healthy GPUs away from kubelet. A GPU that does not answer within the guard's budget keeps
    its record among `known` (what was read before), else is left out; the guard has told its
    listener (the GPU is withdrawn). Any other NVML failure raises NvmlError.
    """
    before = {g.index: g for g in known}
    gpus = []
    for index in range(_call(pynvml.nvmlDeviceGetCount)):
        try:
            gpus.append(GUARD.call(index, "GPU discovery", _read_gpu, index, sys_root))
        except NvmlNotAnswering as exc:
            if index in before:
                log.warning("GPU %d %s: %s; keeping what was read before", index,
                            before[index].uuid, exc)
                gpus.append(before[index])
            else:
                log.error("GPU index %d: %s; left out until it answers", index, exc)
        except NvmlError as exc:
            if not exc.is_gpu_lost:
                raise
            log.warning("GPU index %d is lost (%s): left out until the agent restarts or "
                        "reloads; check `nvidia-smi` and the kernel log for an XID", index, exc)
    return gpus


def _nvlink_peers(handle, bus_to_index: dict[str, int]) -> tuple[dict[int, int], int]:
    """(links per peer GPU index, links to NVSwitches) of one GPU; unreadable links are skipped."""
    peers: dict[int, int] = {}
    switch_links = 0
    for link in range(NVLINK_MAX_LINKS):
        try:
            if _call(pynvml.nvmlDeviceGetNvLinkState, handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
        except NvmlError:
            continue  # link absent on this GPU, or NVLink not supported at all
        try:
            kind = _call(pynvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
        except NvmlError:
            kind = _REMOTE_GPU  # older drivers: a remote end is a GPU
        if kind == _REMOTE_SWITCH:
            switch_links += 1
            continue
        try:
            remote = _text(_call(pynvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link).busId)
        except NvmlError:
            continue
        peer = bus_to_index.get(remote.lower())
        if peer is not None:
            peers[peer] = peers.get(peer, 0) + 1
    return peers, switch_links


def read_links(gpus: list[Gpu]) -> dict[tuple[int, int], Link]:
    """The link model for every ordered pair of GPUs (i, j), i != j, keyed by GPU index.

    Per pair: the PCIe common-ancestor level (nvmlDeviceGetTopologyCommonAncestor), the NVLinks
    between them (links whose state is up and whose remote PCI bus id is the other GPU), and,
    when both GPUs have links to NVSwitches, the smaller of their switch-link counts on top
    (`via_switch`: an NVSwitch system, all-to-all), as `nvidia-smi topo -m` counts NV#. NUMA
    nodes are on the `Gpu` records. A pair NVML cannot describe counts as the weakest level
    (SYS, no NVLink), so one GPU that fell off the bus degrades the model instead of failing
    it; the level is read once per unordered pair.
    """
    handles = {}
    for gpu in gpus:
        try:
            handles[gpu.index] = GUARD.call(gpu.index, "topology", _call,
                                            pynvml.nvmlDeviceGetHandleByIndex, gpu.index)
        except NvmlError as exc:
            log.warning("GPU %s (index %d) unreadable for topology: %s", gpu.uuid, gpu.index, exc)
    bus_to_index = {gpu.pci_bus_id.lower(): gpu.index for gpu in gpus}
    rows = {}  # index -> (NVLink peers, switch links, PCIe level to each later GPU)
    for x, a in enumerate(gpus):
        if a.index in handles:
            later = [(b, handles[b.index]) for b in gpus[x + 1:]
                     if b.index in handles and b.index != a.index]
            try:  # one guarded call per GPU, not per pair: 64 GPUs are 2,016 pairs
                rows[a.index] = GUARD.call(a.index, "topology", _row, a, handles[a.index],
                                           later, bus_to_index)
            except NvmlNotAnswering as exc:
                log.warning("GPU %s (index %d) unreadable for topology: %s", a.uuid, a.index,
                            exc)
    links: dict[tuple[int, int], Link] = {}
    for x, a in enumerate(gpus):
        for b in gpus[x + 1:]:
            if a.index == b.index:
                continue
            peers_a, switch_a, levels = rows.get(a.index, ({}, 0, {}))
            peers_b, switch_b, _ = rows.get(b.index, ({}, 0, {}))
            level = levels.get(b.index, LEVEL_SYSTEM)
            # Each side counts its own links to the other; a link one side cannot read is
            # still a link (the larger count).
            direct = max(peers_a.get(b.index, 0), peers_b.get(a.index, 0))
            switched = min(switch_a, switch_b) if switch_a and switch_b else 0
            link = Link(level, direct + switched, via_switch=bool(switched))
            links[(a.index, b.index)] = links[(b.index, a.index)] = link
    return links


def _row(a: Gpu, handle, later: list, bus_to_index: dict[str, int]):
    """GPU `a`'s part of the model: its NVLink peers and switch links, and its PCIe level to
    each GPU in `later` ((Gpu, handle) pairs); a level NVML cannot give counts as SYS."""
    peers, switch_links = _nvlink_peers(handle, bus_to_index)
    levels = {}
    for b, other in later:
        try:
            level = int(_call(pynvml.nvmlDeviceGetTopologyCommonAncestor, handle, other))
        except NvmlError as exc:
            log.warning("no PCIe level for GPUs %s (index %d) and %s (index %d): %s; "
                        "counted as SYS", a.uuid, a.index, b.uuid, b.index, exc)
            level = LEVEL_SYSTEM
        levels[b.index] = level if level in LEVEL_NAMES else LEVEL_SYSTEM
    return peers, switch_links, levels
