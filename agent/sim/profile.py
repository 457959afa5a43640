"""Simulated node profiles: load and validate, write, build from `nvidia-smi topo -m`, record.

Owns: the profile schema on the Python side (the same rules agent/sim/nvml/profile.c applies,
so a profile this module accepts is one the simulated library loads), the canonical YAML
writer (which stays inside the YAML subset the C parser reads), `profile_from_topo` (the
from-topo rules in docs/simulator.md) and `record_profile` (a node read through real NVML via
pynvml), plus the `gpu-agent sim profile` and `gpu-agent sim record` commands.

Must not be imported by the daemon (it is a test and demo tool) and must not talk to NVML
except through agent.nvml.library in `record_profile`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

import yaml

from agent.errors import NVML_CODES, SimError
from agent.sim import ENV_PROFILE, PROFILES_DIR

log = logging.getLogger(__name__)

SCHEMA = 1
DEFAULT_PROFILE = "dgx1-v100"

# Limits shared with agent/sim/nvml/sim.h.
MAX_GPUS = 64
MAX_LINKS = 36
MAX_MIG = 16
MAX_MIG_PROFILES = 32
MAX_SWITCHES = 64
MAX_CPUS = 4096
NUM_GI_PROFILES = 0x12
MAX_CI = 8  # compute instances per GPU instance (ids 0-7; nvidia-caps numbers ci0-ci7)
MAX_MEM_SLICES = 8
LEN_NAME = 96
LEN_SERIAL = 30
LEN_VERSION = 80
LEN_TEXT = 1024
LEN_MIG_NAME = 32
LEN_CPULIST = 1024
U32 = 2**32 - 1
I64 = 2**63 - 1

# NVML_NVLINK_MAX_LINKS of the NVLink generations that bond links to peers directly: a GPU
# whose NV# counts over all peers sum to more than this is on an NVSwitch fabric.
NVSWITCH_RULE_LINKS = 18
SWITCHES_PER_FABRIC = 4

# Topology levels: nvmlGpuTopologyLevel_t value <-> `nvidia-smi topo -m` code.
LEVELS = {"X": 0, "PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}
LEVEL_NAMES = {v: k for k, v in LEVELS.items()}

EVENT_SBE = 0x1
EVENT_DBE = 0x2
EVENT_PSTATE = 0x4
EVENT_XID = 0x8
EVENT_CLOCK = 0x10
DATACENTER_EVENTS = EVENT_SBE | EVENT_DBE | EVENT_PSTATE | EVENT_XID | EVENT_CLOCK
GEFORCE_EVENTS = EVENT_PSTATE | EVENT_XID | EVENT_CLOCK

_UUID_NS = uuid.UUID("6f1c2a4e-9d3b-5e7f-8a1b-2c3d4e5f6a7b")
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_CPULIST_RE = re.compile(r"^(\d+(-\d+)?)(,\d+(-\d+)?)*$")
_HEX = set("0123456789abcdefABCDEF")

GB = 1024**3

# MIG GPU instance profiles of an A100-SXM4-80GB, as NVML reports them (values the simulator
# answers; close to `nvidia-smi mig -lgip` on a real A100 80GB).
A100_80GB_MIG_PROFILES = [
    dict(nvml_profile=0, id=19, name="1g.10gb", slices=1, instance_count=7, multiprocessors=14,
         memory_mb=9728, copy_engines=1, decoders=0, encoders=0, jpegs=0, ofas=0, p2p=0),
    dict(nvml_profile=1, id=14, name="2g.20gb", slices=2, instance_count=3, multiprocessors=28,
         memory_mb=19968, copy_engines=2, decoders=1, encoders=0, jpegs=0, ofas=0, p2p=0),
    dict(nvml_profile=2, id=9, name="3g.40gb", slices=3, instance_count=2, multiprocessors=42,
         memory_mb=40192, copy_engines=3, decoders=2, encoders=0, jpegs=0, ofas=0, p2p=0),
    dict(nvml_profile=3, id=5, name="4g.40gb", slices=4, instance_count=1, multiprocessors=56,
         memory_mb=40192, copy_engines=4, decoders=2, encoders=0, jpegs=0, ofas=0, p2p=0),
    dict(nvml_profile=4, id=0, name="7g.80gb", slices=7, instance_count=1, multiprocessors=98,
         memory_mb=80896, copy_engines=7, decoders=5, encoders=0, jpegs=1, ofas=1, p2p=0),
    dict(nvml_profile=7, id=20, name="1g.10gb+me", slices=1, instance_count=1,
         multiprocessors=14, memory_mb=9728, copy_engines=1, decoders=1, encoders=0, jpegs=1,
         ofas=1, p2p=0),
    dict(nvml_profile=9, id=15, name="1g.20gb", slices=1, instance_count=4, multiprocessors=14,
         memory_mb=19968, copy_engines=1, decoders=1, encoders=0, jpegs=0, ofas=0, p2p=0),
]

# GPU models `--gpu-model` knows (matched case-insensitively). Unknown names get GENERIC's
# properties under the name given.
GPU_MODELS: dict[str, dict[str, Any]] = {
    "Tesla V100-SXM2-16GB": dict(device_id=0x1DB110DE, subsystem_id=0x121210DE,
                                 memory=16 * GB, cc=(7, 0), multiprocessors=80,
                                 events=DATACENTER_EVENTS),
    "Tesla P100-PCIE-16GB": dict(device_id=0x15F810DE, subsystem_id=0x118F10DE,
                                 memory=16 * GB, cc=(6, 0), multiprocessors=56,
                                 events=DATACENTER_EVENTS),
    "NVIDIA A100-SXM4-80GB": dict(device_id=0x20B210DE, subsystem_id=0x147F10DE,
                                  memory=80 * GB, cc=(8, 0), multiprocessors=108,
                                  events=DATACENTER_EVENTS, mig=A100_80GB_MIG_PROFILES),
    "NVIDIA A100 80GB PCIe": dict(device_id=0x20B510DE, subsystem_id=0x153310DE,
                                  memory=80 * GB, cc=(8, 0), multiprocessors=108,
                                  events=DATACENTER_EVENTS, mig=A100_80GB_MIG_PROFILES),
    "NVIDIA H100 80GB HBM3": dict(device_id=0x233010DE, subsystem_id=0x16C110DE,
                                  memory=81559 * 1024**2, cc=(9, 0), multiprocessors=132,
                                  events=DATACENTER_EVENTS),
    "NVIDIA B200": dict(device_id=0x290110DE, subsystem_id=0x199910DE, memory=183359 * 1024**2,
                        cc=(10, 0), multiprocessors=148, events=DATACENTER_EVENTS),
    "NVIDIA L40S": dict(device_id=0x26B910DE, subsystem_id=0x185110DE, memory=46068 * 1024**2,
                        cc=(8, 9), multiprocessors=142, events=DATACENTER_EVENTS),
    "NVIDIA GeForce RTX 4090": dict(device_id=0x268410DE, subsystem_id=0x16F310DE,
                                    memory=24564 * 1024**2, cc=(8, 9), multiprocessors=128,
                                    events=GEFORCE_EVENTS),
    "NVIDIA GeForce RTX 3090": dict(device_id=0x220410DE, subsystem_id=0x147D10DE,
                                    memory=24576 * 1024**2, cc=(8, 6), multiprocessors=82,
                                    events=GEFORCE_EVENTS),
}
GENERIC_MODEL = "NVIDIA Simulated GPU"
GENERIC = dict(device_id=0x20B010DE, subsystem_id=0x134F10DE, memory=40 * GB, cc=(8, 0),
               multiprocessors=108, events=DATACENTER_EVENTS)
NVSWITCH_DEVICE_ID = 0x22A310DE
DEFAULT_VERSIONS = dict(driver_version="550.54.15", nvml_version="12.550.54.15",
                        cuda_driver_version=12040)


# ---------------------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------------------

def resolve_profile_path(spec: str | os.PathLike | None = None) -> Path:
    """A profile name (shipped, under agent/sim/profiles/) or a path, as the library resolves it.

    None or "" means $GPU_AGENT_SIM_PROFILE, and that unset means the default, dgx1-v100.
    """
    if spec is None or str(spec) == "":
        spec = os.environ.get(ENV_PROFILE) or DEFAULT_PROFILE
    text = str(spec)
    if "/" in text or text.endswith((".yaml", ".yml")):
        return Path(text)
    if not _NAME_RE.match(text):
        raise SimError(f"profile {text!r} is neither a profile name ([A-Za-z0-9._-]) nor a path")
    path = PROFILES_DIR / f"{text}.yaml"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")))
        raise SimError(f"no profile named {text!r} (shipped: {shipped}); give a name or a path")
    return path


def load_profile(spec: str | os.PathLike | None = None) -> dict[str, Any]:
    """Read and validate a profile (name or path); return it normalized (see validate_profile)."""
    path = resolve_profile_path(spec)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SimError(f"{path}: cannot read: {exc.strerror}") from exc
    return parse_profile_text(text, str(path))


def parse_profile_text(text: str, source: str = "<profile>") -> dict[str, Any]:
    """Parse and validate profile text: PyYAML, limited to the subset the C parser reads."""
    try:
        check_yaml_subset(text, source)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SimError(f"{source}: not valid YAML: {exc}") from exc
    return validate_profile(data, source)


def _check_duplicate_keys(node: Any, source: str) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else str(key)
            if name in seen:
                raise SimError(f"{source}:{key.start_mark.line + 1}: duplicate key '{name}'")
            seen.add(name)
            _check_duplicate_keys(value, source)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicate_keys(item, source)


def check_yaml_subset(text: str, source: str = "<profile>") -> None:
    """Reject YAML the simulated library's parser does not read (docs/simulator.md).

    Walks PyYAML's event stream: flow mappings, block scalars, anchors, aliases, explicit
    tags, multi-line scalars, multiple documents and duplicate keys (which PyYAML would
    silently resolve) are SimErrors naming the line.
    """
    documents = 0
    flow_lines: list[int | None] = []
    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        line = ev.start_mark.line + 1 if ev.start_mark else 0
        where = f"{source}:{line}"
        if isinstance(ev, yaml.DocumentStartEvent):
            documents += 1
            if documents > 1:
                raise SimError(f"{where}: multiple documents are not supported")
        elif isinstance(ev, yaml.AliasEvent) or getattr(ev, "anchor", None):
            raise SimError(f"{where}: anchors, aliases and tags are not supported")
        elif isinstance(ev, yaml.MappingStartEvent) and ev.flow_style:
            raise SimError(f"{where}: flow mappings {{...}} are not supported")
        elif isinstance(ev, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
            implicit = ev.implicit if isinstance(ev, yaml.CollectionStartEvent) else any(
                ev.implicit)
            if ev.tag is not None and not implicit:
                raise SimError(f"{where}: anchors, aliases and tags are not supported")
            if isinstance(ev, yaml.ScalarEvent):
                if ev.style in ("|", ">"):
                    raise SimError(f"{where}: block scalars (| and >) are not supported")
                if ev.end_mark and ev.end_mark.line != ev.start_mark.line:
                    raise SimError(f"{where}: multi-line values are not supported")
            elif isinstance(ev, yaml.SequenceStartEvent):
                flow_lines.append(line if ev.flow_style else None)
        elif isinstance(ev, yaml.SequenceEndEvent):
            start = flow_lines.pop()
            if start is not None and start != line:
                raise SimError(f"{source}:{start}: a flow sequence [...] must fit on one line")
    _check_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), source)


class _V:
    """Validation context: raises SimError('<file>: <key path>: <problem>')."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, problem: str) -> None:
        raise SimError(f"{self.source}: {path}: {problem}")

    @staticmethod
    def join(base: str, key: str) -> str:
        return key if not base else (base + key if key.startswith("[") else f"{base}.{key}")

    @staticmethod
    def kind(value: Any) -> str:
        if value is None:
            return "null"
        if isinstance(value, bool) or isinstance(value, float) or not isinstance(
                value, (str, int, dict, list)):
            return "a boolean, float or date"
        if isinstance(value, str):
            return "a string"
        if isinstance(value, int):
            return "an integer"
        if isinstance(value, dict):
            return "a mapping"
        return "a sequence"

    def keys(self, mapping: dict, path: str, allowed: tuple[str, ...]) -> None:
        for key in mapping:
            if key not in allowed:
                self.fail(self.join(path, str(key)), "unknown key")

    def typed(self, mapping: dict, path: str, key: str, expected: type, required: bool) -> Any:
        p = self.join(path, key)
        if key not in mapping:
            if required:
                self.fail(p, "missing (required)")
            return None
        value = mapping[key]
        want = {str: "a string", int: "an integer", dict: "a mapping", list: "a sequence"}
        if self.kind(value) != want[expected]:
            self.fail(p, f"expected {want[expected]}, found {self.kind(value)}")
        return value

    def string(self, mapping: dict, path: str, key: str, cap: int, required: bool = True):
        value = self.typed(mapping, path, key, str, required)
        if value is not None and len(value.encode()) >= cap:
            self.fail(self.join(path, key), f"longer than {cap - 1} characters")
        return value

    def int_value(self, value: Any, p: str, lo: int, hi: int) -> int:
        if self.kind(value) != "an integer":
            self.fail(p, f"expected an integer, found {self.kind(value)}")
        if not lo <= value <= hi:
            self.fail(p, f"must be an integer from {lo} to {hi}")
        return value

    def integer(self, mapping: dict, path: str, key: str, lo: int, hi: int,
                required: bool = True):
        p = self.join(path, key)
        if key not in mapping:
            if required:
                self.fail(p, "missing (required)")
            return None
        return self.int_value(mapping[key], p, lo, hi)


def parse_bus_id(text: str) -> tuple[int, int, int, int] | None:
    """(domain, bus, device, function) of 'DDDDDDDD:BB:DD.F' or 'BB:DD.F' (hex), else None."""
    if not text or any(c not in _HEX and c not in ":." for c in text):
        return None
    m = re.match(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)$", text)
    if not m:
        return None
    domain = int(m.group(1), 16) if m.group(1) else 0
    bus, dev, fn = (int(m.group(i), 16) for i in (2, 3, 4))
    if domain > U32 or bus > 0xFF or dev > 0x1F or fn > 7:
        return None
    return domain, bus, dev, fn


def format_bus_id(domain: int, bus: int, device: int, function: int = 0) -> str:
    return f"{domain:08X}:{bus:02X}:{device:02X}.{function:X}"


def parse_cpulist(text: str) -> list[int]:
    """CPUs of a list like '0-11,24-35' ('' is none); ValueError with the problem."""
    if text == "":
        return []
    if not _CPULIST_RE.match(text):
        raise ValueError("not a CPU list like '0-11,24-35'")
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if a > b or b >= MAX_CPUS:
            raise ValueError(f"CPU range {a}-{b} is empty or beyond CPU {MAX_CPUS - 1}")
        cpus.extend(range(a, b + 1))
    return cpus


def format_cpulist(cpus: list[int]) -> str:
    """'0-11,24-35' for a list of CPU numbers."""
    out: list[str] = []
    cpus = sorted(set(cpus))
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def _validate_pci(v: _V, pci: dict, path: str, subsystem: bool) -> None:
    allowed = ("bus_id", "device_id", "subsystem_id") if subsystem else ("bus_id", "device_id")
    v.keys(pci, path, allowed)
    bus = v.string(pci, path, "bus_id", 64)
    if parse_bus_id(bus) is None:
        v.fail(v.join(path, "bus_id"), "not a PCI bus id like '00000000:1B:00.0'")
    v.integer(pci, path, "device_id", 0, U32)
    if subsystem:
        v.integer(pci, path, "subsystem_id", 0, U32)


def _validate_mig(v: _V, mig: dict, path: str) -> dict:
    v.keys(mig, path, ("mode", "pending_mode", "max_devices", "profiles", "instances"))
    out: dict[str, Any] = {}
    for key, required in (("mode", True), ("pending_mode", False)):
        mode = v.string(mig, path, key, 16, required)
        if mode is None:
            out[key] = out["mode"]
            continue
        if mode not in ("enabled", "disabled"):
            v.fail(v.join(path, key), "must be 'enabled' or 'disabled'")
        out[key] = mode
    out["max_devices"] = v.integer(mig, path, "max_devices", 0, MAX_MIG)
    profiles = v.typed(mig, path, "profiles", list, True)
    if len(profiles) > MAX_MIG_PROFILES:
        v.fail(v.join(path, "profiles"), f"more than {MAX_MIG_PROFILES} profiles")
    seen: set[int] = set()
    out["profiles"] = []
    for i, prof in enumerate(profiles):
        q = f"{path}.profiles[{i}]"
        if not isinstance(prof, dict):
            v.fail(q, f"expected a mapping, found {v.kind(prof)}")
        v.keys(prof, q, ("nvml_profile", "id", "name", "slices", "instance_count",
                         "multiprocessors", "memory_mb", "copy_engines", "decoders",
                         "encoders", "jpegs", "ofas", "p2p"))
        nvp = v.integer(prof, q, "nvml_profile", 0, NUM_GI_PROFILES - 1)
        if nvp in seen:
            v.fail(v.join(q, "nvml_profile"), f"duplicate nvml_profile {nvp}")
        seen.add(nvp)
        v.string(prof, q, "name", LEN_MIG_NAME)
        for key in ("id", "slices", "instance_count", "multiprocessors", "copy_engines",
                    "decoders", "encoders", "jpegs", "ofas", "p2p"):
            v.integer(prof, q, key, 0, 1 if key == "p2p" else U32)
        v.integer(prof, q, "memory_mb", 0, I64)
        out["profiles"].append(dict(prof))
    instances = mig.get("instances")
    out["instances"] = []
    if instances is None and "instances" not in mig:
        return out
    p = f"{path}.instances"
    if not isinstance(instances, list):
        v.fail(p, f"expected a sequence, found {v.kind(instances)}")
    if instances and out["mode"] != "enabled":
        v.fail(p, "MIG instances need mode: enabled")
    if len(instances) > out["max_devices"]:
        v.fail(p, f"{len(instances)} instances but max_devices is {out['max_devices']}")
    pairs: set[tuple[int, int]] = set()
    for i, inst in enumerate(instances):
        q = f"{path}.instances[{i}]"
        if not isinstance(inst, dict):
            v.fail(q, f"expected a mapping, found {v.kind(inst)}")
        v.keys(inst, q, ("gi", "ci", "profile", "uuid", "compute_slices"))
        gi = v.integer(inst, q, "gi", 0, U32 - 1)
        ci = v.integer(inst, q, "ci", 0, MAX_CI - 1)
        if (gi, ci) in pairs:
            v.fail(q, f"duplicate gi {gi} / ci {ci}")
        pairs.add((gi, ci))
        prof = v.integer(inst, q, "profile", 0, NUM_GI_PROFILES - 1)
        if prof not in seen:
            v.fail(v.join(q, "profile"), f"no entry in profiles has nvml_profile {prof}")
        uid = v.string(inst, q, "uuid", LEN_NAME)
        if not uid.startswith("MIG-"):
            v.fail(v.join(q, "uuid"), "must start with 'MIG-'")
        if "compute_slices" in inst:  # a compute instance smaller than its GPU instance
            slices = next(p["slices"] for p in out["profiles"] if p["nvml_profile"] == prof)
            v.integer(inst, q, "compute_slices", 1, slices)
        out["instances"].append(dict(inst))
    if not instances_fit(out["profiles"], out["instances"]):
        v.fail(p, "they do not fit the placements of their profiles (docs/simulator.md)")
    return out


def _pow2_at_least(x: int) -> int:
    p = 1
    while p < x:
        p <<= 1
    return p


def gi_placements(profiles: list[dict]) -> dict[int, tuple[list[int], int]]:
    """{nvml_profile: (starts, size)}: where a GPU instance of each profile may sit, in memory
    slices, derived as the library derives them (agent/sim/nvml/mig.c, docs/simulator.md):
    NVIDIA's tables for A100, H100 and A30."""
    cs = max((p["slices"] for p in profiles), default=0)
    mem = max((p["memory_mb"] for p in profiles), default=0)
    ms = min(_pow2_at_least(cs or 1), MAX_MEM_SLICES)
    out = {}
    for p in profiles:
        share = (p["memory_mb"] * ms + mem // 2) // mem if mem else 1
        size = min(_pow2_at_least(max(p["slices"], share)), ms)
        out[p["nvml_profile"]] = ([s for s in range(0, ms, size)
                                   if s + size <= ms and s + p["slices"] <= cs], size)
    return out


def _place(items: list[tuple[list[int], int]], used: int = 0) -> bool:
    """Whether items (starts, size) can each take one of their starts without overlap."""
    if not items:
        return True
    (starts, size), rest = items[0], items[1:]
    for s in starts:
        span = ((1 << size) - 1) << s
        if not used & span and _place(rest, used | span):
            return True
    return False


def instances_fit(profiles: list[dict], instances: list[dict]) -> bool:
    """Whether MIG `instances` (gi, profile as nvml_profile, compute_slices) fit the placements
    of their GPU instances' profiles, and their compute instances those of the GPU instances."""
    table = gi_placements(profiles)
    slices = {p["nvml_profile"]: p["slices"] for p in profiles}
    gis: dict[int, int] = {}
    for inst in instances:
        gis.setdefault(inst["gi"], inst["profile"])
    if not _place([table[p] for p in gis.values()]):
        return False
    for gi, prof in gis.items():
        gs = slices[prof]
        cis = []
        for inst in instances:
            if inst["gi"] == gi:
                size = min(inst.get("compute_slices") or gs, gs)
                step = _pow2_at_least(size)
                cis.append(([s for s in range(0, gs, step) if s + size <= gs][:MAX_CI], size))
        if not _place(cis):
            return False
    return True


def _validate_gpu(v: _V, gpu: Any, index: int, ngpus: int, nswitches: int) -> dict:
    path = f"gpus[{index}]"
    if not isinstance(gpu, dict):
        v.fail(path, f"expected a mapping, found {v.kind(gpu)}")
    v.keys(gpu, path, ("index", "name", "uuid", "serial", "minor", "pci", "numa_node",
                       "cpu_affinity", "memory", "compute_capability", "multiprocessors",
                       "nvlinks", "supported_events", "mig"))
    idx = v.integer(gpu, path, "index", 0, MAX_GPUS - 1)
    if idx != index:
        v.fail(f"{path}.index", f"is {idx} but the GPU is entry {index} of gpus "
                                f"(indices must be 0, 1, 2, ...)")
    v.string(gpu, path, "name", LEN_NAME)
    if not v.string(gpu, path, "uuid", LEN_NAME).startswith("GPU-"):
        v.fail(f"{path}.uuid", "must start with 'GPU-'")
    v.string(gpu, path, "serial", LEN_SERIAL, required=False)
    v.integer(gpu, path, "minor", 0, U32)
    _validate_pci(v, v.typed(gpu, path, "pci", dict, True), f"{path}.pci", True)
    v.integer(gpu, path, "numa_node", 0, 65535, required=False)
    cpus = v.string(gpu, path, "cpu_affinity", LEN_CPULIST)
    try:
        parse_cpulist(cpus)
    except ValueError as exc:
        v.fail(f"{path}.cpu_affinity", str(exc))
    mem = v.typed(gpu, path, "memory", dict, True)
    v.keys(mem, f"{path}.memory", ("total", "reserved", "used"))
    total, reserved, used = (v.integer(mem, f"{path}.memory", k, 0, I64)
                             for k in ("total", "reserved", "used"))
    if reserved + used > total:
        v.fail(f"{path}.memory", "reserved + used exceed total")
    cc = v.typed(gpu, path, "compute_capability", list, True)
    if len(cc) != 2:
        v.fail(f"{path}.compute_capability", "expected [major, minor]")
    for item in cc:
        v.int_value(item, f"{path}.compute_capability", 0, 255)
    v.integer(gpu, path, "multiprocessors", 0, U32, required=False)
    out = dict(gpu)
    links = gpu.get("nvlinks", [])
    if "nvlinks" in gpu and not isinstance(links, list):
        v.fail(f"{path}.nvlinks", f"expected a sequence, found {v.kind(links)}")
    if len(links) > MAX_LINKS:
        v.fail(f"{path}.nvlinks", f"more than {MAX_LINKS} links")
    for k, link in enumerate(links):
        lp = f"{path}.nvlinks[{k}]"
        if v.kind(link) == "an integer":
            v.int_value(link, lp, 0, ngpus - 1)
            if link == index:
                v.fail(lp, "a GPU cannot link to itself")
        elif isinstance(link, str) and link == "down":
            pass
        elif isinstance(link, str) and link.startswith("switch"):
            num = link[6:]
            if (not num.isdigit() or not num.isascii() or (num.startswith("0") and len(num) > 1)
                    or int(num) >= nswitches):
                v.fail(lp, f"'{link}' names no entry of nvswitches (have {nswitches})")
        else:
            v.fail(lp, "expected a GPU index, 'switchN' or 'down'")
    out["nvlinks"] = list(links)
    v.integer(gpu, path, "supported_events", 0, I64)
    if "mig" in gpu:
        mig = v.typed(gpu, path, "mig", dict, True)
        out["mig"] = _validate_mig(v, mig, f"{path}.mig")
    return out


def _code_from_name(value: Any) -> int | None:
    if isinstance(value, str):
        name = value[len("NVML_ERROR_"):] if value.startswith("NVML_ERROR_") else value
        code = NVML_CODES.get(name)
        return code if code else None
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 999:
        return value
    return None


def _validate_faults(v: _V, faults: Any, ngpus: int) -> dict:
    if not isinstance(faults, dict):
        v.fail("faults", f"expected a mapping, found {v.kind(faults)}")
    v.keys(faults, "faults", ("init", "events_unsupported", "lost"))
    out: dict[str, Any] = {}
    if "init" in faults:
        if _code_from_name(faults["init"]) is None:
            v.fail("faults.init", "expected an NVML error name such as DRIVER_NOT_LOADED")
        out["init"] = faults["init"]
    for key in ("events_unsupported", "lost"):
        if key not in faults:
            continue
        items = faults[key]
        if not isinstance(items, list):
            v.fail(f"faults.{key}", f"expected a sequence of GPU indices, found {v.kind(items)}")
        for i, item in enumerate(items):
            v.int_value(item, f"faults.{key}[{i}]", 0, ngpus - 1)
        out[key] = list(items)
    return out


def validate_profile(data: Any, source: str = "<profile>") -> dict[str, Any]:
    """Check `data` (parsed YAML) against the schema; return it normalized.

    Normalized: every GPU has `nvlinks` (possibly []), every `mig` has `pending_mode` and
    `instances`. Raises SimError naming the file and the key path of the first problem.
    """
    v = _V(source)
    if not isinstance(data, dict):
        v.fail("(top level)", f"expected a mapping, found {v.kind(data)}")
    v.keys(data, "", ("schema", "name", "description", "source", "driver_version",
                      "nvml_version", "cuda_driver_version", "nvswitches", "gpus",
                      "pcie_topology", "faults"))
    v.integer(data, "", "schema", SCHEMA, SCHEMA)
    v.string(data, "", "name", LEN_NAME)
    v.string(data, "", "description", LEN_TEXT)
    v.string(data, "", "source", LEN_TEXT)
    v.string(data, "", "driver_version", LEN_VERSION)
    v.string(data, "", "nvml_version", LEN_VERSION)
    v.integer(data, "", "cuda_driver_version", 0, 2**31 - 1)
    out = dict(data)
    switches = data.get("nvswitches", [])
    if "nvswitches" in data:
        switches = v.typed(data, "", "nvswitches", list, True)
        if len(switches) > MAX_SWITCHES:
            v.fail("nvswitches", f"more than {MAX_SWITCHES} switches")
        for i, sw in enumerate(switches):
            if not isinstance(sw, dict):
                v.fail(f"nvswitches[{i}]", f"expected a mapping, found {v.kind(sw)}")
            _validate_pci(v, sw, f"nvswitches[{i}]", False)
    out["nvswitches"] = [dict(s) for s in switches]
    gpus = v.typed(data, "", "gpus", list, True)
    if not 1 <= len(gpus) <= MAX_GPUS:
        v.fail("gpus", f"must list 1 to {MAX_GPUS} GPUs")
    out["gpus"] = [_validate_gpu(v, g, i, len(gpus), len(switches)) for i, g in enumerate(gpus)]
    ngpus = len(gpus)
    mig_uuids: set[str] = set()
    for i, g in enumerate(out["gpus"]):
        for j in range(i):
            o = out["gpus"][j]
            if g["uuid"] == o["uuid"]:
                v.fail(f"gpus[{i}]", f"uuid {g['uuid']} repeats gpus[{j}]")
            if parse_bus_id(g["pci"]["bus_id"]) == parse_bus_id(o["pci"]["bus_id"]):
                v.fail(f"gpus[{i}]", f"pci.bus_id repeats gpus[{j}]")
            if g["minor"] == o["minor"]:
                v.fail(f"gpus[{i}]", f"minor {g['minor']} repeats gpus[{j}]")
        for m, inst in enumerate(g.get("mig", {}).get("instances", [])):
            if inst["uuid"] in mig_uuids:
                v.fail(f"gpus[{i}].mig.instances[{m}].uuid", "repeats another MIG device's uuid")
            mig_uuids.add(inst["uuid"])
    for i, g in enumerate(out["gpus"]):
        for j, o in enumerate(out["gpus"]):
            ij = sum(1 for x in g["nvlinks"] if _is_index(x) and x == j)
            ji = sum(1 for x in o["nvlinks"] if _is_index(x) and x == i)
            if ij != ji:
                v.fail(f"gpus[{i}].nvlinks",
                       f"{ij} links to GPU {j} but GPU {j} has {ji} links back")
    topo = v.typed(data, "", "pcie_topology", list, True)
    if len(topo) != ngpus:
        v.fail("pcie_topology", f"has {len(topo)} rows for {ngpus} GPUs")
    for i, row in enumerate(topo):
        if not isinstance(row, list) or len(row) != ngpus:
            v.fail(f"pcie_topology[{i}]", f"expected a row of {ngpus} levels")
        for j, cell in enumerate(row):
            q = f"pcie_topology[{i}][{j}]"
            if not isinstance(cell, str) or cell not in LEVELS:
                v.fail(q, "expected one of X PIX PXB PHB NODE SYS")
            if (cell == "X") != (i == j):
                v.fail(q, "the diagonal must be X" if i == j else "X is only for the diagonal")
    for i in range(ngpus):
        for j in range(i):
            if topo[i][j] != topo[j][i]:
                v.fail(f"pcie_topology[{i}][{j}]",
                       f"differs from pcie_topology[{j}][{i}] (must be symmetric)")
    out["pcie_topology"] = [list(r) for r in topo]
    if "faults" in data:
        out["faults"] = _validate_faults(v, data["faults"], ngpus)
    return out


def _is_index(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_faults_env(text: str, ngpus: int) -> dict[str, Any]:
    """GPU_AGENT_SIM_FAULTS ('init=DRIVER_NOT_LOADED,events_unsupported=3+5') as a faults dict."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SimError(f"GPU_AGENT_SIM_FAULTS: {item!r} is not KEY=VALUE")
        if key == "init":
            code = int(value) if value.isdigit() else _code_from_name(value)
            if not code or code > 999:
                raise SimError(f"GPU_AGENT_SIM_FAULTS: init={value} is not an NVML error name "
                               f"such as DRIVER_NOT_LOADED")
            out["init"] = value
        elif key in ("events_unsupported", "lost"):
            parts = value.split("+") if value else []
            if not all(p.isdigit() and int(p) < ngpus for p in parts):
                raise SimError(f"GPU_AGENT_SIM_FAULTS: {key}={value} is not GPU indices below "
                               f"{ngpus} joined by '+'")
            out[key] = [int(p) for p in parts]
        else:
            raise SimError(f"GPU_AGENT_SIM_FAULTS: unknown key {key!r} "
                           f"(init, events_unsupported, lost)")
    return out


def nvml_view(profile: dict[str, Any]) -> dict[str, Any]:
    """The part of a (normalized) profile NVML can read back: no name/description/source/faults."""
    view = json.loads(json.dumps({k: v for k, v in profile.items()
                                  if k not in ("name", "description", "source", "faults")}))
    for gpu in view["gpus"]:
        if "mig" in gpu:  # NVML answers profiles by number: their order is not observable
            gpu["mig"]["profiles"].sort(key=lambda p: p["nvml_profile"])
    return view


# ---------------------------------------------------------------------------------------
# Writing (the YAML subset the C parser reads)
# ---------------------------------------------------------------------------------------

def _q(text: str) -> str:
    """A double-quoted YAML scalar (JSON escaping is valid YAML, and the C parser reads it)."""
    return json.dumps(text, ensure_ascii=True)


def _flow(items: list) -> str:
    return "[" + ", ".join(str(i) for i in items) + "]"


def dump_profile(profile: dict[str, Any]) -> str:
    """The canonical text of a profile: strings quoted, ids in hex, flow rows, no flow maps."""
    o: list[str] = [
        "# gpu-agent simulated node profile. Schema and YAML subset: docs/simulator.md.",
        f"schema: {SCHEMA}",
        f"name: {_q(profile['name'])}",
        f"description: {_q(profile['description'])}",
        f"source: {_q(profile['source'])}",
        f"driver_version: {_q(profile['driver_version'])}",
        f"nvml_version: {_q(profile['nvml_version'])}",
        f"cuda_driver_version: {profile['cuda_driver_version']}",
    ]
    if profile.get("nvswitches"):
        o.append("nvswitches:")
        for sw in profile["nvswitches"]:
            o.append(f"  - bus_id: {_q(sw['bus_id'])}")
            o.append(f"    device_id: 0x{sw['device_id']:08X}")
    o.append("gpus:")
    for g in profile["gpus"]:
        o.append(f"  - index: {g['index']}")
        o.append(f"    name: {_q(g['name'])}")
        o.append(f"    uuid: {_q(g['uuid'])}")
        if "serial" in g:
            o.append(f"    serial: {_q(g['serial'])}")
        o.append(f"    minor: {g['minor']}")
        o.append("    pci:")
        o.append(f"      bus_id: {_q(g['pci']['bus_id'])}")
        o.append(f"      device_id: 0x{g['pci']['device_id']:08X}")
        o.append(f"      subsystem_id: 0x{g['pci']['subsystem_id']:08X}")
        if "numa_node" in g:
            o.append(f"    numa_node: {g['numa_node']}")
        o.append(f"    cpu_affinity: {_q(g['cpu_affinity'])}")
        o.append("    memory:")
        for key in ("total", "reserved", "used"):
            o.append(f"      {key}: {g['memory'][key]}")
        o.append(f"    compute_capability: {_flow(list(g['compute_capability']))}")
        if "multiprocessors" in g:
            o.append(f"    multiprocessors: {g['multiprocessors']}")
        if g.get("nvlinks"):
            o.append(f"    nvlinks: {_flow(g['nvlinks'])}")
        o.append(f"    supported_events: 0x{g['supported_events']:X}")
        if "mig" in g:
            mig = g["mig"]
            o.append("    mig:")
            o.append(f"      mode: {mig['mode']}")
            if mig.get("pending_mode", mig["mode"]) != mig["mode"]:
                o.append(f"      pending_mode: {mig['pending_mode']}")
            o.append(f"      max_devices: {mig['max_devices']}")
            o.append("      profiles:")
            for p in mig["profiles"]:
                o.append(f"        - nvml_profile: {p['nvml_profile']}")
                o.append(f"          id: {p['id']}")
                o.append(f"          name: {_q(p['name'])}")
                for key in ("slices", "instance_count", "multiprocessors", "memory_mb",
                            "copy_engines", "decoders", "encoders", "jpegs", "ofas", "p2p"):
                    o.append(f"          {key}: {p[key]}")
            if mig.get("instances"):
                o.append("      instances:")
                for m in mig["instances"]:
                    o.append(f"        - gi: {m['gi']}")
                    o.append(f"          ci: {m['ci']}")
                    o.append(f"          profile: {m['profile']}")
                    o.append(f"          uuid: {_q(m['uuid'])}")
                    if "compute_slices" in m:
                        o.append(f"          compute_slices: {m['compute_slices']}")
    o.append("pcie_topology:")
    for i, row in enumerate(profile["pcie_topology"]):
        o.append(f"  - {_flow(row)}  # GPU{i}")
    faults = profile.get("faults")
    if faults:
        o.append("faults:")
        if "init" in faults:
            init = faults["init"]
            o.append(f"  init: {init if _is_index(init) else _q(init)}")
        for key in ("events_unsupported", "lost"):
            if key in faults:
                o.append(f"  {key}: {_flow(faults[key])}")
    return "\n".join(o) + "\n"


# ---------------------------------------------------------------------------------------
# From `nvidia-smi topo -m`
# ---------------------------------------------------------------------------------------

_TRAILING = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_CELL_RE = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)$")


class TopoMatrix:
    """The GPU part of an `nvidia-smi topo -m` text: cells, CPU affinity and NUMA columns."""

    def __init__(self, cells: list[list[str]], cpu: list[str], numa: list[str],
                 source: str = "", system: str = ""):
        self.cells = cells
        self.cpu = cpu
        self.numa = numa
        self.source = source
        self.system = system

    @property
    def n(self) -> int:
        return len(self.cells)


def parse_topo(text: str, where: str = "<topo>") -> TopoMatrix:
    """Parse `nvidia-smi topo -m` output (tabs or spaces, empty cells, NIC columns ignored).

    Columns are matched by order, not by screen position (nvidia-smi pads with tabs, and
    copies from terminals shift them): a row's first values are its GPU cells, then one
    value per NIC column, then the trailing columns (CPU Affinity, NUMA Affinity, GPU NUMA
    ID). A row with fewer trailing values than trailing columns is missing the leftmost ones
    (CPU Affinity is the one published blank; NUMA columns say N/A rather than nothing).
    """
    source = system = ""
    lines: list[str] = []
    for raw in text.splitlines():
        if raw.startswith("# source:"):
            source = raw[len("# source:"):].strip()
        elif raw.startswith("# system:"):
            system = raw[len("# system:"):].strip()
        elif not raw.lstrip().startswith("#"):
            lines.append(raw.rstrip())
    header_at = next((k for k, line in enumerate(lines) if re.search(r"\bGPU0\b", line)), None)
    if header_at is None:
        raise SimError(f"{where}: no header line with GPU0 (is this `nvidia-smi topo -m` output?)")
    header = lines[header_at]
    splitter = r"\t" if "\t" in header else r"\s{2,}"
    names = [c.strip() for c in re.split(splitter, header.strip()) if c.strip()]
    gpu_names = [c for c in names if re.fullmatch(r"GPU\d+", c)]
    n = len(gpu_names)
    if names[:n] != [f"GPU{i}" for i in range(n)]:
        raise SimError(f"{where}: header does not start with the columns GPU0..GPU{n - 1}")
    trailing_names = [c for c in names[n:] if c in _TRAILING]
    nics = len(names) - n - len(trailing_names)
    if names[n + nics:] != trailing_names:
        raise SimError(f"{where}: header columns after {', '.join(_TRAILING)} are not understood")
    matrix: list[list[str]] = []
    cpu: list[str] = []
    numa: list[str] = []
    seen: list[int] = []
    for line in lines[header_at + 1:]:
        tokens = line.split()
        if not tokens:
            if seen:
                break
            continue
        m = re.fullmatch(r"GPU(\d+)", tokens[0])
        if not m:
            if seen and tokens[0] in ("Legend:", "Legend", "NIC"):
                break
            continue  # NIC rows and other lines
        idx = int(m.group(1))
        if idx != len(seen):
            raise SimError(f"{where}: row GPU{idx} where GPU{len(seen)} was expected")
        seen.append(idx)
        values = tokens[1:]
        if len(values) < n + nics:
            raise SimError(f"{where}: GPU{idx} row has {len(values)} values; expected at least "
                           f"{n} GPU cells and {nics} NIC cells")
        cells = values[:n]
        extra = values[n + nics:]
        if len(extra) > len(trailing_names):
            raise SimError(f"{where}: GPU{idx} row has {len(extra)} values after the link cells "
                           f"but the header has {len(trailing_names)} columns for them")
        extra = [""] * (len(trailing_names) - len(extra)) + extra
        trailing = dict(zip(trailing_names, extra))
        for j, cell in enumerate(cells):
            if not _CELL_RE.match(cell):
                raise SimError(f"{where}: GPU{idx} row, GPU{j} column: {cell!r} is not a link "
                               f"code (X, NV#, PIX, PXB, PHB, NODE, SYS)")
        matrix.append(["SYS" if c == "SOC" else c for c in cells])
        cpu.append(trailing.get("CPU Affinity", ""))
        numa.append(trailing.get("NUMA Affinity", ""))
    if len(seen) != n:
        raise SimError(f"{where}: expected rows GPU0..GPU{n - 1}, found {len(seen)}")
    for i in range(n):
        for j in range(n):
            if (matrix[i][j] == "X") != (i == j):
                raise SimError(f"{where}: GPU{i}/GPU{j}: X must be exactly the diagonal")
            if matrix[i][j] != matrix[j][i]:
                raise SimError(f"{where}: GPU{i}/GPU{j} is {matrix[i][j]} but GPU{j}/GPU{i} is "
                               f"{matrix[j][i]}")
    return TopoMatrix(matrix, cpu, numa, source, system)


def _nv(cell: str) -> int:
    return int(cell[2:]) if cell.startswith("NV") else 0


def _uuid_for(key: str) -> str:
    return str(uuid.uuid5(_UUID_NS, key))


def _serial_for(key: str) -> str:
    digest = int(hashlib.sha256(key.encode()).hexdigest(), 16)
    return f"1{digest % 10**12:012d}"


def gpu_bus_id(index: int) -> str:
    """The deterministic PCI bus id generated profiles give GPU `index`."""
    value = 0x10 + 0x10 * index
    return format_bus_id(value >> 8, value & 0xFF, 0)


def switch_bus_id(index: int) -> str:
    """Generated NVSwitches live in PCI domain 1, away from every generated GPU."""
    return format_bus_id(1, 0x10 + index, 0)


def _model(name: str | None) -> tuple[str, dict[str, Any]]:
    if not name:
        return GENERIC_MODEL, GENERIC
    for known, props in GPU_MODELS.items():
        if known.lower() == name.lower():
            return known, props
    return name, GENERIC


def profile_from_topo(text: str, name: str, gpu_model: str | None = None,
                      where: str = "<topo>") -> dict[str, Any]:
    """A profile for the node an `nvidia-smi topo -m` text describes (rules: docs/simulator.md).

    NVLinks: a GPU whose NV# counts sum to more than 18 is on an NVSwitch fabric; two fabric
    GPUs reach each other through it (each gets max NV# links, dealt over 4 switches), every
    other NV# pair gets that many direct links on both ends. PCIe level of an NV# pair: NODE
    when the GPUs share a NUMA node or CPU affinity, else SYS. NUMA node: the NUMA Affinity
    column when numeric, else the index of the GPU's distinct CPU-affinity group.
    """
    if not _NAME_RE.match(name):
        raise SimError(f"--name {name!r}: use letters, digits, '.', '_' and '-'")
    topo = parse_topo(text, where)
    n = topo.n
    if n > MAX_GPUS:
        raise SimError(f"{where}: {n} GPUs; the simulator holds at most {MAX_GPUS}")
    model_name, model = _model(gpu_model)

    numa: list[int | None] = []
    groups: list[str] = []
    for i in range(n):
        cpu = topo.cpu[i]
        try:
            parse_cpulist(cpu)
        except ValueError as exc:
            raise SimError(f"{where}: GPU{i} CPU Affinity {cpu!r}: {exc}") from None
        if topo.numa[i].isdigit():
            numa.append(int(topo.numa[i]))
        elif cpu:
            if cpu not in groups:
                groups.append(cpu)
            numa.append(groups.index(cpu))
        else:
            numa.append(None)

    nv = [[_nv(c) for c in row] for row in topo.cells]
    fabric = [sum(row) > NVSWITCH_RULE_LINKS for row in nv]
    fabric_links = [max((nv[i][j] for j in range(n) if fabric[j] and j != i), default=0)
                    if fabric[i] else 0 for i in range(n)]
    nvlinks: list[list[Any]] = []
    used_switches = 0
    for i in range(n):
        links: list[Any] = []
        for k in range(fabric_links[i]):
            links.append(f"switch{k % SWITCHES_PER_FABRIC}")
            used_switches = max(used_switches, k % SWITCHES_PER_FABRIC + 1)
        for j in range(n):
            if nv[i][j] and not (fabric[i] and fabric[j]):
                links.extend([j] * nv[i][j])
        if len(links) > MAX_LINKS:
            raise SimError(f"{where}: GPU{i} would need {len(links)} NVLinks; the simulator "
                           f"models at most {MAX_LINKS}")
        nvlinks.append(links)
    for i in range(n):  # the rule must reproduce the matrix exactly
        for j in range(n):
            if i == j:
                continue
            got = nvlinks[i].count(j)
            if fabric[i] and fabric[j]:
                got += min(fabric_links[i], fabric_links[j])
            if got != nv[i][j]:
                raise SimError(
                    f"{where}: GPU{i}/GPU{j} is {topo.cells[i][j]} but the NVSwitch rule "
                    f"(> {NVSWITCH_RULE_LINKS} links in all => switched) would read back "
                    f"{f'NV{got}' if got else 'no NVLink'}; this matrix cannot be simulated")

    def same_node(i: int, j: int) -> bool:
        return ((numa[i] is not None and numa[i] == numa[j])
                or (topo.cpu[i] != "" and topo.cpu[i] == topo.cpu[j]))

    pcie = [["X" if i == j else (("NODE" if same_node(i, j) else "SYS") if nv[i][j]
                                 else topo.cells[i][j]) for j in range(n)] for i in range(n)]

    gpus = []
    for i in range(n):
        gpu: dict[str, Any] = {
            "index": i,
            "name": model_name,
            "uuid": "GPU-" + _uuid_for(f"{name}/gpu{i}"),
            "serial": _serial_for(f"{name}/gpu{i}"),
            "minor": i,
            "pci": {"bus_id": gpu_bus_id(i), "device_id": model["device_id"],
                    "subsystem_id": model["subsystem_id"]},
        }
        if numa[i] is not None:
            gpu["numa_node"] = numa[i]
        gpu["cpu_affinity"] = topo.cpu[i]
        gpu["memory"] = {"total": model["memory"], "reserved": 0, "used": 0}
        gpu["compute_capability"] = list(model["cc"])
        gpu["multiprocessors"] = model["multiprocessors"]
        gpu["nvlinks"] = nvlinks[i]
        gpu["supported_events"] = model["events"]
        if model.get("mig"):
            gpu["mig"] = {"mode": "disabled", "pending_mode": "disabled", "max_devices": 7,
                          "profiles": [dict(p) for p in model["mig"]], "instances": []}
        gpus.append(gpu)

    system = f": {topo.system}" if topo.system else ""
    profile = {
        "schema": SCHEMA,
        "name": name,
        "description": f"Generated by `gpu-agent sim profile --from-topo` from {where}{system}",
        "source": topo.source or where,
        **DEFAULT_VERSIONS,
        "nvswitches": [{"bus_id": switch_bus_id(k), "device_id": NVSWITCH_DEVICE_ID}
                       for k in range(used_switches)],
        "gpus": gpus,
        "pcie_topology": pcie,
    }
    return validate_profile(profile, f"generated from {where}")


def topo_link_matrix(profile: dict[str, Any]) -> list[list[str]]:
    """The `nvidia-smi topo -m` GPU matrix a profile reads back as (NV# first, else PCIe)."""
    gpus = profile["gpus"]
    n = len(gpus)
    switch_links = [sum(1 for x in g["nvlinks"] if isinstance(x, str) and x.startswith("switch"))
                    for g in gpus]
    out = []
    for i in range(n):
        row = []
        for j in range(n):
            if i == j:
                row.append("X")
                continue
            count = sum(1 for x in gpus[i]["nvlinks"] if _is_index(x) and x == j)
            if switch_links[i] and switch_links[j]:
                count += min(switch_links[i], switch_links[j])
            row.append(f"NV{count}" if count else profile["pcie_topology"][i][j])
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------
# Recording a node through NVML
# ---------------------------------------------------------------------------------------

def record_profile(nvml_library: str | None = None, name: str | None = None) -> dict[str, Any]:
    """The profile of the node NVML sees: the real driver's library, or the simulator.

    Fields that answer NOT_SUPPORTED are left out (serial, NUMA node, multiprocessors, MIG)
    or empty (NVLinks). Raises SimError when NVML cannot be opened or initialised.
    """
    import pynvml

    from agent.errors import AgentError
    from agent.nvml import library

    path = library.resolve_library_path("/", nvml_library)
    try:
        library.init(path)
    except AgentError as exc:
        raise SimError(f"cannot record: NVML at {path}: {exc}") from exc
    try:
        return _record(pynvml, name or socket.gethostname().split(".")[0] or "recorded")
    except pynvml.NVMLError as exc:
        raise SimError(f"cannot record: {exc}") from exc
    finally:
        library.shutdown()


def _optional(fn, *args, default=None):
    """fn(*args), or `default` when NVML says the query is not supported on this device."""
    import pynvml

    try:
        return fn(*args)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound,
            pynvml.NVMLError_InvalidArgument):
        return default


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _record(pynvml: Any, name: str) -> dict[str, Any]:
    if not _NAME_RE.match(name):
        name = re.sub(r"[^A-Za-z0-9._-]", "-", name) or "recorded"
    cuda = _optional(pynvml.nvmlSystemGetCudaDriverVersion_v2)
    if cuda is None:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
    count = pynvml.nvmlDeviceGetCount()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    bus_ids = [_text(pynvml.nvmlDeviceGetPciInfo(h).busId) for h in handles]
    bus_index = {parse_bus_id(b): i for i, b in enumerate(bus_ids)}
    switches: list[dict[str, Any]] = []
    gpus = []
    for i, h in enumerate(handles):
        gpus.append(_record_gpu(pynvml, i, h, bus_index, switches))
    pcie = []
    for i, a in enumerate(handles):
        row = []
        for j, b in enumerate(handles):
            if i == j:
                row.append("X")
                continue
            level = pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b)
            if level == 0:
                log.warning("GPU%d/GPU%d share a board (INTERNAL); recorded as PIX", i, j)
                level = 10
            row.append(LEVEL_NAMES.get(level, "SYS"))
        pcie.append(row)
    profile = {
        "schema": SCHEMA,
        "name": name,
        "description": f"Recorded with `gpu-agent sim record` on {socket.gethostname()}",
        "source": "gpu-agent sim record",
        "driver_version": _text(pynvml.nvmlSystemGetDriverVersion()),
        "nvml_version": _text(pynvml.nvmlSystemGetNVMLVersion()),
        "cuda_driver_version": cuda,
        "nvswitches": switches,
        "gpus": gpus,
        "pcie_topology": pcie,
    }
    return validate_profile(profile, "recorded profile")


def _record_gpu(pynvml: Any, i: int, h: Any, bus_index: dict, switches: list) -> dict[str, Any]:
    pci = pynvml.nvmlDeviceGetPciInfo(h)
    gpu: dict[str, Any] = {
        "index": i,
        "name": _text(pynvml.nvmlDeviceGetName(h)),
        "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
    }
    serial = _optional(pynvml.nvmlDeviceGetSerial, h)
    if serial is not None:
        gpu["serial"] = _text(serial)
    gpu["minor"] = pynvml.nvmlDeviceGetMinorNumber(h)
    gpu["pci"] = {"bus_id": _text(pci.busId), "device_id": pci.pciDeviceId,
                  "subsystem_id": pci.pciSubSystemId}
    numa = _optional(pynvml.nvmlDeviceGetNumaNodeId, h)
    if numa is not None and 0 <= numa <= 65535:
        gpu["numa_node"] = numa
    words = MAX_CPUS // 64
    mask = _optional(pynvml.nvmlDeviceGetCpuAffinity, h, words, default=[0] * words)
    gpu["cpu_affinity"] = format_cpulist(
        [w * 64 + b for w in range(words) for b in range(64) if (int(mask[w]) >> b) & 1])
    mem = _optional(pynvml.nvmlDeviceGetMemoryInfo, h, pynvml.nvmlMemory_v2)
    if mem is not None:
        gpu["memory"] = {"total": mem.total, "reserved": mem.reserved, "used": mem.used}
    else:
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        gpu["memory"] = {"total": mem.total, "reserved": 0, "used": mem.used}
    gpu["compute_capability"] = list(pynvml.nvmlDeviceGetCudaComputeCapability(h))
    attrs = _optional(pynvml.nvmlDeviceGetAttributes_v2, h)
    if attrs is not None:
        gpu["multiprocessors"] = attrs.multiprocessorCount
    gpu["nvlinks"] = _record_links(pynvml, i, h, bus_index, switches)
    gpu["supported_events"] = _optional(pynvml.nvmlDeviceGetSupportedEventTypes, h, default=0)
    mig = _record_mig(pynvml, i, h)
    if mig is not None:
        gpu["mig"] = mig
    return gpu


def _record_links(pynvml: Any, i: int, h: Any, bus_index: dict, switches: list) -> list:
    links: list[Any] = []
    for link in range(MAX_LINKS):
        state = _optional(pynvml.nvmlDeviceGetNvLinkState, h, link)
        if state is None:
            links.append(None)
            continue
        if not state:
            links.append("down")
            continue
        remote = _optional(pynvml.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
        kind = _optional(pynvml.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)
        if remote is None:
            links.append("down")
            continue
        bus = _text(remote.busId)
        key = parse_bus_id(bus)
        if kind == pynvml.NVML_NVLINK_DEVICE_TYPE_GPU or (kind is None and key in bus_index):
            if key in bus_index and bus_index[key] != i:
                links.append(bus_index[key])
            else:
                log.warning("GPU%d NVLink %d goes to %s, not a GPU of this node; recorded down",
                            i, link, bus)
                links.append("down")
        elif kind in (pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH, None):
            found = next((k for k, s in enumerate(switches) if parse_bus_id(s["bus_id"]) == key),
                         None)
            if found is None:
                switches.append({"bus_id": format_bus_id(*key), "device_id": remote.pciDeviceId})
                found = len(switches) - 1
            links.append(f"switch{found}")
        else:
            log.warning("GPU%d NVLink %d goes to device type %s; recorded down", i, link, kind)
            links.append("down")
    while links and links[-1] is None:
        links.pop()
    return ["down" if x is None else x for x in links]


def _record_mig(pynvml: Any, i: int, h: Any) -> dict[str, Any] | None:
    modes = _optional(pynvml.nvmlDeviceGetMigMode, h)
    if modes is None:
        return None
    current, pending = modes
    mig: dict[str, Any] = {
        "mode": "enabled" if current else "disabled",
        "pending_mode": "enabled" if pending else "disabled",
        "max_devices": pynvml.nvmlDeviceGetMaxMigDeviceCount(h),
        "profiles": [],
        "instances": [],
    }
    for nvp in range(NUM_GI_PROFILES):
        info = _optional(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, h, nvp)
        if info is None:
            continue
        pname = _text(info.name)
        pname = pname[4:] if pname.startswith("MIG ") else pname
        mig["profiles"].append(dict(
            nvml_profile=nvp, id=info.id, name=pname, slices=info.sliceCount,
            instance_count=info.instanceCount, multiprocessors=info.multiprocessorCount,
            memory_mb=info.memorySizeMB, copy_engines=info.copyEngineCount,
            decoders=info.decoderCount, encoders=info.encoderCount, jpegs=info.jpegCount,
            ofas=info.ofaCount, p2p=info.isP2pSupported))
    for k in range(mig["max_devices"]):
        try:
            mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
        except pynvml.NVMLError_NotFound:
            continue
        attrs = pynvml.nvmlDeviceGetAttributes_v2(mh)
        name = _text(pynvml.nvmlDeviceGetName(mh))

        def score(p: dict, attrs: Any = attrs, name: str = name) -> tuple:
            return (p["slices"] == attrs.gpuInstanceSliceCount
                    and p["memory_mb"] == attrs.memorySizeMB,
                    name.endswith(" " + p["name"]),
                    p["multiprocessors"] == attrs.multiprocessorCount,
                    (p["decoders"], p["jpegs"], p["ofas"]) == (
                        attrs.sharedDecoderCount, attrs.sharedJpegCount, attrs.sharedOfaCount))

        best = max(mig["profiles"], key=score, default=None)
        if best is None or not score(best)[0]:
            log.warning("GPU%d MIG device %d (%s) matches no GPU instance profile; skipped",
                        i, k, name)
            continue
        instance = {
            "gi": pynvml.nvmlDeviceGetGpuInstanceId(mh),
            "ci": pynvml.nvmlDeviceGetComputeInstanceId(mh),
            "profile": best["nvml_profile"],
            "uuid": _text(pynvml.nvmlDeviceGetUUID(mh)),
        }
        if attrs.computeInstanceSliceCount < attrs.gpuInstanceSliceCount:
            instance["compute_slices"] = attrs.computeInstanceSliceCount  # 1c.3g.40gb
        mig["instances"].append(instance)
    return mig


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def _write(text: str, output: str | None) -> None:
    if output and output != "-":
        try:
            Path(output).write_text(text)
        except OSError as exc:
            raise SimError(f"cannot write {output}: {exc.strerror}") from exc
        log.info("wrote %s", output)
    else:
        sys.stdout.write(text)


def _cmd_profile(args: argparse.Namespace) -> int:
    if args.check:
        profile = load_profile(args.check)
        faults = os.environ.get("GPU_AGENT_SIM_FAULTS")
        if faults:
            parse_faults_env(faults, len(profile["gpus"]))
        links = topo_link_matrix(profile)
        print(f"{resolve_profile_path(args.check)}: profile {profile['name']}: "
              f"{len(profile['gpus'])} GPUs ({profile['gpus'][0]['name']})")
        for i, row in enumerate(links):
            print(f"GPU{i}\t" + "\t".join(row))
        return 0
    path = Path(args.from_topo)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SimError(f"cannot read {path}: {exc.strerror}") from exc
    name = args.name or re.sub(r"[^A-Za-z0-9._-]", "-", path.stem)
    profile = profile_from_topo(text, name, args.gpu_model, where=path.name)
    _write(dump_profile(profile), args.output)
    return 0


def _cmd_record(args: argparse.Namespace) -> int:
    profile = record_profile(args.nvml_library, args.name)
    _write(dump_profile(profile), args.output)
    return 0


def add_cli(simsub: argparse._SubParsersAction) -> None:
    """Declare `gpu-agent sim profile` and `gpu-agent sim record`."""
    p = simsub.add_parser("profile", help="build a node profile from `nvidia-smi topo -m`, "
                                          "or check one")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--from-topo", metavar="FILE", help="an `nvidia-smi topo -m` text file")
    what.add_argument("--check", metavar="PROFILE",
                      help="validate a profile (name or path) and print its link matrix")
    p.add_argument("--name", help="profile name (default: the file's stem)")
    p.add_argument("--gpu-model", metavar="M",
                   help=f"GPU name, e.g. 'NVIDIA H100 80GB HBM3' (known: "
                        f"{', '.join(GPU_MODELS)}; default {GENERIC_MODEL})")
    p.add_argument("-o", "--output", help="write here instead of stdout")
    p.set_defaults(func=_cmd_profile)

    p = simsub.add_parser("record", help="write the profile of this node, read through NVML")
    p.add_argument("-o", "--output", help="write here instead of stdout")
    p.add_argument("--nvml-library", metavar="PATH",
                   help="NVML library to read (default: the driver's libnvidia-ml.so.1)")
    p.add_argument("--name", help="profile name (default: the host name)")
    p.set_defaults(func=_cmd_record)
