"""Node feature labels with gpu-feature-discovery's names, and the NFD feature file that holds
them, so that nodeSelectors written for NVIDIA's GFD keep working with gpu-agent.

Owns: `build_labels` (the label dict from the agent's records: a pure function), `node_labels`
(the same, reading what it needs through agent.nvml), and `FeatureFile`, the file NFD's
`local` feature source reads (features.d: `name=value` lines, `#` comments), written
atomically under a dot-name NFD ignores and only when its content changes. Must not import
grpc, talk to kubelet, or decide when the file is written or removed (the daemon's services
do: agent.services); docs/observability.md lists every label.

Every rule is GFD's, read in NVIDIA k8s-device-plugin v0.20.0 (commit 1b826acc6, which
absorbed gpu-feature-discovery); the tags are those of tests/test_labels.py:
- [VERSION] internal/lm/nvml.go newVersionLabeler: the driver version split at "." (2 or 3
  parts; revision "" with 2), CUDA major = v / 1000, minor = v % 1000 / 10; the
  cuda.driver.* and cuda.runtime.* names are GFD's deprecated twins, still written.
- [MIGCAP] nvml.go newMigCapabilityLabeler: true when any GPU answers nvmlDeviceGetMigMode
  (go-nvlib device.go IsMigCapable: NOT_SUPPORTED is false).
- [MPS] nvml.go newSharingLabeler / isMPSCapable: mps.capable is false unless the sharing
  strategy is mps, then true when no GPU has MIG enabled (GFD fails outright there; we say
  false).
- [MODE] nvml.go newGPUModeLabeler / getModeForClasses: one PCI class on every GPU, 0x030000
  graphics, 0x030200 compute, anything else or unreadable "unknown".
- [MACHINE] internal/lm/machine-type.go: the DMI product name, sanitised; "unknown" when
  unreadable.
- [FULL] internal/lm/mig-strategy.go newGPULabelers + resource.go NewGPUResourceLabeler: per
  product name, nvidia.com/gpu.{product,count,replicas,sharing-strategy,memory,family,
  compute.major,compute.minor}; the count is every GPU of that name, MIG-enabled or not; a
  MIG-enabled GPU's labels carry no sharing (replicas 0), a full GPU's the config's, and the
  full GPUs' labels are written over the MIG-enabled ones'. memory is total MiB (left out
  when 0); family and compute are left out when the compute major is 0.
- [FAMILY] resource.go getArchFamily.
- [SANITISE] resource.go sanitise: drop every character but [A-Za-z0-9-_. ], then runs of
  spaces become one "-"; getProductName joins the parts with "-".
- [SHARING] resource.go baseLabeler / getReplicas / isShared / isRenamed with
  api/config/v1/sharing.go SharingStrategy + ReplicatedResources and replicas.go
  disableResoureRenaming: the replicas of the resource's sharing entry (1 without one), the
  sharing strategy when they are > 1 ("none" otherwise), and "-SHARED" after the product
  when they are > 1 and renameByDefault is off.
- [STRATEGY] internal/lm/strategy.go: nvidia.com/mig.strategy unless the strategy is none.
- [MIXED] mig-strategy.go newMigStrategyMixedLabeler + resource.go NewMIGResourceLabeler:
  per MIG profile name ("+" written ".", internal/resource/nvml-mig-device.go GetName),
  nvidia.com/mig-<name>.{product,count,replicas,sharing-strategy} and the device attributes
  {memory,multiprocessors,slices.gi,slices.ci,engines.copy,engines.decoder,engines.encoder,
  engines.jpeg,engines.ofa} (nvml-mig-device.go GetAttributes); product is
  <model>-MIG-<name>.
- [SINGLE] mig-strategy.go newMigStrategySingleLabeler: with one MIG profile on every GPU the
  same labels under nvidia.com/gpu, over the full-GPU ones; no MIG-enabled GPU: none.
- [INVALID] mig-strategy.go newInvalidMigStrategyLabeler: a MIG-enabled GPU without MIG
  devices, MIG-enabled beside MIG-disabled GPUs, or two profiles: product
  <model>-MIG-INVALID, count 0, replicas 0, sharing-strategy "", memory 0.
- [EMPTY] nvml.go NewDeviceLabeler: no GPUs, no labels.
Left out (docs/observability.md says why): nvidia.com/gfd.timestamp, nvidia.com/vgpu.*,
nvidia.com/gpu.clique.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agent.config import Config
from agent.errors import AgentError
from agent.fileio import fsync_dir, write_atomic
from agent.nvml import driver as nvml_driver
from agent.nvml import mig as nvml_mig
from agent.nvml import system_info
from agent.nvml.discovery import Gpu
from agent.nvml.driver import DriverInfo
from agent.nvml.mig import MigDevice
from agent.nvml.system_info import NodeFacts
from agent.rm.devices import RESOURCE_GPU

log = logging.getLogger(__name__)

GPU = RESOURCE_GPU  # GFD's fullGPUResourceName: its labels ignore resources.gpus renames
MIG_PREFIX = "nvidia.com/mig-"
UNKNOWN = "unknown"
_PCI_GRAPHICS = 0x030000  # go-nvlib nvpci PCIVgaControllerClass
_PCI_COMPUTE = 0x030200  # PCI3dControllerClass

# [FAMILY] by compute capability major; 7 and 8 split by minor below.
_FAMILIES = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper",
             10: "blackwell", 12: "blackwell", 13: "rubin"}

FILE_MODE = 0o644  # GFD writes 0644 (internal/lm/output.go); NFD only reads it
DIR_MODE = 0o755  # features.d when the agent creates it: NFD's worker reads it
# The file's first line. NFD skips `#` lines; `# +` starts a directive, so this must not.
HEADER = b"# Node labels with gpu-feature-discovery's names, kept by gpu-agent " \
         b"(docs/observability.md). Do not edit: rewritten when the GPUs change.\n"


def sanitise(text: str) -> str:
    """[SANITISE]: "NVIDIA A100-SXM4-80GB" -> "NVIDIA-A100-SXM4-80GB"."""
    return "-".join(re.sub(r"[^A-Za-z0-9\-_. ]", "", text).split())


def arch_family(major: int, minor: int) -> str:
    """[FAMILY]: the architecture family of a compute capability."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return _FAMILIES.get(major, "undefined")


def mig_name(profile: str) -> str:
    """A MIG profile as GFD names it (nvml-mig-device.go GetName): "1g.10gb+me" -> "1g.10gb.me"."""
    return profile.replace("+", ".")


class _Sharing:
    """[SHARING]: what the `sharing` section says about one resource name, as GFD reads it."""

    def __init__(self, sharing: Any):
        replicated = sharing.mps if sharing.mps is not None else sharing.time_slicing
        self._by_name = {r.name: r for r in (replicated.resources if replicated else ())}
        self._rename = bool(replicated and replicated.rename_by_default)
        if sharing.mps is not None and any(r.replicas > 1 for r in sharing.mps.resources):
            self.strategy = "mps"
        elif sharing.time_slicing is not None and \
                any(r.replicas > 1 for r in sharing.time_slicing.resources):
            self.strategy = "time-slicing"
        else:
            self.strategy = "none"

    def replicas(self, resource: str) -> int:
        r = self._by_name.get(resource)
        return r.replicas if r is not None and r.replicas > 0 else 1

    def suffix(self, resource: str) -> bool:
        """Whether the product takes "-SHARED": replicated, and not renamed (NVIDIA's config
        keeps a rename only as renameByDefault's <name>.shared)."""
        return self.replicas(resource) > 1 and not self._rename


def _product(parts: Sequence[str], shared: bool = False) -> str:
    words = [sanitise(p) for p in parts if p]
    if words and shared:
        words.append("SHARED")
    return "-".join(words)


def _base(resource: str, count: int, parts: Sequence[str], sharing: _Sharing | None) -> dict:
    """resource.go baseLabeler: product, count, replicas, sharing-strategy of `resource`
    (`sharing` None: a labeler built without the config, replicas 0)."""
    replicas = 0 if sharing is None else sharing.replicas(resource)
    strategy = sharing.strategy if sharing is not None and replicas > 1 else "none"
    shared = sharing is not None and sharing.suffix(resource)
    return {f"{resource}.product": _product(parts, shared), f"{resource}.count": str(count),
            f"{resource}.replicas": str(replicas), f"{resource}.sharing-strategy": strategy}


def _full_gpu(gpu: Gpu, count: int, sharing: _Sharing | None) -> dict:
    """[FULL] NewGPUResourceLabeler for the GPUs named like `gpu`."""
    out = _base(GPU, count, [gpu.name], sharing)
    if gpu.memory_total >> 20:
        out[f"{GPU}.memory"] = str(gpu.memory_total >> 20)
    major, minor = gpu.compute_capability
    if major:
        out.update({f"{GPU}.family": arch_family(major, minor),
                    f"{GPU}.compute.major": str(major), f"{GPU}.compute.minor": str(minor)})
    return out


def _mig_resource(resource: str, m: MigDevice, count: int, sharing: _Sharing,
                  engines: Mapping[str, system_info.MigEngines]) -> dict:
    """[MIXED] NewMIGResourceLabeler: base labels and the attributes of the first device."""
    out = _base(resource, count, [m.parent.name, "MIG", mig_name(m.profile)], sharing)
    attrs = {"memory": m.memory_mb, "multiprocessors": m.multiprocessors,
             "slices.gi": m.gi_slices, "slices.ci": m.ci_slices}
    e = engines.get(m.uuid)
    if e is not None:  # unknown engines: left out rather than guessed
        attrs.update({"engines.copy": e.copy, "engines.decoder": e.decoder,
                      "engines.encoder": e.encoder, "engines.jpeg": e.jpeg,
                      "engines.ofa": e.ofa})
    out.update({f"{resource}.{k}": str(v) for k, v in attrs.items()})
    return out


def _by_name(items: Iterable[Any], name) -> dict[str, list]:
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(name(item), []).append(item)
    return groups


def _full_gpu_labels(gpus: Sequence[Gpu], sharing: _Sharing) -> dict:
    """[FULL] newGPULabelers. GFD visits product names in Go's random map order, so a node
    with two products gets either's labels; here the lowest-indexed GPU's product wins."""
    counts = {name: len(g) for name, g in _by_name(gpus, lambda g: g.name).items()}
    out: dict[str, str] = {}
    for mig_enabled in (True, False):  # full GPUs' labels over MIG-enabled ones'
        groups = _by_name([g for g in gpus if g.mig_enabled == mig_enabled], lambda g: g.name)
        for name, group in reversed(list(groups.items())):
            out.update(_full_gpu(group[0], counts[name], None if mig_enabled else sharing))
    return out


def _invalid(gpu: Gpu) -> dict:
    """[INVALID] newInvalidMigStrategyLabeler (built without the config: no -SHARED)."""
    return {f"{GPU}.product": _product([gpu.name, "MIG", "INVALID"]), f"{GPU}.count": "0",
            f"{GPU}.replicas": "0", f"{GPU}.sharing-strategy": "", f"{GPU}.memory": "0"}


def _mig_labels(strategy: str, gpus: Sequence[Gpu], migs: Sequence[MigDevice],
                sharing: _Sharing, engines: Mapping[str, system_info.MigEngines]) -> dict:
    """[STRATEGY] [SINGLE] [MIXED] [INVALID]: newMigLabeler."""
    out = {"nvidia.com/mig.strategy": strategy}
    enabled = [g for g in gpus if g.mig_enabled]
    groups = _by_name(migs, lambda m: mig_name(m.profile))
    if strategy == "mixed":
        for name, group in groups.items():
            out.update(_mig_resource(MIG_PREFIX + name, group[0], len(group), sharing, engines))
        return out
    if not enabled:
        return out
    with_migs = {m.parent.index for m in migs}
    if any(g.index not in with_migs for g in enabled) or len(enabled) != len(gpus) or \
            len(groups) != 1:
        out.update(_invalid(enabled[0]))
        return out
    (group,) = groups.values()
    out.update(_mig_resource(GPU, group[0], len(group), sharing, engines))
    return out


def _gpu_mode(gpus: Sequence[Gpu], pci_class: Mapping[int, int]) -> str:
    """[MODE]."""
    classes = {pci_class.get(g.index) for g in gpus}
    if len(classes) != 1:
        return UNKNOWN
    return {_PCI_GRAPHICS: "graphics", _PCI_COMPUTE: "compute"}.get(classes.pop(), UNKNOWN)


def _version_labels(driver: DriverInfo) -> dict:
    """[VERSION]; a driver version GFD would refuse ("X.Y[.Z]") gives no driver labels."""
    out = {}
    parts = driver.driver_version.split(".")
    if 2 <= len(parts) <= 3:
        major, minor, rev = parts[0], parts[1], parts[2] if len(parts) == 3 else ""
        for old, new, value in (("major", "major", major), ("minor", "minor", minor),
                                ("rev", "revision", rev)):
            out[f"nvidia.com/cuda.driver.{old}"] = value
            out[f"nvidia.com/cuda.driver-version.{new}"] = value
        out["nvidia.com/cuda.driver-version.full"] = driver.driver_version
    else:
        log.warning("driver version %r is not X.Y[.Z]: no nvidia.com/cuda.driver labels",
                     driver.driver_version)
    v = driver.cuda_driver_version
    cuda_major, cuda_minor = str(v // 1000), str(v % 1000 // 10)
    out.update({"nvidia.com/cuda.runtime.major": cuda_major,
                "nvidia.com/cuda.runtime.minor": cuda_minor,
                "nvidia.com/cuda.runtime-version.major": cuda_major,
                "nvidia.com/cuda.runtime-version.minor": cuda_minor,
                "nvidia.com/cuda.runtime-version.full": f"{cuda_major}.{cuda_minor}"})
    return out


def build_labels(gpus: Sequence[Gpu], cfg: Config, driver: DriverInfo,
                 migs: Sequence[MigDevice] = (), facts: NodeFacts | None = None
                 ) -> dict[str, str]:
    """The labels GFD would give this node, by name (sorted): `gpus` as discovered, the MIG
    devices of the MIG-enabled ones (read only under migStrategy single / mixed; ignored
    under none, as GFD does), `cfg`'s migStrategy and sharing section, the driver, and the
    facts of agent.nvml.system_info (None, or facts missing from it: "unknown" machine and
    mode, no engine labels). No GPUs: no labels [EMPTY]."""
    gpus = sorted(gpus, key=lambda g: g.index)
    if not gpus:
        return {}
    facts = facts if facts is not None else NodeFacts()
    sharing = _Sharing(cfg.sharing)
    mps = sharing.strategy == "mps" and not any(g.mig_enabled for g in gpus)
    out = {
        "nvidia.com/gpu.machine": sanitise(facts.machine or UNKNOWN),  # [MACHINE]
        **_version_labels(driver),
        "nvidia.com/mig.capable": str(any(g.mig_pending is not None for g in gpus)).lower(),
        "nvidia.com/mps.capable": str(mps).lower(),  # [MPS]
        **_full_gpu_labels(gpus, sharing),
        "nvidia.com/gpu.mode": _gpu_mode(gpus, facts.pci_class),
    }
    if cfg.mig_strategy != "none":
        migs = sorted(migs, key=lambda m: (m.parent.index, m.index))
        out.update(_mig_labels(cfg.mig_strategy, gpus, migs, sharing, facts.engines))
    return dict(sorted(out.items()))


def node_labels(gpus: Sequence[Gpu], cfg: Config, sys_root: str = "/sys") -> dict[str, str]:
    """`build_labels` with what it needs read now: the driver from NVML, the MIG devices
    (under single / mixed) and their engines from NVML, the machine type and PCI classes
    from `sys_root`. NVML must be initialised; NvmlError when it cannot say."""
    if not gpus:
        return {}
    migs = nvml_mig.read_mig_devices(gpus) if cfg.mig_strategy != "none" else []
    return build_labels(gpus, cfg, nvml_driver.driver_info(), migs,
                        system_info.node_facts(gpus, migs, sys_root))


def render(labels: Mapping[str, str]) -> bytes:
    """The feature file's content: the header, then `name=value` lines sorted by name.
    ValueError for a name or value NFD would read differently (NFD trims each line and
    splits it at the first "="; "#" starts a comment)."""
    lines = [HEADER]
    for name, value in sorted(labels.items()):
        if not name or "=" in name or name.startswith("#") or "\n" in name + value or \
                name != name.strip() or value != value.strip():
            raise ValueError(f"label {name!r}={value!r} cannot be written to an NFD feature file")
        lines.append(f"{name}={value}\n".encode())
    return b"".join(lines)


def _make_dirs(directory: str) -> None:
    """Create `directory` and its missing parents, each DIR_MODE whatever the umask (the
    systemd unit's is 0077)."""
    missing = []
    while directory and not os.path.isdir(directory):
        missing.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile, or a file: the write then says which
        os.chmod(d, DIR_MODE)


class FeatureFile:
    """The NFD feature file at `path`. `update` replaces it when the labels differ from what
    it holds; `remove` takes it away (NFD then drops its labels)."""

    def __init__(self, path: str):
        self.path = path
        directory, base = os.path.split(path)
        # NFD skips dot files (source/local/local.go getFeaturesFromFiles): the new content
        # is written and made durable under this name, then renamed over `path`.
        self.staging = os.path.join(directory, "." + base)

    def _current(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.debug("node feature label file %s unreadable (%s): rewritten", self.path, exc)
            return None

    def update(self, labels: Mapping[str, str]) -> bool:
        """Write `labels` unless the file already holds exactly them; whether it was written.
        A missing directory is created (0755: the agent may start before NFD's worker, which
        reads it, is deployed). AgentError naming the path when the file cannot be written
        (the old file, if any, stays as it was)."""
        data = render(labels)
        if self._current() == data:
            return False
        try:
            _make_dirs(os.path.dirname(self.path))
            write_atomic(self.staging, data, mode=FILE_MODE)  # its temp name is hidden too
            os.replace(self.staging, self.path)
            fsync_dir(os.path.dirname(self.path))
        except OSError as exc:
            raise AgentError(
                f"cannot write the node feature label file {self.path}: "
                f"{exc.strerror or exc}; its directory must be writable by the agent "
                f"(agent.nfdFeaturesFile / --nfd-features-file; \"\" turns the labels "
                f"off)") from exc
        return True

    def remove(self) -> bool:
        """Remove the file (and a staging file a crash left); whether the file was there.
        AgentError naming the path when it cannot be removed."""
        removed = False
        for path in (self.staging, self.path):
            try:
                os.unlink(path)
                removed = path == self.path
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise AgentError(f"cannot remove the node feature label file {path}: "
                                 f"{exc.strerror or exc}") from exc
        if removed:
            fsync_dir(os.path.dirname(self.path))
        return removed
