"""The CDI check (agent.rm.cdi): spec files written like nvidia-ctk's, resolved as the CDI
library resolves them, compared with the names Allocate hands out; and the agent's use of it at
start and on SIGHUP, against the simulated node (warn, keep serving, check again on reload)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import yaml

from agent.rm import cdi
from agent.rm.allocate import ResponseOptions, container_response
from agent.rm.devices import Device
from agent.sim.profile import load_profile
from agent.status import format_status, read_status
from tests.daemon_harness import GPU, Node, NotifySocket, log_level

GPUS = load_profile("dgx1-v100")["gpus"]
DEVICES = [Device(id=g["uuid"], index=str(g["index"]), gpu_uuid=g["uuid"], gpu_index=g["index"],
                  numa_node=g["numa_node"], paths=(f"/dev/nvidia{g['minor']}",))
           for g in GPUS]
GENERATE = "nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml"
REFRESH = "systemctl enable --now nvidia-cdi-refresh.path nvidia-cdi-refresh.service"


def toolkit_spec(gpus=GPUS, names=("index", "uuid")) -> str:
    """A spec as `nvidia-ctk cdi generate` writes it: common edits, one device per GPU under
    each name (index and UUID), and `all`."""
    def edits(minors):
        return {"deviceNodes": [{"path": f"/dev/nvidia{m}"} for m in minors]}

    devices = []
    for g in gpus:
        for how in names:
            devices.append({"containerEdits": edits([g["minor"]]),
                            "name": str(g["index"]) if how == "index" else g["uuid"]})
    devices.append({"containerEdits": edits([g["minor"] for g in gpus]), "name": "all"})
    doc = {
        "cdiVersion": "0.5.0",
        "containerEdits": {
            "deviceNodes": [{"path": p} for p in ("/dev/nvidia-modeset", "/dev/nvidia-uvm",
                                                  "/dev/nvidia-uvm-tools", "/dev/nvidiactl")],
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "hooks": [{"args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib64"],
                       "hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook"}],
            "mounts": [{"containerPath": "/usr/bin/nvidia-smi", "hostPath": "/usr/bin/nvidia-smi",
                        "options": ["ro", "nosuid", "nodev", "bind"]}],
        },
        "devices": devices,
        "kind": "nvidia.com/gpu",
    }
    return "---\n" + yaml.safe_dump(doc, sort_keys=False)


def opts(strategy="cdi-cri", id_strategy="uuid") -> ResponseOptions:
    return ResponseOptions(list_strategies=tuple(strategy.split(",")), id_strategy=id_strategy)


@pytest.fixture
def dirs(tmp_path):
    """Stand-ins for /etc/cdi and /var/run/cdi, in CDI's order (the second one wins)."""
    etc, run = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    etc.mkdir()
    run.mkdir()
    return etc, run


# -- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["cdi-cri", "cdi-annotations", "envvar,cdi-annotations"])
@pytest.mark.parametrize("id_strategy", ["uuid", "index"])
def test_the_names_checked_are_those_allocate_hands_out(strategy, id_strategy):
    o = opts(strategy, id_strategy)
    names = cdi.device_names(DEVICES, o)
    for device in DEVICES:
        response = container_response([device], o)
        handed_out = response.cdi_devices or next(iter(response.annotations.values())).split(",")
        assert [n for n, d in names.items() if d is device] == handed_out
    want = [d.id if id_strategy == "uuid" else d.index for d in DEVICES]
    assert list(names) == [f"nvidia.com/gpu={i}" for i in want]


@pytest.mark.parametrize("strategy", ["envvar", "volume-mounts", "envvar,volume-mounts"])
def test_nothing_to_check_without_a_cdi_strategy(dirs, strategy):
    assert cdi.check(DEVICES, opts(strategy), [str(d) for d in dirs]) is None


# -- the check ---------------------------------------------------------------------------------


@pytest.mark.parametrize("id_strategy", ["uuid", "index"])
@pytest.mark.parametrize("where", [0, 1], ids=["etc-cdi", "run-cdi"])
def test_the_toolkit_spec_defines_every_name(dirs, id_strategy, where):
    spec = dirs[where] / "nvidia.yaml"
    spec.write_text(toolkit_spec())
    result = cdi.check(DEVICES, opts("cdi-cri", id_strategy), [str(d) for d in dirs])
    assert result.ok and result.missing == ()
    assert set(result.index.names.values()) == {str(spec)}
    assert result.summary() == "CDI spec defines all 8 device names"
    assert f"all defined by {spec}" in result.message()
    assert result.to_json()["ok"] is True


def test_no_spec_says_exactly_what_to_run(dirs):
    result = cdi.check(DEVICES, opts("cdi-annotations"), [str(d) for d in dirs])
    assert not result.ok and len(result.missing) == 8
    message = result.message()
    assert f"`{GENERATE}`" in message and f"`{REFRESH}`" in message
    assert "systemctl reload gpu-agent" in message
    assert "there is no spec file there" in message
    g = GPUS[0]
    assert f"nvidia.com/gpu={g['uuid']} (GPU {g['index']} {g['uuid']})" in message
    assert result.summary() == "CDI spec lacks 8 of 8 device names (see the log)"


def test_missing_directories_are_not_an_error(tmp_path):
    result = cdi.check(DEVICES, opts(), [str(tmp_path / "nope"), str(tmp_path / "nor")])
    assert not result.ok and result.index.problems == () and result.index.files == ()


def test_a_spec_for_other_gpus_names_the_missing_ones(dirs):
    spec = dirs[1] / "nvidia.yaml"
    spec.write_text(toolkit_spec(GPUS[:6]))  # made before two GPUs were added
    result = cdi.check(DEVICES, opts("cdi-cri", "index"), [str(d) for d in dirs])
    assert result.missing == ("nvidia.com/gpu=6", "nvidia.com/gpu=7")
    assert f"the specs there ({spec}) do not define them" in result.message()
    assert result.summary() == "CDI spec lacks 2 of 8 device names (see the log)"


def test_an_index_only_spec_lacks_the_uuid_names(dirs):
    (dirs[0] / "nvidia.yaml").write_text(toolkit_spec(names=("index",)))
    assert len(cdi.check(DEVICES, opts("cdi-cri", "uuid"), [str(d) for d in dirs]).missing) == 8
    assert cdi.check(DEVICES, opts("cdi-cri", "index"), [str(d) for d in dirs]).ok


def test_json_specs_are_read_and_other_files_are_not(dirs):
    doc = yaml.safe_load(toolkit_spec())
    (dirs[0] / "nvidia.json").write_text(json.dumps(doc))
    (dirs[1] / "nvidia.yml").write_text(toolkit_spec())  # CDI reads .yaml and .json only
    (dirs[1] / "sub").mkdir()
    (dirs[1] / "sub" / "nvidia.yaml").write_text(toolkit_spec())  # nor subdirectories
    index = cdi.read_specs([str(d) for d in dirs])
    assert index.files == (str(dirs[0] / "nvidia.json"),)
    assert cdi.check(DEVICES, opts(), [str(d) for d in dirs]).ok


def test_a_later_directory_overrides_an_earlier_one(dirs):
    (dirs[0] / "nvidia.yaml").write_text(toolkit_spec())
    (dirs[1] / "nvidia.yaml").write_text(toolkit_spec())
    index = cdi.read_specs([str(d) for d in dirs])
    assert index.problems == ()
    assert set(index.names.values()) == {str(dirs[1] / "nvidia.yaml")}


def test_the_same_name_twice_in_one_directory_is_a_conflict(dirs):
    (dirs[0] / "nvidia.yaml").write_text(toolkit_spec())
    (dirs[0] / "nvidia-old.yaml").write_text(toolkit_spec(GPUS[:1]))
    (dirs[1] / "gpu0.yaml").write_text(toolkit_spec(GPUS[:1]))  # does not settle it (CDI)
    result = cdi.check(DEVICES, opts("cdi-cri", "index"), [str(d) for d in dirs])
    assert result.missing == ("nvidia.com/gpu=0",)
    (problem,) = [p for p in result.index.problems if "nvidia.com/gpu=0 " in p]
    assert str(dirs[0] / "nvidia-old.yaml") in problem and str(dirs[0] / "nvidia.yaml") in problem
    assert "container runtimes refuse it" in result.message()


@pytest.mark.parametrize("text, reason", [
    ("kind: nvidia.com/gpu\ndevices: [\n", "not valid YAML"),
    ("- just a list\n", "not a CDI spec"),
    ("cdiVersion: 0.5.0\nkind: gpu\ndevices: []\n", "kind: expected vendor/class"),
    ("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: {}\n", "devices: expected a list"),
    ("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: ''\n", "devices[0].name"),
], ids=["yaml-syntax", "not-a-mapping", "bad-kind", "devices-not-a-list", "empty-name"])
def test_a_broken_spec_is_reported_with_its_file_and_the_rest_still_read(dirs, text, reason):
    (dirs[0] / "broken.yaml").write_text(text)
    (dirs[1] / "nvidia.yaml").write_text(toolkit_spec())
    result = cdi.check(DEVICES, opts(), [str(d) for d in dirs])
    assert result.ok
    (problem,) = result.index.problems
    assert problem.startswith(f"{dirs[0] / 'broken.yaml'} is not a usable CDI spec: {reason}")
    assert problem in result.message()


# -- the agent ---------------------------------------------------------------------------------


@pytest.fixture
def node():
    with Node() as n:
        yield n


def test_agent_warns_keeps_serving_and_checks_again_on_sighup(node):
    notify = NotifySocket(node)
    try:
        agent = node.agent("--device-list-strategy", "cdi-cri",
                           env=node.env(NOTIFY_SOCKET=notify.address))
        agent.wait_registered(1)  # a missing spec is not fatal
        ready = notify.wait_key("READY", "1")
        assert notify.messages[ready]["STATUS"].endswith(
            "; CDI spec lacks 8 of 8 device names (see the log)")
        error = next(line for line in agent.log.splitlines() if log_level(line) == "ERROR"
                     and "CDI:" in line)
        assert GENERATE in error and REFRESH in error and GPUS[3]["uuid"] in error
        status = read_status(node.state)
        assert status["cdi"]["ok"] is False and len(status["cdi"]["missing"]) == 8
        assert "8 of 8 device names missing" in format_status(status)
        # Allocate still answers with the CDI names
        pod = node.client.admit_pod("p", {"main": {GPU: 1}})
        (name,) = [c.name for c in pod.container("main").allocation(GPU).container_response
                   .cdi_devices]
        assert name.startswith("nvidia.com/gpu=GPU-")

        Path(node.cdi_dirs[1]).mkdir()
        Path(node.cdi_dirs[1], "nvidia.yaml").write_text(toolkit_spec())
        agent.send(signal.SIGHUP)
        agent.wait_log("configuration reloaded (reload 1)")
        assert node.client.state().resource(GPU).registrations == 1  # served on, no gap
        assert f"all defined by {node.cdi_dirs[1]}/nvidia.yaml" in agent.log
        status = read_status(node.state)
        assert status["cdi"]["ok"] is True and status["cdi"]["missing"] == []
        assert "CDI" not in status["summary"]
        assert agent.stop() == 0
    finally:
        notify.close()


def test_agent_with_the_toolkit_spec_starts_without_a_warning(node):
    Path(node.cdi_dirs[0]).mkdir()
    Path(node.cdi_dirs[0], "nvidia.yaml").write_text(toolkit_spec())
    agent = node.agent("--device-list-strategy", "envvar,cdi-annotations",
                       "--device-id-strategy", "index")
    agent.wait_registered(1)
    agent.wait_log("CDI: the cdi-annotations device-list strategy hands out 8 device names, "
                   f"all defined by {node.cdi_dirs[0]}/nvidia.yaml")
    assert not [line for line in agent.log.splitlines()
                if log_level(line) in ("ERROR", "WARNING") and "CDI" in line]
    node.status_when(lambda doc: doc["cdi"] and doc["cdi"]["ok"], "the CDI check passed")
    assert agent.stop() == 0
