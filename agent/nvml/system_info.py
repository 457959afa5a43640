"""What gpu-feature-discovery reads about the node besides the GPU records, for the node
feature labels (agent.rm.labels): the machine type (DMI product name), each GPU's PCI class
(compute or graphics mode), and each MIG device's shared engine counts.

Owns: those reads, as one plain record (`NodeFacts`), read where NVIDIA's GFD reads them
(k8s-device-plugin v0.20.0, commit 1b826acc6): internal/lm/machine-type.go getMachineType
(the file's text, trimmed), vendored go-nvlib pkg/nvpci/nvpci.go (sysfs
bus/pci/devices/<bus id>/{vendor,class} of an NVIDIA device) and
internal/resource/nvml-mig-device.go GetAttributes (nvmlDeviceGetAttributes_v2 of each MIG
device). A fact that cannot be read is left out of the record, never guessed. The driver and
CUDA versions are agent.nvml.driver's. NVML must be initialised for `mig_engines`. Must not
decide what a fact means for a label (agent.rm.labels does), keep state, or change anything.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import pynvml

from agent.nvml.discovery import Gpu, _call
from agent.nvml.mig import MigDevice

log = logging.getLogger(__name__)

# Under the sysfs root: where GFD's default --machine-type-file reads (/sys/class/dmi/id/...).
MACHINE_TYPE_FILE = "class/dmi/id/product_name"
NVIDIA_PCI_VENDOR = 0x10DE
_PCI_DEVICES = "bus/pci/devices"


class MigEngines(NamedTuple):
    """The shared engines of one MIG device (nvmlDeviceAttributes_t shared*Count)."""

    copy: int
    decoder: int
    encoder: int
    jpeg: int
    ofa: int


@dataclass(frozen=True)
class NodeFacts:
    """What the labels need beyond `Gpu`, `MigDevice` and `DriverInfo`; empty by default (the
    labels then say "unknown" or leave the label out, see agent.rm.labels)."""

    machine: str | None = None  # the DMI product name, trimmed; None: unreadable
    # PCI class (e.g. 0x030200) by GPU index, for NVIDIA devices whose class sysfs shows
    pci_class: Mapping[int, int] = field(default_factory=dict)
    engines: Mapping[str, MigEngines] = field(default_factory=dict)  # by MIG device UUID


def machine_type(sys_root: str = "/sys") -> str | None:
    """The node's DMI product name (e.g. "DGX H100"), trimmed; None when unreadable (a VM
    without DMI, a container without /sys/class/dmi)."""
    path = os.path.join(sys_root, MACHINE_TYPE_FILE)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError as exc:
        log.debug("machine type unreadable from %s: %s", path, exc)
        return None


def _read_hex(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip(), 16)
    except (OSError, ValueError):
        return None


def pci_classes(gpus: Iterable[Gpu], sys_root: str = "/sys") -> dict[int, int]:
    """The PCI class of each GPU, by index, read from sysfs; a GPU whose sysfs entry is
    missing, unreadable or not an NVIDIA device (go-nvlib nvpci checks the vendor) is left
    out."""
    out = {}
    for gpu in gpus:
        device = os.path.join(sys_root, _PCI_DEVICES, gpu.short_bus_id)
        if _read_hex(os.path.join(device, "vendor")) != NVIDIA_PCI_VENDOR:
            log.debug("GPU %d %s: no NVIDIA PCI device at %s", gpu.index, gpu.uuid, device)
            continue
        cls = _read_hex(os.path.join(device, "class"))
        if cls is not None:
            out[gpu.index] = cls
    return out


def mig_engines(migs: Iterable[MigDevice]) -> dict[str, MigEngines]:
    """The shared engine counts of each MIG device, by UUID, through its handle index on the
    parent (as agent.nvml.mig reads them). NvmlError when NVML cannot say."""
    out = {}
    parents: dict[int, object] = {}
    for m in migs:
        if m.parent.index not in parents:
            parents[m.parent.index] = _call(pynvml.nvmlDeviceGetHandleByIndex, m.parent.index)
        handle = _call(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, parents[m.parent.index],
                       m.index)
        a = _call(pynvml.nvmlDeviceGetAttributes_v2, handle)
        out[m.uuid] = MigEngines(copy=int(a.sharedCopyEngineCount),
                                 decoder=int(a.sharedDecoderCount),
                                 encoder=int(a.sharedEncoderCount),
                                 jpeg=int(a.sharedJpegCount), ofa=int(a.sharedOfaCount))
    return out


def node_facts(gpus: Iterable[Gpu], migs: Iterable[MigDevice] = (),
               sys_root: str = "/sys") -> NodeFacts:
    """Every fact above: machine type and PCI classes from `sys_root`, the engines of `migs`
    from NVML (NvmlError when NVML cannot say)."""
    return NodeFacts(machine=machine_type(sys_root), pci_class=pci_classes(gpus, sys_root),
                     engines=mig_engines(migs))
