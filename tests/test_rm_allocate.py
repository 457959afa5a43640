"""Allocate responses as NVIDIA's plugin builds them, for every strategy combination, and the
refusal of bad requests. (End-to-end over gRPC comes with the daemon tests.)"""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.errors import RequestError
from agent.nvml.discovery import Gpu
from agent.rm.allocate import (
    ResponseOptions,
    container_response,
    resolve_request,
)
from agent.rm.devices import RESOURCE_GPU, full_gpu_devices
from agent.rm.manager import ResourceManager

GPUS = [
    Gpu(index=i, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", name="Tesla V100-SXM2-16GB",
        minor=i + 10 if i == 3 else i, pci_bus_id=f"00000000:{i + 6:02X}:00.0",
        numa_node=i // 4, memory_total=16 << 30, compute_capability=(7, 0), mig_enabled=False)
    for i in range(8)
]
DEVICES = full_gpu_devices(GPUS)
BY_ID = {d.id: d for d in DEVICES}


def test_one_device_per_gpu_with_uuid_ids_and_minor_based_nodes():
    assert [d.id for d in DEVICES] == [g.uuid for g in GPUS]
    assert [d.index for d in DEVICES] == [str(i) for i in range(8)]
    assert BY_ID[GPUS[3].uuid].paths == ("/dev/nvidia13",)


def test_mig_enabled_gpus_are_full_gpu_devices_under_mig_strategy_none():
    # as NVIDIA's plugin (k8s-device-plugin internal/rm/device_map.go, buildGPUDeviceMap)
    mig = GPUS[0]._replace(mig_enabled=True)
    assert full_gpu_devices([GPUS[1], mig]) == [BY_ID[GPUS[0].uuid], BY_ID[GPUS[1].uuid]]


@pytest.mark.parametrize(
    "id_strategy,expected", [("uuid", [GPUS[2].uuid, GPUS[5].uuid]), ("index", ["2", "5"])]
)
def test_envvar_lists_ids_in_request_order(id_strategy, expected):
    devices = resolve_request("nvidia.com/gpu", [GPUS[2].uuid, GPUS[5].uuid], BY_ID)
    r = container_response(devices, ResponseOptions(id_strategy=id_strategy))
    assert r.envs == {"NVIDIA_VISIBLE_DEVICES": ",".join(expected)}
    assert r.mounts == [] and r.devices == [] and r.annotations == {} and r.cdi_devices == []


@pytest.mark.parametrize("id_strategy", ["uuid", "index"])
def test_volume_mounts_point_the_env_at_one_mount_per_device(id_strategy):
    devices = [BY_ID[GPUS[1].uuid], BY_ID[GPUS[0].uuid]]
    r = container_response(devices, ResponseOptions(("volume-mounts",), id_strategy))
    ids = [GPUS[1].uuid, GPUS[0].uuid] if id_strategy == "uuid" else ["1", "0"]
    assert r.envs == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert [(m.container_path, m.host_path, m.read_only) for m in r.mounts] == [
        (f"/var/run/nvidia-container-devices/{i}", "/dev/null", False) for i in ids
    ]


def test_volume_mounts_win_over_envvar_when_both_are_set():
    r = container_response([DEVICES[0]], ResponseOptions(("envvar", "volume-mounts")))
    assert r.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    assert len(r.mounts) == 1


@pytest.mark.parametrize("prefix", ["cdi.k8s.io/", "nvidia.cdi.k8s.io/"])
def test_cdi_annotations_name_the_toolkit_devices(prefix):
    r = container_response(DEVICES[:2], ResponseOptions(("cdi-annotations",),
                                                         cdi_annotation_prefix=prefix))
    assert r.envs == {} and r.cdi_devices == []
    [(key, value)] = r.annotations.items()
    assert re.fullmatch(re.escape(prefix) + r"gpu-agent_[0-9a-f-]{36}", key)
    assert value == f"nvidia.com/gpu={GPUS[0].uuid},nvidia.com/gpu={GPUS[1].uuid}"


def test_cdi_annotation_keys_are_unique_per_response():
    opts = ResponseOptions(("cdi-annotations",))
    keys = {next(iter(container_response(DEVICES[:1], opts).annotations)) for _ in range(50)}
    assert len(keys) == 50


def test_cdi_cri_uses_index_names_under_the_index_strategy():
    r = container_response(DEVICES[3:5], ResponseOptions(("cdi-cri",), "index"))
    assert r.cdi_devices == ["nvidia.com/gpu=3", "nvidia.com/gpu=4"]
    assert r.annotations == {} and r.envs == {}


def test_device_specs_add_the_control_nodes_present_under_the_dev_root(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    opts = ResponseOptions(pass_device_specs=True, dev_root=str(tmp_path))
    r = container_response([BY_ID[GPUS[3].uuid]], opts)
    assert [(s.container_path, s.host_path, s.permissions) for s in r.devices] == [
        ("/dev/nvidiactl", f"{dev}/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", f"{dev}/nvidia-uvm", "rw"),
        ("/dev/nvidia13", f"{dev}/nvidia13", "rw"),
    ]


def test_a_control_node_that_appears_later_is_in_the_next_answer(tmp_path):
    # with passDeviceSpecs each answer holds the control nodes that exist now: nvidia-uvm is
    # created when CUDA is first used, and the next container must get it
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").touch()
    opts = ResponseOptions(pass_device_specs=True, dev_root=str(tmp_path))
    manager = ResourceManager(RESOURCE_GPU, DEVICES, opts)
    [(_, first)] = manager.allocate([[GPUS[3].uuid]])
    assert "/dev/nvidia-uvm" not in [s.container_path for s in first.devices]
    (dev / "nvidia-uvm").touch()
    [(_, second)] = manager.allocate([[GPUS[3].uuid]])
    assert "/dev/nvidia-uvm" in [s.container_path for s in second.devices]


def test_the_same_request_gets_the_same_answer_until_a_reload():
    manager = ResourceManager(RESOURCE_GPU, DEVICES, ResponseOptions())
    [(devices, a)] = manager.allocate([[GPUS[2].uuid, GPUS[5].uuid]])
    [(_, b)] = manager.allocate([[GPUS[2].uuid, GPUS[5].uuid]])
    assert repr(a) == repr(b)
    assert a.envs == {"NVIDIA_VISIBLE_DEVICES": f"{GPUS[2].uuid},{GPUS[5].uuid}"}
    assert [d.id for d in devices] == [GPUS[2].uuid, GPUS[5].uuid]
    manager.reconfigure(DEVICES, ResponseOptions(("volume-mounts",)))
    [(_, c)] = manager.allocate([[GPUS[2].uuid, GPUS[5].uuid]])
    assert c.mounts and c.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"


def test_no_device_specs_unless_asked():
    assert container_response(DEVICES[:1], ResponseOptions()).devices == []


@pytest.mark.parametrize(
    "ids,reason",
    [
        ([], "no device IDs"),
        (["GPU-nope"], "unknown device: GPU-nope"),
        ([GPUS[0].uuid, GPUS[0].uuid], f"duplicate device: {GPUS[0].uuid}"),
        ([GPUS[0].uuid, "3"], "unknown device: 3"),
    ],
    ids=["empty", "unknown", "duplicate", "index-is-not-an-id"],
)
def test_bad_requests_are_refused_with_a_reason(ids, reason):
    with pytest.raises(RequestError) as err:
        resolve_request("nvidia.com/gpu", ids, BY_ID)
    assert str(err.value) == f"invalid allocation request for 'nvidia.com/gpu': {reason}"


@given(st.permutations(range(8)).flatmap(lambda p: st.integers(1, 8).map(lambda k: p[:k])),
       st.sampled_from(["uuid", "index"]))
def test_every_strategy_names_exactly_the_requested_devices(order, id_strategy):
    ids = [GPUS[i].uuid for i in order]
    devices = resolve_request("nvidia.com/gpu", ids, BY_ID)
    opts = ResponseOptions(("envvar", "cdi-annotations", "cdi-cri"), id_strategy)
    r = container_response(devices, opts)
    expect = ids if id_strategy == "uuid" else [str(i) for i in order]
    assert r.envs["NVIDIA_VISIBLE_DEVICES"].split(",") == expect
    assert r.cdi_devices == [f"nvidia.com/gpu={i}" for i in expect]
    assert next(iter(r.annotations.values())).split(",") == r.cdi_devices


def test_an_allocate_is_recorded_by_the_journal_hook_of_its_time():
    # the daemon loads the journal after the first registration and then gives every manager
    # its hook (agent.rm.resources.Resources.set_journal): each Allocate is recorded by the
    # hook the manager holds when it answers, with the devices and responses it answered
    calls = []
    m = ResourceManager(RESOURCE_GPU, DEVICES, ResponseOptions(),
                        journal=lambda res, hits: calls.append(("waiting hook", res, len(hits))))
    m.allocate([[DEVICES[0].id]])
    m.journal = lambda res, hits: calls.append(("journal", res, [d.id for d in hits[0][0]]))
    answer = m.allocate([[DEVICES[0].id]])
    m.record(answer)  # an answer given again (the plugin keeps them) is recorded the same way
    assert calls == [("waiting hook", RESOURCE_GPU, 1)] + \
        [("journal", RESOURCE_GPU, [DEVICES[0].id])] * 2
    assert answer[0].response.envs == {"NVIDIA_VISIBLE_DEVICES": DEVICES[0].id}
