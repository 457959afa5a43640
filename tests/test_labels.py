"""Node feature labels (agent.rm.labels) on the shipped simulated nodes, per MIG strategy and
sharing config, against the labels NVIDIA's gpu-feature-discovery writes; and the NFD feature
file they go to.

The inputs are built as the agent builds them: discovery against the simulated NVML, the MIG
devices and their engines read through it, the config loaded from a v1 file, a sysfs tree
under tmp_path for the machine type and PCI classes. Every rule is GFD's, read in NVIDIA
k8s-device-plugin v0.20.0 (commit 1b826acc6, which absorbed gpu-feature-discovery); the tags
name the rules as agent/rm/labels.py lists them:
- [VERSION] internal/lm/nvml.go newVersionLabeler: cuda.driver-version.{major,minor,revision,
  full}, cuda.runtime-version.{major,minor,full}, and the deprecated cuda.driver.{major,minor,
  rev} and cuda.runtime.{major,minor}.
- [MIGCAP] nvml.go newMigCapabilityLabeler; go-nvlib device.go IsMigCapable.
- [MPS] nvml.go newSharingLabeler / isMPSCapable.
- [MODE] nvml.go newGPUModeLabeler / getModeForClasses; go-nvlib nvpci.go class constants.
- [MACHINE] internal/lm/machine-type.go newMachineTypeLabeler.
- [FULL] internal/lm/mig-strategy.go newGPULabelers; internal/lm/resource.go
  NewGPUResourceLabeler / NewGPUResourceLabelerWithoutSharing (MIG-enabled GPUs: replicas 0).
- [FAMILY] resource.go getArchFamily. [SANITISE] resource.go sanitise / getProductName.
- [SHARING] resource.go baseLabeler, getReplicas, isShared, isRenamed; api/config/v1/
  sharing.go SharingStrategy; api/config/v1/config.go DisableResourceNamingInConfig.
- [STRATEGY] internal/lm/strategy.go migStrategyLabeler.
- [MIXED] mig-strategy.go newMigStrategyMixedLabeler; resource.go NewMIGResourceLabeler;
  internal/resource/nvml-mig-device.go GetName ("+" -> ".") and GetAttributes.
- [SINGLE] mig-strategy.go newMigStrategySingleLabeler.
- [INVALID] mig-strategy.go newInvalidMigStrategyLabeler.
- [EMPTY] nvml.go NewDeviceLabeler: no devices, no labels.
- [FILE] internal/lm/output.go toFile (name=value lines, written atomically, 0644); NFD
  source/local/local.go (kubernetes-sigs/node-feature-discovery 76e6cc8c): `#` lines skipped,
  `# +` starts a directive, dot files ignored, key[=value] split at the first "=".
"""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import pytest

from agent.config import load_config
from agent.errors import AgentError
from agent.nvml import discovery
from agent.nvml.discovery import Gpu
from agent.nvml.driver import DriverInfo
from agent.rm import labels
from agent.sim.profile import dump_profile, load_profile

P = "nvidia.com/"
STRATEGY = P + "mig.strategy"
MACHINE = "NVIDIA DGX (test) H100"  # [MACHINE] + [SANITISE]: "(" and ")" dropped
MACHINE_LABEL = "NVIDIA-DGX-test-H100"


def _versions(driver: str, cuda_major: str, cuda_minor: str) -> dict:
    """[VERSION] for a driver X.Y.Z."""
    major, minor, rev = driver.split(".")
    return {
        P + "cuda.driver.major": major, P + "cuda.driver.minor": minor,
        P + "cuda.driver.rev": rev,
        P + "cuda.driver-version.major": major, P + "cuda.driver-version.minor": minor,
        P + "cuda.driver-version.revision": rev, P + "cuda.driver-version.full": driver,
        P + "cuda.runtime.major": cuda_major, P + "cuda.runtime.minor": cuda_minor,
        P + "cuda.runtime-version.major": cuda_major,
        P + "cuda.runtime-version.minor": cuda_minor,
        P + "cuda.runtime-version.full": f"{cuda_major}.{cuda_minor}",
    }


def _node(product: str, count: int, memory: int, family: str, compute: str,
          mig_capable: bool, replicas: str = "1", driver: str = "550.54.15",
          cuda: tuple[str, str] = ("12", "4")) -> dict:
    """The labels of a node of `count` GPUs named `product` without MIG strategy labels."""
    major, minor = compute.split(".")
    return {
        **_versions(driver, *cuda),
        P + "gpu.machine": MACHINE_LABEL,  # [MACHINE]
        P + "gpu.mode": "compute",  # [MODE]: every GPU 0x030200
        P + "mig.capable": str(mig_capable).lower(),  # [MIGCAP]
        P + "mps.capable": "false",  # [MPS]: no mps section
        # [FULL]
        P + "gpu.product": product, P + "gpu.count": str(count),
        P + "gpu.replicas": replicas, P + "gpu.sharing-strategy": "none",
        P + "gpu.memory": str(memory),  # MiB of nvmlDeviceGetMemoryInfo total
        P + "gpu.family": family, P + "gpu.compute.major": major,
        P + "gpu.compute.minor": minor,
    }


# The profiles' GPUs (agent/sim/profiles/*.yaml): name, memory.total >> 20, compute capability;
# a GPU whose profile has a `mig:` section answers nvmlDeviceGetMigMode ([MIGCAP]).
FULL = {
    "dgx1-v100": _node("Tesla-V100-SXM2-16GB", 8, 16384, "volta", "7.0", False,
                       driver="535.129.03", cuda=("12", "2")),  # cuda_driver_version 12020
    "pcie-8gpu": _node("NVIDIA-L40S", 8, 46068, "ada-lovelace", "8.9", False),
    "dgx-h100": _node("NVIDIA-H100-80GB-HBM3", 8, 81559, "hopper", "9.0", False),
    # the count is every GPU of the name, MIG-enabled or not [FULL]
    "a100-mig": _node("NVIDIA-A100-SXM4-80GB", 8, 81920, "ampere", "8.0", True),
    "h100-mig": _node("NVIDIA-H100-80GB-HBM3", 8, 81559, "hopper", "9.0", True),
    # every GPU MIG-enabled: only the labeler built without sharing writes: replicas 0 [FULL]
    "a30-mig": _node("NVIDIA-A30", 4, 24576, "ampere", "8.0", True, replicas="0"),
}

# [MIXED] per MIG profile name: count, memory MB, multiprocessors, GI slices, CI slices,
# engines (copy, decoder, encoder, jpeg, ofa), from the profiles' `mig.profiles` and
# `mig.instances` (the descriptions list the layouts).
MIG_A100 = {
    "1g.10gb": (9, 9728, 14, 1, 1, (1, 0, 0, 0, 0)),  # GPU 0: 7, GPU 1: 2
    "2g.20gb": (1, 19968, 28, 2, 2, (2, 1, 0, 0, 0)),  # GPU 1
    "3g.40gb": (4, 40192, 42, 3, 3, (3, 2, 0, 0, 0)),  # GPUs 1, 4, 5 (2)
    "4g.40gb": (1, 40192, 56, 4, 4, (4, 2, 0, 0, 0)),  # GPU 4
    "7g.80gb": (1, 80896, 98, 7, 7, (7, 5, 0, 1, 1)),  # GPU 3
}
MIG_H100 = {
    "1g.10gb": (9, 9984, 16, 1, 1, (1, 1, 0, 1, 0)),  # GPU 0: 7, GPU 1: 2
    "1g.10gb.me": (1, 9984, 16, 1, 1, (1, 1, 0, 1, 1)),  # GPU 6: 1g.10gb+me, "+" -> "."
    "1g.20gb": (4, 20096, 26, 1, 1, (1, 1, 0, 1, 0)),  # GPU 4
    "2g.20gb": (1, 20096, 32, 2, 2, (2, 2, 0, 2, 0)),  # GPU 1
    "3g.40gb": (2, 40448, 60, 3, 3, (3, 3, 0, 3, 0)),  # GPU 1, GPU 6
    "1c.3g.40gb": (1, 40448, 20, 3, 1, (3, 3, 0, 3, 0)),  # GPU 3: compute instances of a
    "2c.3g.40gb": (1, 40448, 40, 3, 2, (3, 3, 0, 3, 0)),  # 3g.40gb GPU instance
    "4g.40gb": (1, 40448, 64, 4, 4, (4, 4, 0, 4, 0)),  # GPU 3
    "7g.80gb": (1, 81152, 132, 7, 7, (7, 7, 0, 7, 1)),  # GPU 5
}
MIG_A30 = {
    "1g.6gb": (5, 5952, 14, 1, 1, (1, 0, 0, 0, 0)),  # GPU 0: 4, GPU 3: 1
    "1g.6gb.me": (1, 5952, 14, 1, 1, (1, 1, 0, 1, 1)),  # GPU 3
    "2g.12gb": (3, 12096, 28, 2, 2, (2, 1, 0, 0, 0)),  # GPU 1: 2, GPU 3: 1
    "4g.24gb": (1, 24224, 56, 4, 4, (4, 2, 0, 1, 1)),  # GPU 2
}


def _mig(resource: str, product: str, row: tuple, replicas: str = "1",
         sharing: str = "none") -> dict:
    """[MIXED] / [SINGLE]: the labels of one MIG resource."""
    count, memory, sms, gi, ci, (copy, dec, enc, jpeg, ofa) = row
    values = {"product": product, "count": count, "replicas": replicas,
              "sharing-strategy": sharing, "memory": memory, "multiprocessors": sms,
              "slices.gi": gi, "slices.ci": ci, "engines.copy": copy, "engines.decoder": dec,
              "engines.encoder": enc, "engines.jpeg": jpeg, "engines.ofa": ofa}
    return {f"{resource}.{k}": str(v) for k, v in values.items()}


def _mixed(model: str, table: dict) -> dict:
    """[STRATEGY] + [MIXED]: nvidia.com/mig-<name>.*, product <model>-MIG-<name>."""
    out = {STRATEGY: "mixed"}
    for name, row in table.items():
        out.update(_mig(f"{P}mig-{name}", f"{model}-MIG-{name}", row))
    return out


def _invalid(model: str) -> dict:
    """[STRATEGY] + [INVALID], written over the full-GPU labels (family, compute stay)."""
    return {STRATEGY: "single", P + "gpu.product": f"{model}-MIG-INVALID", P + "gpu.count": "0",
            P + "gpu.replicas": "0", P + "gpu.sharing-strategy": "", P + "gpu.memory": "0"}


CASES = [
    ("dgx1-v100", "none", {}),
    ("dgx1-v100", "mixed", {STRATEGY: "mixed"}),  # no MIG devices: the strategy only
    ("dgx1-v100", "single", {STRATEGY: "single"}),  # [SINGLE]: no MIG-enabled GPU
    ("pcie-8gpu", "none", {}),
    ("dgx-h100", "none", {}),
    ("a100-mig", "none", {}),  # MIG-enabled GPUs count as GPUs, no MIG labels
    ("a100-mig", "mixed", _mixed("NVIDIA-A100-SXM4-80GB", MIG_A100)),
    # [INVALID]: MIG-enabled beside MIG-disabled GPUs (2, 6, 7)
    ("a100-mig", "single", _invalid("NVIDIA-A100-SXM4-80GB")),
    ("h100-mig", "none", {}),
    ("h100-mig", "mixed", _mixed("NVIDIA-H100-80GB-HBM3", MIG_H100)),
    ("h100-mig", "single", _invalid("NVIDIA-H100-80GB-HBM3")),
    ("a30-mig", "none", {}),
    ("a30-mig", "mixed", _mixed("NVIDIA-A30", MIG_A30)),
    ("a30-mig", "single", _invalid("NVIDIA-A30")),  # [INVALID]: more than one profile
]


# ---------------------------------------------------------------------------------------------
# Building the inputs as the agent does.


def _sysfs(root: Path, gpus: list[Gpu], machine: str | None = MACHINE,
           classes: dict[int, int] | None = None, vendor: int = 0x10DE) -> str:
    """A sysfs tree: the DMI product name and, per GPU, its PCI vendor and class (0x030200,
    a 3D controller, unless `classes` says otherwise; None: no class file)."""
    if machine is not None:
        dmi = root / "class/dmi/id"
        dmi.mkdir(parents=True, exist_ok=True)
        (dmi / "product_name").write_text(machine + "\n")
    for g in gpus:
        dev = root / "bus/pci/devices" / g.short_bus_id
        dev.mkdir(parents=True, exist_ok=True)
        (dev / "vendor").write_text(f"0x{vendor:04x}\n")
        cls = (classes or {}).get(g.index, 0x030200)
        if cls is not None:
            (dev / "class").write_text(f"0x{cls:06x}\n")
    return str(root)


def _config(tmp_path: Path, strategy: str = "none", **sections) -> object:
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps({"version": "v1", **sections}))  # JSON is YAML
    return load_config({"config_file": str(path), "mig_strategy": strategy}, {})


def _labels(node, tmp_path: Path, profile: str, strategy: str = "none", sys_kw=None,
            **sections) -> dict:
    """The labels of simulated `profile` (a name or a path) under `strategy`, read as the
    daemon reads them (agent.rm.labels.node_labels)."""
    node(profile)
    gpus = discovery.discover()
    sys_root = _sysfs(tmp_path / "sys", gpus, **(sys_kw or {}))
    return labels.node_labels(gpus, _config(tmp_path, strategy, **sections), sys_root=sys_root)


def _variant(tmp_path: Path, base: str, edit) -> str:
    """A copy of shipped profile `base` whose GPU list `edit` changes, as a file."""
    profile = load_profile(base)
    profile["gpus"] = edit([dict(g) for g in profile["gpus"]])
    path = tmp_path / "variant.yaml"
    path.write_text(dump_profile(profile))
    return str(path)


def _uniform_a30(gpus: list[dict]) -> list[dict]:
    """Every A30 with GPU 0's MIG layout (4x 1g.6gb), MIG UUIDs made unique."""
    out = []
    for g in gpus:
        instances = [{**inst, "uuid": f"MIG-{g['index']:08d}-0000-4000-8000-{k:012d}"}
                     for k, inst in enumerate(gpus[0]["mig"]["instances"])]
        out.append({**g, "mig": {**gpus[0]["mig"], "instances": instances}})
    return out


def _one_empty_a30(gpus: list[dict]) -> list[dict]:
    """GPU 1 MIG-enabled without MIG devices."""
    gpus[1] = {**gpus[1], "mig": {**gpus[1]["mig"], "instances": []}}
    return gpus


# ---------------------------------------------------------------------------------------------
# The table.


@pytest.mark.parametrize(("profile", "strategy", "extra"), CASES,
                         ids=[f"{p}-{s}" for p, s, _ in CASES])
def test_labels_of_the_shipped_profiles(node, tmp_path, profile, strategy, extra):
    assert _labels(node, tmp_path, profile, strategy) == {**FULL[profile], **extra}


def test_single_with_one_mig_profile_overloads_nvidia_com_gpu(node, tmp_path):
    """[SINGLE]: product <model>-MIG-<profile>, the MIG device count and attributes under
    nvidia.com/gpu; family and compute stay the parent's."""
    got = _labels(node, tmp_path, _variant(tmp_path, "a30-mig", _uniform_a30), "single")
    row = (16, 5952, 14, 1, 1, (1, 0, 0, 0, 0))
    assert got == {**FULL["a30-mig"], STRATEGY: "single",
                   **_mig(P + "gpu", "NVIDIA-A30-MIG-1g.6gb", row)}
    assert got[P + "gpu.product"] == "NVIDIA-A30-MIG-1g.6gb"  # GFD docs: A100-SXM4-40GB-MIG-1g.5gb


def test_single_with_an_empty_mig_gpu_is_invalid_and_mixed_skips_it(node, tmp_path):
    """[INVALID]: a MIG-enabled GPU without MIG devices; [MIXED] ignores it."""
    path = _variant(tmp_path, "a30-mig", _one_empty_a30)
    assert _labels(node, tmp_path, path, "single") == {**FULL["a30-mig"],
                                                      **_invalid("NVIDIA-A30")}
    table = {**MIG_A30, "2g.12gb": (1, *MIG_A30["2g.12gb"][1:])}  # GPU 3's only
    assert _labels(node, tmp_path, path, "mixed") == {**FULL["a30-mig"],
                                                     **_mixed("NVIDIA-A30", table)}


def test_no_gpus_no_labels(tmp_path):
    """[EMPTY]."""
    cfg = _config(tmp_path)
    assert labels.build_labels([], cfg, DriverInfo("550.54.15", 12040, 0)) == {}
    assert labels.node_labels([], cfg) == {}


# ---------------------------------------------------------------------------------------------
# Sharing: labelled from the config as GFD does (gpu-agent run does not serve it yet).

TS4 = {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}


@pytest.mark.parametrize(("sharing", "product", "replicas", "strategy", "mps"), [
    # [SHARING]: replicas > 1 adds -SHARED and the strategy
    (TS4, "Tesla-V100-SXM2-16GB-SHARED", "4", "time-slicing", "false"),
    # renameByDefault: the resource is renamed <name>.shared, the product keeps its name
    ({"timeSlicing": {**TS4["timeSlicing"], "renameByDefault": True}},
     "Tesla-V100-SXM2-16GB", "4", "time-slicing", "false"),
    # an explicit rename is dropped by NVIDIA's DisableResourceNamingInConfig: still -SHARED
    ({"timeSlicing": {"resources": [{"name": "gpu", "replicas": 4, "rename": "gpu-x"}]}},
     "Tesla-V100-SXM2-16GB-SHARED", "4", "time-slicing", "false"),
    # [MPS]: no MIG-enabled GPU, so MPS-capable
    ({"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}},
     "Tesla-V100-SXM2-16GB-SHARED", "2", "mps", "true"),
    # another resource's replicas: nvidia.com/gpu is not shared, yet the node's strategy is
    # mps (any replicated resource makes it so), and it is MPS-capable
    ({"mps": {"resources": [{"name": "nvidia.com/other", "replicas": 2}]}},
     "Tesla-V100-SXM2-16GB", "1", "none", "true"),
], ids=["time-slicing", "rename-by-default", "explicit-rename", "mps",
        "mps-other-resource"])
def test_sharing_labels(node, tmp_path, sharing, product, replicas, strategy, mps):
    got = _labels(node, tmp_path, "dgx1-v100", sharing=sharing)
    assert got == {**FULL["dgx1-v100"], P + "gpu.product": product,
                   P + "gpu.replicas": replicas, P + "gpu.sharing-strategy": strategy,
                   P + "mps.capable": mps}
    assert got[P + "gpu.count"] == "8"  # physical GPUs, whatever the replicas


def test_mps_with_mig_enabled_gpus_is_not_mps_capable(node, tmp_path):
    """[MPS]: GFD refuses MPS beside MIG (its labeler fails); the label says false."""
    got = _labels(node, tmp_path, "a100-mig",
                  sharing={"mps": {"resources": [{"name": "gpu", "replicas": 2}]}})
    assert got[P + "mps.capable"] == "false"
    assert got[P + "gpu.sharing-strategy"] == "mps"  # GPUs 2, 6, 7 are full GPUs


def test_mig_enabled_gpus_carry_no_sharing(node, tmp_path):
    """[FULL]: a node whose GPUs are all MIG-enabled labels nvidia.com/gpu without sharing
    (NewGPUResourceLabelerWithoutSharing), whatever the config says."""
    assert _labels(node, tmp_path, "a30-mig", sharing=TS4) == FULL["a30-mig"]


def test_shared_mig_resource_under_mixed(node, tmp_path):
    """[MIXED] + [SHARING]: a replicated MIG resource takes -SHARED, its replicas and the
    strategy; the others and the full GPUs do not."""
    sharing = {"timeSlicing": {"resources": [{"name": "nvidia.com/mig-1g.10gb",
                                              "replicas": 2}]}}
    got = _labels(node, tmp_path, "a100-mig", "mixed", sharing=sharing)
    shared = _mig(P + "mig-1g.10gb", "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED",
                  MIG_A100["1g.10gb"], replicas="2", sharing="time-slicing")
    assert got == {**FULL["a100-mig"], **_mixed("NVIDIA-A100-SXM4-80GB", MIG_A100), **shared}


# ---------------------------------------------------------------------------------------------
# Host facts and the pure rules.


@pytest.mark.parametrize(("sys_kw", "machine", "mode"), [
    ({}, MACHINE_LABEL, "compute"),
    ({"classes": dict.fromkeys(range(8), 0x030000)}, MACHINE_LABEL, "graphics"),
    ({"classes": {3: 0x030000}}, MACHINE_LABEL, "unknown"),  # two classes
    ({"classes": {5: None}}, MACHINE_LABEL, "unknown"),  # one unreadable
    ({"vendor": 0x8086}, MACHINE_LABEL, "unknown"),  # not NVIDIA devices at those addresses
    ({"classes": dict.fromkeys(range(8), 0x068000)}, MACHINE_LABEL, "unknown"),
    ({"machine": None}, "unknown", "compute"),  # no DMI
    ({"machine": "  PowerEdge  XE9680 (Rev+2)  "}, "PowerEdge-XE9680-Rev2", "compute"),
], ids=["compute", "graphics", "two-classes", "no-class", "not-nvidia", "other-class",
        "no-dmi", "sanitised"])
def test_machine_and_mode(node, tmp_path, sys_kw, machine, mode):
    """[MACHINE] [MODE] [SANITISE]."""
    got = _labels(node, tmp_path, "dgx1-v100", sys_kw=sys_kw)
    assert (got[P + "gpu.machine"], got[P + "gpu.mode"]) == (machine, mode)


def _gpu(index: int = 0, name: str = "NVIDIA A100-SXM4-40GB", cc=(8, 0), memory=40 << 30,
         mig=False) -> Gpu:
    return Gpu(index, f"GPU-{index}", name, index, f"00000000:{0x10 + index:02X}:00.0", 0,
               memory, cc, mig, mig if mig else None)


@pytest.mark.parametrize(("version", "cuda", "expected"), [
    ("550.54.15", 12040, {"major": "550", "minor": "54", "rev": "15", "full": "550.54.15"}),
    ("470.82", 11040, {"major": "470", "minor": "82", "rev": "", "full": "470.82"}),
    ("560.28.03", 12060, {"major": "560", "minor": "28", "rev": "03", "full": "560.28.03"}),
], ids=["x.y.z", "x.y", "leading-zero"])
def test_version_labels(tmp_path, version, cuda, expected):
    """[VERSION]: the revision as written (02 stays 02), "" with two parts; CUDA 12060 is
    12.6."""
    got = labels.build_labels([_gpu()], _config(tmp_path), DriverInfo(version, cuda, 1))
    assert got[P + "cuda.driver-version.major"] == got[P + "cuda.driver.major"] == \
        expected["major"]
    assert got[P + "cuda.driver-version.minor"] == got[P + "cuda.driver.minor"] == \
        expected["minor"]
    assert got[P + "cuda.driver-version.revision"] == got[P + "cuda.driver.rev"] == \
        expected["rev"]
    assert got[P + "cuda.driver-version.full"] == expected["full"]
    v = f"{cuda // 1000}.{cuda % 1000 // 10}"
    assert got[P + "cuda.runtime-version.full"] == v
    assert f"{got[P + 'cuda.runtime.major']}.{got[P + 'cuda.runtime.minor']}" == v


def test_a_driver_version_gfd_refuses_gives_no_driver_labels(tmp_path):
    got = labels.build_labels([_gpu()], _config(tmp_path), DriverInfo("r550", 12040, 1))
    assert not [k for k in got if k.startswith(P + "cuda.driver")]
    assert got[P + "cuda.runtime-version.full"] == "12.4"


@pytest.mark.parametrize(("cc", "family"), [
    ((6, 1), "pascal"), ((7, 0), "volta"), ((7, 2), "volta"), ((7, 5), "turing"),
    ((8, 0), "ampere"), ((8, 6), "ampere"), ((8, 7), "ampere"), ((8, 9), "ada-lovelace"),
    ((9, 0), "hopper"), ((10, 0), "blackwell"), ((12, 0), "blackwell"), ((13, 0), "rubin"),
    ((4, 0), "undefined"), ((11, 0), "undefined"),
], ids=lambda v: ".".join(map(str, v)) if isinstance(v, tuple) else v)
def test_arch_family(cc, family):
    """[FAMILY]."""
    assert labels.arch_family(*cc) == family


def test_no_compute_capability_no_family(tmp_path):
    """[FULL]: compute major 0 leaves family and compute out."""
    got = labels.build_labels([_gpu(cc=(0, 0))], _config(tmp_path), DriverInfo("1.2.3", 0, 1))
    assert not {P + "gpu.family", P + "gpu.compute.major", P + "gpu.compute.minor"} & set(got)


@pytest.mark.parametrize(("text", "want"), [
    ("NVIDIA A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB"),
    ("Tesla V100-SXM2-16GB", "Tesla-V100-SXM2-16GB"),
    ("NVIDIA GeForce RTX 4090", "NVIDIA-GeForce-RTX-4090"),
    ("  NVIDIA   H100 80GB HBM3 ", "NVIDIA-H100-80GB-HBM3"),
    ("NVIDIA RTX A6000 (Ada) +x", "NVIDIA-RTX-A6000-Ada-x"),
    ("a_b.c-d", "a_b.c-d"),
], ids=["a100", "v100", "geforce", "spaces", "drops", "keeps"])
def test_sanitise(text, want):
    """[SANITISE]."""
    assert labels.sanitise(text) == want


def test_two_products_lowest_index_wins(tmp_path):
    """[FULL]: GFD picks one product in Go's map order (random); here the lowest-indexed
    GPU's, each with its own count; full GPUs over MIG-enabled ones."""
    gpus = [_gpu(0, "NVIDIA A100-SXM4-40GB"), _gpu(1, "NVIDIA A100-PCIE-40GB"),
            _gpu(2, "NVIDIA A100-PCIE-40GB")]
    got = labels.build_labels(gpus, _config(tmp_path), DriverInfo("550.54.15", 12040, 3))
    assert (got[P + "gpu.product"], got[P + "gpu.count"]) == ("NVIDIA-A100-SXM4-40GB", "1")
    gpus[0] = _gpu(0, "NVIDIA A100-SXM4-40GB", mig=True)
    got = labels.build_labels(gpus, _config(tmp_path), DriverInfo("550.54.15", 12040, 3))
    assert (got[P + "gpu.product"], got[P + "gpu.count"]) == ("NVIDIA-A100-PCIE-40GB", "2")


def test_no_timestamp_label(node, tmp_path):
    """GFD's nvidia.com/gfd.timestamp changes on every write; gpu-agent writes the file only
    when the labels change, as GFD does with --no-timestamp (internal/lm/timestamp.go)."""
    assert P + "gfd.timestamp" not in _labels(node, tmp_path, "dgx1-v100")


# ---------------------------------------------------------------------------------------------
# The feature file.

LABELS = {P + "gpu.product": "NVIDIA-A30", P + "gpu.count": "4",
          P + "gpu.sharing-strategy": ""}


def _nfd_read(path: Path) -> dict:
    """What NFD's local source makes of a feature file (source/local/local.go
    parseFeatureFile, without directives)."""
    out = {}
    for line in path.read_text().split("\n"):
        line = line.strip()
        if not line or line.startswith("#"):
            assert not line.startswith("# +"), f"an NFD directive: {line!r}"
            continue
        key, sep, value = line.partition("=")
        out[key] = value if sep else "true"
    return out


def test_update_writes_sorted_lines_nfd_reads(tmp_path):
    """[FILE]: name=value lines NFD reads back; a `#` header that is not a directive."""
    path = tmp_path / "gpu-agent"
    f = labels.FeatureFile(str(path))
    assert f.update(LABELS) is True
    assert _nfd_read(path) == LABELS
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# ") and not lines[0].startswith("# +")
    assert lines[1:] == sorted(f"{k}={v}" for k, v in LABELS.items())
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(os.listdir(tmp_path)) == ["gpu-agent"]  # no temp or staging file left


def test_unchanged_labels_are_not_rewritten(tmp_path):
    path = tmp_path / "gpu-agent"
    f = labels.FeatureFile(str(path))
    f.update(LABELS)
    before = path.stat()
    # a restarted agent (a new FeatureFile) with the same labels leaves the file alone too
    for writer in (f, labels.FeatureFile(str(path))):
        assert writer.update(dict(reversed(list(LABELS.items())))) is False
        after = path.stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_changed_labels_replace_the_file_by_rename(tmp_path):
    """The new content arrives whole: a new inode renamed over the old name."""
    path = tmp_path / "gpu-agent"
    f = labels.FeatureFile(str(path))
    f.update(LABELS)
    inode = path.stat().st_ino
    assert f.update({**LABELS, P + "gpu.count": "3"}) is True
    assert path.stat().st_ino != inode
    assert _nfd_read(path)[P + "gpu.count"] == "3"


def test_a_deleted_file_is_written_again(tmp_path):
    path = tmp_path / "gpu-agent"
    f = labels.FeatureFile(str(path))
    f.update(LABELS)
    path.unlink()
    assert f.update(LABELS) is True and _nfd_read(path) == LABELS


def test_staging_happens_under_a_dot_name_nfd_ignores(tmp_path, monkeypatch):
    """NFD reads every non-dot file of features.d: the content is written under
    .gpu-agent, then renamed; a failure before the rename leaves the old file whole."""
    path = tmp_path / "gpu-agent"
    f = labels.FeatureFile(str(path))
    f.update(LABELS)
    seen = []
    real_replace = os.replace

    def replace(src, dst):
        seen.append((os.path.basename(src), os.path.basename(dst)))
        if os.path.basename(dst) == "gpu-agent":
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(AgentError, match=f"{path}: No space left on device"):
        f.update({**LABELS, P + "gpu.count": "3"})
    assert all(src.startswith(".") for src, _ in seen)
    assert _nfd_read(path) == LABELS
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".")] == ["gpu-agent"]


def test_a_missing_directory_is_created(tmp_path):
    """The agent may start before NFD's worker is deployed: features.d is created, 0755."""
    path = tmp_path / "nfd" / "features.d" / "gpu-agent"
    old = os.umask(0o077)  # the systemd unit's
    try:
        assert labels.FeatureFile(str(path)).update(LABELS) is True
    finally:
        os.umask(old)
    assert _nfd_read(path) == LABELS
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o755
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o755
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


@pytest.mark.parametrize("where", ["not-a-dir", "path-is-a-dir", "read-only-dir"])
def test_unwritable_directory_names_the_path(tmp_path, where):
    if where == "not-a-dir":
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "gpu-agent"
    elif where == "path-is-a-dir":
        path = tmp_path / "gpu-agent"
        (path / "x").mkdir(parents=True)
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory")
        (tmp_path / "ro").mkdir(mode=0o555)
        path = tmp_path / "ro" / "gpu-agent"
    with pytest.raises(AgentError) as info:
        labels.FeatureFile(str(path)).update(LABELS)
    assert str(path) in str(info.value) and "agent.nfdFeaturesFile" in str(info.value)


def test_remove(tmp_path):
    """NFD drops the labels of a file that is gone."""
    path = tmp_path / "gpu-agent"
    f = labels.FeatureFile(str(path))
    assert f.remove() is False
    f.update(LABELS)
    (tmp_path / ".gpu-agent").write_text("left by a crash")
    assert f.remove() is True
    assert os.listdir(tmp_path) == []
    assert f.remove() is False


@pytest.mark.parametrize("bad", [{"a\nb": "1"}, {"a": "1\nb=2"}, {"a=b": "1"}, {"#a": "1"},
                                 {"": "1"}, {"a": "1 "}, {" a": "1"}],
                         ids=["nl-name", "nl-value", "eq", "hash", "empty", "space-value",
                              "space-name"])
def test_render_refuses_what_nfd_would_misread(bad):
    with pytest.raises(ValueError):
        labels.render(bad)


# -- the running agent ----------------------------------------------------------------------


def _label_file(path: str) -> dict[str, str]:
    lines = Path(path).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_the_running_agent_keeps_the_file_as_the_config_changes():
    from tests.daemon_harness import Node

    with Node("a100-mig") as node:
        config = node.write("config.yaml", "version: v1\nflags:\n  migStrategy: mixed\n")
        agent = node.agent("--config-file", config)
        agent.wait_registered(resource=P + "mig-1g.10gb")
        node.status_when(lambda d: os.path.exists(node.features_file), "the label file")
        got = _label_file(node.features_file)
        assert got[STRATEGY] == "mixed"  # [STRATEGY]
        assert got[P + "mig-1g.10gb.count"] == "9"  # [MIXED]: GPU 0's 7, GPU 1's 2
        assert got[P + "gpu.count"] == "8"  # [FULL]: MIG-enabled GPUs counted too
        assert oct(os.stat(node.features_file).st_mode & 0o777) == "0o644"  # [FILE]
        node.write("config.yaml", "version: v1\nflags:\n  migStrategy: none\n")
        agent.send(signal.SIGHUP)
        node.status_when(lambda d: STRATEGY not in _label_file(node.features_file),
                         "the labels of migStrategy none")
        got = _label_file(node.features_file)
        assert not any(k.startswith(P + "mig-") for k in got)  # no MIG resources any more
        assert got[P + "gpu.count"] == "8"
        doc = node.status_when(lambda d: d.get("labels", {}).get("file"), "the label status")
        assert doc["labels"] == {"file": node.features_file, "error": ""}
