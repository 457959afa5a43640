"""The simulated libnvidia-ml.so.1 read through unmodified pynvml.

Owns: checking that every shipped profile reads back exactly (field by field, against the
YAML as PyYAML reads it), that `gpu-agent sim record` reproduces each shipped profile, that
every symbol pynvml looks up exists, NVML's error codes, init refcounting and profile
switching, and that the C parser and agent.sim.profile accept and reject the same profiles.
Must not patch pynvml: the library is loaded with agent.nvml.library and pynvml binds to it.
"""

from __future__ import annotations

import ctypes
import math
import re
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.errors import SimError
from agent.sim import lib_path, profile_names
from agent.sim.profile import format_cpulist, load_profile, nvml_view, parse_profile_text
from tests.conftest import ROOT, drain_nvml, run_gpu_agent

PROFILES_DIR = ROOT / "agent" / "sim" / "profiles"
LEVEL = {"X": 0, "PIX": 10, "PXB": 20, "PHB": 30, "NODE": 40, "SYS": 50}






def cpus_of(text: str) -> set[int]:
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def mask_cpus(words) -> set[int]:
    return {w * 64 + b for w in range(len(words)) for b in range(64) if (words[w] >> b) & 1}


def text(value) -> str:
    """pynvml hands char arrays back as str or bytes depending on the structure."""
    return value.decode() if isinstance(value, bytes) else value


def raw(name: str) -> dict:
    return yaml.safe_load((PROFILES_DIR / f"{name}.yaml").read_text())


SHIPPED = profile_names()


def test_the_four_profiles_are_shipped():
    assert {"dgx-h100", "dgx1-v100", "pcie-8gpu", "a100-mig"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_reads_back_field_by_field(node, name):
    node(name)
    want = raw(name)
    N = pynvml
    assert N.nvmlSystemGetDriverVersion() == want["driver_version"]
    assert N.nvmlSystemGetNVMLVersion() == want["nvml_version"]
    assert N.nvmlSystemGetCudaDriverVersion() == want["cuda_driver_version"]
    assert N.nvmlSystemGetCudaDriverVersion_v2() == want["cuda_driver_version"]
    gpus = want["gpus"]
    assert N.nvmlDeviceGetCount() == len(gpus)
    handles = [N.nvmlDeviceGetHandleByIndex(i) for i in range(len(gpus))]
    switches = want.get("nvswitches", [])
    for i, (h, g) in enumerate(zip(handles, gpus)):
        assert N.nvmlDeviceGetIndex(h) == g["index"] == i
        assert N.nvmlDeviceGetName(h) == g["name"]
        assert N.nvmlDeviceGetUUID(h) == g["uuid"]
        if "serial" in g:
            assert N.nvmlDeviceGetSerial(h) == g["serial"]
        else:
            with pytest.raises(N.NVMLError_NotSupported):
                N.nvmlDeviceGetSerial(h)
        assert N.nvmlDeviceGetMinorNumber(h) == g["minor"]
        pci = N.nvmlDeviceGetPciInfo(h)
        assert text(pci.busId) == g["pci"]["bus_id"]
        dom, bus, dev_fn = g["pci"]["bus_id"].split(":")
        assert (pci.domain, pci.bus, pci.device) == (int(dom, 16), int(bus, 16),
                                                     int(dev_fn.split(".")[0], 16))
        assert text(pci.busIdLegacy) == f"{int(dom, 16):04X}:{bus}:{dev_fn}"
        assert pci.pciDeviceId == g["pci"]["device_id"]
        assert pci.pciSubSystemId == g["pci"]["subsystem_id"]
        assert N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByPciBusId(g["pci"]["bus_id"])) == i
        assert N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(g["uuid"])) == i
        if "numa_node" in g:
            assert N.nvmlDeviceGetNumaNodeId(h) == g["numa_node"]
            nodes = N.nvmlDeviceGetMemoryAffinity(h, 2, N.NVML_AFFINITY_SCOPE_NODE)
            assert mask_cpus(list(nodes)) == {g["numa_node"]}
        else:
            with pytest.raises(N.NVMLError_NotSupported):
                N.nvmlDeviceGetNumaNodeId(h)
        assert mask_cpus(list(N.nvmlDeviceGetCpuAffinity(h, 64))) == cpus_of(g["cpu_affinity"])
        mem = g["memory"]
        v1 = N.nvmlDeviceGetMemoryInfo(h)
        assert (v1.total, v1.used, v1.free) == (
            mem["total"], mem["reserved"] + mem["used"],
            mem["total"] - mem["reserved"] - mem["used"])
        v2 = N.nvmlDeviceGetMemoryInfo(h, N.nvmlMemory_v2)
        assert (v2.total, v2.reserved, v2.used, v2.free) == (
            mem["total"], mem["reserved"], mem["used"],
            mem["total"] - mem["reserved"] - mem["used"])
        assert list(N.nvmlDeviceGetCudaComputeCapability(h)) == g["compute_capability"]
        if "multiprocessors" in g:
            attrs = N.nvmlDeviceGetAttributes_v2(h)
            assert attrs.multiprocessorCount == g["multiprocessors"]
            assert attrs.memorySizeMB == mem["total"] // 2**20
        assert N.nvmlDeviceGetSupportedEventTypes(h) == g["supported_events"]
        check_nvlinks(h, g.get("nvlinks", []), gpus, switches)
        check_mig(h, g)
        for j, other in enumerate(handles):
            level = N.nvmlDeviceGetTopologyCommonAncestor(h, other)
            assert level == LEVEL[want["pcie_topology"][i][j]], (i, j)


def check_nvlinks(h, links: list, gpus: list, switches: list) -> None:
    N = pynvml
    for link, target in enumerate(links):
        assert N.nvmlDeviceGetNvLinkState(h, link) == (0 if target == "down" else 1)
        if target == "down":
            continue
        remote = N.nvmlDeviceGetNvLinkRemotePciInfo(h, link)
        kind = N.nvmlDeviceGetNvLinkRemoteDeviceType(h, link)
        if isinstance(target, int):
            assert kind == N.NVML_NVLINK_DEVICE_TYPE_GPU
            assert text(remote.busId) == gpus[target]["pci"]["bus_id"]
            assert remote.pciDeviceId == gpus[target]["pci"]["device_id"]
        else:
            assert kind == N.NVML_NVLINK_DEVICE_TYPE_SWITCH
            sw = switches[int(target[len("switch"):])]
            assert text(remote.busId) == sw["bus_id"]
            assert remote.pciDeviceId == sw["device_id"]
    for link in (len(links), N.NVML_NVLINK_MAX_LINKS - 1):
        if link >= len(links):
            with pytest.raises(N.NVMLError_NotSupported):
                N.nvmlDeviceGetNvLinkState(h, link)
    with pytest.raises(N.NVMLError_NotSupported if not links else N.NVMLError_InvalidArgument):
        N.nvmlDeviceGetNvLinkState(h, N.NVML_NVLINK_MAX_LINKS)


def check_mig(h, g: dict) -> None:
    N = pynvml
    if "mig" not in g:
        with pytest.raises(N.NVMLError_NotSupported):
            N.nvmlDeviceGetMigMode(h)
        with pytest.raises(N.NVMLError_NotSupported):
            N.nvmlDeviceGetMaxMigDeviceCount(h)
        return
    mig = g["mig"]
    on = {"enabled": 1, "disabled": 0}
    assert N.nvmlDeviceGetMigMode(h) == [on[mig["mode"]], on[mig.get("pending_mode",
                                                                     mig["mode"])]]
    assert N.nvmlDeviceGetMaxMigDeviceCount(h) == mig["max_devices"]
    profiles = {p["nvml_profile"]: p for p in mig["profiles"]}
    for nvp in range(N.NVML_GPU_INSTANCE_PROFILE_COUNT):
        if nvp not in profiles:
            with pytest.raises(N.NVMLError_NotSupported):
                N.nvmlDeviceGetGpuInstanceProfileInfo(h, nvp)
            continue
        p = profiles[nvp]
        for version in (1, 2):
            info = N.nvmlDeviceGetGpuInstanceProfileInfo(h, nvp, version=version)
            assert (info.id, info.isP2pSupported, info.sliceCount, info.instanceCount,
                    info.multiprocessorCount, info.copyEngineCount, info.decoderCount,
                    info.encoderCount, info.jpegCount, info.ofaCount, info.memorySizeMB) == (
                p["id"], p["p2p"], p["slices"], p["instance_count"], p["multiprocessors"],
                p["copy_engines"], p["decoders"], p["encoders"], p["jpegs"], p["ofas"],
                p["memory_mb"])
            if version == 2:
                assert text(info.name) == f"MIG {p['name']}"
    assert N.nvmlDeviceIsMigDeviceHandle(h).value == 0
    instances = mig.get("instances", [])
    for k in range(mig["max_devices"]):
        if k >= len(instances):
            with pytest.raises(N.NVMLError_NotFound):
                N.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            continue
        inst = instances[k]
        p = profiles[inst["profile"]]
        mh = N.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
        assert N.nvmlDeviceIsMigDeviceHandle(mh).value == 1
        assert N.nvmlDeviceGetUUID(mh) == inst["uuid"]
        # a compute instance smaller than its GPU instance is named as NVML names it:
        # "<c>c.<GPU instance profile>", with its share of the multiprocessors
        ci = inst.get("compute_slices", p["slices"])
        prefix = f"{ci}c." if ci < p["slices"] else ""
        assert N.nvmlDeviceGetName(mh) == f"{g['name']} MIG {prefix}{p['name']}"
        assert N.nvmlDeviceGetGpuInstanceId(mh) == inst["gi"]
        assert N.nvmlDeviceGetComputeInstanceId(mh) == inst["ci"]
        parent = N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mh)
        assert N.nvmlDeviceGetUUID(parent) == g["uuid"]
        attrs = N.nvmlDeviceGetAttributes_v2(mh)
        assert (attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount,
                attrs.multiprocessorCount, attrs.memorySizeMB, attrs.sharedCopyEngineCount,
                attrs.sharedDecoderCount) == (p["slices"], ci, p["multiprocessors"] * ci // p["slices"],
                                              p["memory_mb"], p["copy_engines"], p["decoders"])
        mem = N.nvmlDeviceGetMemoryInfo(mh)
        assert (mem.total, mem.used) == (p["memory_mb"] * 2**20, 0)
        assert p["name"].startswith(mig_name(attrs, g["memory"]["total"]))
        assert N.nvmlDeviceGetUUID(N.nvmlDeviceGetHandleByUUID(inst["uuid"])) == inst["uuid"]
        with pytest.raises(N.NVMLError_NotSupported):
            N.nvmlDeviceGetMinorNumber(mh)
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceGetMigDeviceHandleByIndex(h, mig["max_devices"])
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceGetGpuInstanceId(h)


def mig_name(attrs, parent_total: int) -> str:
    """<slices>g.<GB>gb as go-nvlib names a MIG profile from its attributes: the memory
    fraction rounded up to eighths of the parent's memory, in whole GB."""
    fraction = math.ceil(attrs.memorySizeMB * 2**20 / parent_total * 8) / 8
    return f"{attrs.gpuInstanceSliceCount}g.{round(fraction * -(-parent_total // 2**30))}gb"


def test_a100_mig_profile_has_the_promised_mix():
    gpus = raw("a100-mig")["gpus"]

    def names(g):
        profs = {p["nvml_profile"]: p["name"] for p in g["mig"]["profiles"]}
        return sorted(profs[m["profile"]] for m in g["mig"].get("instances", []))

    assert names(gpus[0]) == ["1g.10gb"] * 7
    assert names(gpus[1]) == sorted(["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"])
    assert any(g["mig"]["mode"] == "disabled" for g in gpus)


@pytest.mark.parametrize("name", ["a100-mig", "h100-mig", "a30-mig"])
def test_mig_devices_name_their_profile_through_their_instances_as_go_nvlib_reads_them(node,
                                                                                        name):
    # go-nvlib pkg/nvlib/device/mig_device.go GetProfile (what nvidia-ctk cdi generate and
    # NVIDIA's plugin call): parent, GI and CI ids, the GPU instance by id, the compute
    # instance by id, their infos, then the GI profile and the CI profile with those ids
    from agent.nvml import discovery, mig

    node(name)
    N = pynvml
    expected = {d.uuid: d for d in mig.read_mig_devices(discovery.discover())}
    assert expected
    for uuid, device in expected.items():
        h = N.nvmlDeviceGetHandleByUUID(uuid)
        parent = N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(h)
        gi = N.nvmlDeviceGetGpuInstanceById(parent, N.nvmlDeviceGetGpuInstanceId(h))
        ci = N.nvmlGpuInstanceGetComputeInstanceById(gi, N.nvmlDeviceGetComputeInstanceId(h))
        gi_info, ci_info = N.nvmlGpuInstanceGetInfo(gi), N.nvmlComputeInstanceGetInfo(ci)
        assert (gi_info.id, ci_info.id) == (device.gi, device.ci)
        assert N.nvmlDeviceGetIndex(gi_info.device) == device.parent.index
        # memory slices: 8 of them on a 7-slice A100/H100, so a 3g.40gb is 4 wide
        assert gi_info.placement.size >= device.gi_slices
        giprof = next(p for p in range(N.NVML_GPU_INSTANCE_PROFILE_COUNT)
                      if _answers(N.nvmlDeviceGetGpuInstanceProfileInfo, parent, p)
                      and N.nvmlDeviceGetGpuInstanceProfileInfo(parent, p).id
                      == gi_info.profileId)
        ciprof = N.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_info.profileId, 0)
        assert ciprof.id == ci_info.profileId and ciprof.sliceCount == device.ci_slices
        assert ciprof.multiprocessorCount == device.multiprocessors
        gislices = N.nvmlDeviceGetGpuInstanceProfileInfo(parent, giprof).sliceCount
        assert (gislices, ci_info.placement.size) == (device.gi_slices, device.ci_slices)
        want = f"MIG {device.profile}" if device.ci_slices == device.gi_slices else \
            f"MIG {device.ci_slices}c.{device.profile.split('.', 1)[1]}"
        assert text(ciprof.name).startswith(want.split("+")[0])
    gpu = next(d.parent for d in expected.values())
    parent = N.nvmlDeviceGetHandleByIndex(gpu.index)
    with pytest.raises(N.NVMLError_NotFound):
        N.nvmlDeviceGetGpuInstanceById(parent, 14)
    gi = N.nvmlDeviceGetGpuInstanceById(parent, next(
        d.gi for d in expected.values() if d.parent.index == gpu.index))
    with pytest.raises(N.NVMLError_NotFound):
        N.nvmlGpuInstanceGetComputeInstanceById(gi, 7)
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 0, 1)  # engine profile past SHARED
    for g in load_profile(name)["gpus"]:  # a GPU with MIG off has no GPU instances
        if g.get("mig", {}).get("mode") != "enabled":
            with pytest.raises(N.NVMLError_NotSupported):
                N.nvmlDeviceGetGpuInstanceById(N.nvmlDeviceGetHandleByIndex(g["index"]), 0)


def _answers(query, *args) -> bool:
    try:
        query(*args)
        return True
    except pynvml.NVMLError:
        return False


def test_dgx_h100_is_nv18_all_to_all_over_nvswitch():
    p = load_profile("dgx-h100")
    for g in p["gpus"]:
        assert len(g["nvlinks"]) == 18
        assert all(str(x).startswith("switch") for x in g["nvlinks"])


@pytest.mark.parametrize("name", SHIPPED)
def test_record_reproduces_shipped_profile(name, tmp_path, sim_env):
    env = sim_env(name)
    out = tmp_path / "recorded.yaml"
    run_gpu_agent("sim", "record", "-o", str(out), "--nvml-library", str(lib_path()), env=env)
    assert nvml_view(load_profile(str(out))) == nvml_view(load_profile(name))


def pynvml_symbols() -> set[str]:
    text = Path(pynvml.__file__).read_text()
    return set(re.findall(r'_nvmlGetFunctionPointer\("(\w+)"\)', text))


def test_every_symbol_pynvml_references_resolves():
    names = pynvml_symbols()
    assert len(names) > 300
    lib = ctypes.CDLL(str(lib_path()))
    missing = sorted(n for n in names if not hasattr(lib, n))
    assert missing == []


def test_symbols_txt_lists_every_pynvml_symbol():
    listed = {line.split("#")[0].strip()
              for line in (ROOT / "agent/sim/nvml/symbols.txt").read_text().splitlines()}
    assert pynvml_symbols() - listed == set()


UNIMPLEMENTED = [
    pytest.param(lambda h: pynvml.nvmlDeviceGetMaxClockInfo(h, 0), id="max-clock"),
    pytest.param(lambda h: pynvml.nvmlDeviceGetFanSpeed(h), id="fan-speed"),
    pytest.param(lambda h: pynvml.nvmlDeviceGetTotalEnergyConsumption(h), id="energy"),
    pytest.param(lambda h: pynvml.nvmlDeviceGetTemperatureThreshold(h, 0),
                 id="temperature-threshold"),
    pytest.param(lambda h: pynvml.nvmlDeviceGetBoardId(h), id="board-id"),
    pytest.param(lambda h: pynvml.nvmlDeviceGetComputeRunningProcesses(h), id="processes"),
    pytest.param(lambda h: pynvml.nvmlUnitGetCount(), id="unit-count"),
    pytest.param(lambda h: pynvml.nvmlDeviceGetVbiosVersion(h), id="vbios"),
]


@pytest.mark.parametrize("call", UNIMPLEMENTED)
def test_unimplemented_functions_answer_not_supported(node, call):
    node()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        call(pynvml.nvmlDeviceGetHandleByIndex(0))


ERRORS = [
    pytest.param(lambda: pynvml.nvmlDeviceGetHandleByIndex(8), pynvml.NVMLError_InvalidArgument,
                 id="index-past-count"),
    pytest.param(lambda: pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000"),
                 pynvml.NVMLError_NotFound, id="unknown-uuid"),
    pytest.param(lambda: pynvml.nvmlDeviceGetHandleByPciBusId("00000000:EE:00.0"),
                 pynvml.NVMLError_NotFound, id="unknown-bus-id"),
    pytest.param(lambda: pynvml.nvmlDeviceGetHandleByPciBusId("not a bus id"),
                 pynvml.NVMLError_InvalidArgument, id="malformed-bus-id"),
    pytest.param(lambda: pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByIndex(0)),
                 pynvml.NVMLError_NotSupported, id="mig-on-v100"),
    pytest.param(lambda: pynvml.nvmlDeviceGetNvLinkState(pynvml.nvmlDeviceGetHandleByIndex(0), 6),
                 pynvml.NVMLError_NotSupported, id="v100-has-6-links"),
    pytest.param(lambda: pynvml.nvmlDeviceGetTotalEccErrors(
        pynvml.nvmlDeviceGetHandleByIndex(0), 7, 0), pynvml.NVMLError_InvalidArgument,
        id="ecc-bad-error-type"),
    pytest.param(lambda: pynvml.nvmlDeviceGetName(pynvml.c_nvmlDevice_t()),
                 pynvml.NVMLError_InvalidArgument, id="null-handle"),
    pytest.param(lambda: pynvml.nvmlEventSetWait_v2(pynvml.c_nvmlEventSet_t(), 0),
                 pynvml.NVMLError_InvalidArgument, id="null-event-set"),
]


@pytest.mark.parametrize("call,error", ERRORS)
def test_error_codes(node, call, error):
    node("dgx1-v100")
    with pytest.raises(error):
        call()


def test_garbage_handle_is_invalid_argument_not_a_crash(node):
    node()
    lib = ctypes.CDLL(str(lib_path()))
    buf = ctypes.create_string_buffer(96)
    junk = ctypes.create_string_buffer(64)  # memory that is not a device
    assert lib.nvmlDeviceGetName(junk, buf, 96) == pynvml.NVML_ERROR_INVALID_ARGUMENT


@pytest.mark.parametrize("fn,args", [
    pytest.param("nvmlDeviceGetCount_v2", (None,), id="count"),
    pytest.param("nvmlDeviceGetHandleByIndex_v2", (0, None), id="handle"),
    pytest.param("nvmlSystemGetCudaDriverVersion", (None,), id="cuda"),
    pytest.param("nvmlEventSetCreate", (None,), id="event-set"),
])
def test_null_out_pointer_is_invalid_argument(node, fn, args):
    node()
    assert getattr(ctypes.CDLL(str(lib_path())), fn)(*args) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_small_buffer_is_insufficient_size(node):
    node()
    lib = ctypes.CDLL(str(lib_path()))
    buf = ctypes.create_string_buffer(4)
    assert lib.nvmlSystemGetDriverVersion(buf, 4) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE


@pytest.mark.parametrize("call", [
    pytest.param(lambda: pynvml.nvmlDeviceGetCount(), id="count"),
    pytest.param(lambda: pynvml.nvmlDeviceGetHandleByIndex(0), id="handle"),
    pytest.param(lambda: pynvml.nvmlSystemGetDriverVersion(), id="driver-version"),
    pytest.param(lambda: pynvml.nvmlEventSetCreate(), id="event-set"),
    pytest.param(lambda: pynvml.nvmlShutdown(), id="shutdown"),
])
def test_calls_before_init_are_uninitialized(node, call):
    node()
    drain_nvml()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        call()


def test_init_is_refcounted(node):
    node()
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    assert pynvml.nvmlDeviceGetCount() == 8  # one init still holds it
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_handles_from_before_a_reinit_keep_working_or_fail_cleanly(node):
    node("dgx1-v100")
    old = pynvml.nvmlDeviceGetHandleByIndex(7)
    node("a100-mig")
    assert pynvml.nvmlDeviceGetName(old) == "NVIDIA A100-SXM4-80GB"  # same slot, new node


def test_profile_switches_at_the_next_0_to_1_init(node, monkeypatch):
    node("pcie-8gpu")
    assert pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) == "NVIDIA L40S"
    monkeypatch.setenv("GPU_AGENT_SIM_PROFILE", "dgx-h100")
    pynvml.nvmlInit()  # 1 -> 2: the loaded profile stays
    assert pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) == "NVIDIA L40S"
    drain_nvml()
    pynvml.nvmlInit()  # 0 -> 1: re-read
    assert pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) == \
        "NVIDIA H100 80GB HBM3"


def test_unset_profile_means_dgx1_v100(node, monkeypatch):
    node()
    drain_nvml()
    monkeypatch.delenv("GPU_AGENT_SIM_PROFILE")
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) == \
        "Tesla V100-SXM2-16GB"


def test_profile_by_path(node, tmp_path):
    path = tmp_path / "copy.yaml"
    path.write_text((PROFILES_DIR / "pcie-8gpu.yaml").read_text())
    node(str(path))
    assert pynvml.nvmlDeviceGetCount() == 8


# ---- the C parser and agent.sim.profile agree ----

BASE = (PROFILES_DIR / "pcie-8gpu.yaml").read_text()


def edit(old: str, new: str, count: int = 1) -> str:
    assert old in BASE, old
    return BASE.replace(old, new, count)


def with_name(line: str) -> str:
    """BASE with its top-level `name:` line replaced by `line`."""
    return edit('name: "pcie-8gpu"', line)


AGREEMENT = [
    pytest.param(BASE, None, id="shipped"),
    pytest.param(with_name("name: 'pcie ''8'' gpu'  # comment"), None,
                 id="single-quotes-and-comment"),
    pytest.param(BASE.replace("\n  - [", "\n- ["), None, id="indentless-sequence"),
    pytest.param(edit("    minor: 0\n", "    minor: 0x0\n"), None, id="hex-int"),
    pytest.param(edit("    minor: 1\n", "    minor: 1_0\n"), None, id="underscore-int"),
    pytest.param(with_name("name: pcie-8gpu"), None, id="plain-string"),
    pytest.param(edit("    minor: 1\n", "    minor: 0o1\n"),
                 "gpus[1].minor: expected an integer, found a string", id="0o-is-a-string"),
    pytest.param(edit("    minor: 1\n", "    minor: 1.0\n"),
                 "gpus[1].minor: expected an integer, found a boolean", id="float"),
    pytest.param(with_name("name: yes"), "name: expected a string, found a boolean",
                 id="bool-is-not-a-string"),
    pytest.param(with_name("name: 2024-01-02"),
                 "name: expected a string, found a boolean, float or date", id="date"),
    pytest.param(with_name("name:"), "name: expected a string, found null", id="null"),
    pytest.param(edit("gpus:\n  - index: 0", "gpus:\n- index: 0"), "", id="bad-indentation"),
    pytest.param(edit("    memory:\n", "    memory: {total: 1}\n    memoryx:\n"),
                 "flow mappings", id="flow-mapping"),
    pytest.param(edit('description: "', 'description: |\n  "'), "block scalars",
                 id="block-scalar"),
    pytest.param(with_name("name: &a x"), "anchors", id="anchor"),
    pytest.param(with_name('name: "pcie-8gpu"\nname: "x"'), "duplicate key 'name'",
                 id="duplicate-key"),
    pytest.param(with_name('name: "unterminated'), "", id="unterminated-quote"),
    pytest.param(edit("    minor: 0\n", "    minor: 0\n    color: blue\n"),
                 "gpus[0].color: unknown key", id="unknown-key"),
    pytest.param(edit("    compute_capability: [8, 9]\n", "    compute_capability: [8]\n"),
                 "gpus[0].compute_capability: expected [major, minor]", id="short-cc"),
    pytest.param(edit("  - [X, PIX", "  - [PIX, PIX"), "pcie_topology[0][0]",
                 id="diagonal-not-x"),
    pytest.param(edit('bus_id: "00000000:20:00.0"', 'bus_id: "00000000:10:00.0"'),
                 "gpus[1]: pci.bus_id repeats gpus[0]", id="duplicate-bus-id"),
    pytest.param(edit("    supported_events: 0x1F\n", "    supported_events: 0x1F\n"
                      "    nvlinks: [1]\n"), "1 links to GPU 1 but GPU 1 has 0 links back",
                 id="one-sided-nvlink"),
    pytest.param(edit("    supported_events: 0x1F\n", "    supported_events: 0x1F\n"
                      "    nvlinks: [switch0]\n"), "names no entry of nvswitches",
                 id="missing-switch"),
    pytest.param(edit("schema: 1", "schema: 2"), "schema: must be an integer from 1 to 1",
                 id="schema-version"),
    pytest.param(edit('cpu_affinity: "0-13,28-41"', 'cpu_affinity: "13-0"'),
                 "gpus[0].cpu_affinity: CPU range 13-0", id="bad-cpulist"),
    pytest.param(BASE + "faults:\n  init: DRIVER_NOT_LOADED\n  lost: [9]\n",
                 "faults.lost[0]: must be an integer from 0 to 7", id="fault-gpu-out-of-range"),
    pytest.param(BASE + "faults:\n  init: NOT_AN_ERROR\n", "faults.init",
                 id="fault-unknown-code"),
]


@pytest.mark.parametrize("text,problem", AGREEMENT)
def test_c_parser_and_profile_py_agree(node, monkeypatch, capfd, tmp_path, text, problem):
    """Both accept, or both reject naming the same key path ('' : a YAML-level error)."""
    path = tmp_path / "p.yaml"
    path.write_text(text)
    node()
    drain_nvml()
    monkeypatch.setenv("GPU_AGENT_SIM_PROFILE", str(path))
    capfd.readouterr()
    if problem is None:
        parse_profile_text(text, str(path))
        pynvml.nvmlInit()
        assert pynvml.nvmlDeviceGetCount() == 8
        return
    with pytest.raises(SimError) as exc:
        parse_profile_text(text, str(path))
    assert problem in str(exc.value)
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()
    err = capfd.readouterr().err
    assert "simulated NVML: nvmlInit failed" in err
    assert str(path) in err
    assert problem in err


def test_c_error_names_the_key_path(node, monkeypatch, capfd, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(edit('      device_id: 0x26B910DE\n', '      device_id: "0x26B910DE"\n'))
    node()
    drain_nvml()
    monkeypatch.setenv("GPU_AGENT_SIM_PROFILE", str(path))
    capfd.readouterr()
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"{path}: gpus[0].pci.device_id: expected an integer, found a string" in err[0]
    with pytest.raises(SimError, match=r"gpus\[0\]\.pci\.device_id: expected an integer"):
        load_profile(str(path))


def test_record_and_check_commands_exist():
    out = run_gpu_agent("sim", "profile", "--check", "dgx1-v100").stdout
    assert "GPU0\tX\tNV1\tNV1\tNV2\tNV2\tSYS\tSYS\tSYS" in out


def test_record_without_a_library_is_a_clear_error(tmp_path):
    proc = run_gpu_agent("sim", "record", "--nvml-library", str(tmp_path / "nope.so"),
                         check=False)
    assert proc.returncode != 0
    assert "cannot record" in proc.stderr or "cannot open NVML library" in proc.stderr


def test_library_loads_in_a_plain_c_program(tmp_path, sim_env):
    """A C caller (like agent._fast) dlopen()s the library and waits on an event set."""
    src = tmp_path / "t.c"
    src.write_text(r"""
#include <dlfcn.h>
#include <stdio.h>
typedef int (*f0)(void);
typedef int (*fcount)(unsigned *);
typedef int (*fset)(void **);
typedef int (*fwait)(void *, void *, unsigned);
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) return 10;
    unsigned n = 0; void *set = 0; char data[64];
    if (((f0)dlsym(h, "nvmlInit_v2"))()) return 11;
    if (((fcount)dlsym(h, "nvmlDeviceGetCount_v2"))(&n)) return 12;
    if (((fset)dlsym(h, "nvmlEventSetCreate"))(&set)) return 13;
    int rc = ((fwait)dlsym(h, "nvmlEventSetWait_v2"))(set, data, 10);
    printf("%u %d\n", n, rc);
    return ((f0)dlsym(h, "nvmlShutdown"))();
}
""")
    exe = tmp_path / "t"
    subprocess.run(["gcc", "-o", str(exe), str(src), "-ldl"], check=True)
    proc = subprocess.run([str(exe), str(lib_path())], env=sim_env("dgx-h100"),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["8", str(pynvml.NVML_ERROR_TIMEOUT)]


def test_pynvml_in_a_fresh_process_binds_to_the_simulator(sim_env):
    code = ("from agent.nvml import library; from agent.sim import lib_path; import pynvml;"
            "library.init(str(lib_path())); print(pynvml.nvmlDeviceGetCount())")
    proc = subprocess.run([sys.executable, "-c", code], env=sim_env("a100-mig"), cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "8"


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cpus=st.sets(st.integers(0, 4095), max_size=200))
def test_any_cpu_affinity_reads_back(node, tmp_path, cpus):
    cpulist = format_cpulist(sorted(cpus))
    assert cpus_of(cpulist) == cpus
    path = tmp_path / "p.yaml"
    path.write_text(edit('cpu_affinity: "0-13,28-41"', f'cpu_affinity: "{cpulist}"'))
    node(str(path))
    words = pynvml.nvmlDeviceGetCpuAffinity(pynvml.nvmlDeviceGetHandleByIndex(0), 64)
    assert mask_cpus(list(words)) == cpus
