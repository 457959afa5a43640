"""`gpu-agent doctor`: each check both ways on simulated driver trees (agent.sim.driver_tree),
against real processes where the check talks to something (the simulated NVML, the simulated
kubelet over real unix sockets, `gpu-agent run`), the --json schema and the exit codes.

Where the expected configuration keys come from (NVIDIA's container toolkit and containerd):
- containerd's CRI runtime plugin is "io.containerd.grpc.v1.cri" in config version 2 and
  "io.containerd.cri.v1.runtime" in version 3 (nvidia-container-toolkit
  pkg/config/engine/containerd/containerd.go `criRuntimePluginName`, commit 03d77904); the
  runtime is written at plugins.<plugin>.containerd.runtimes.nvidia with options.BinaryName,
  `--set-as-default` sets plugins.<plugin>.containerd.default_runtime_name, and `--cdi.enabled`
  sets plugins.<plugin>.enable_cdi (config.go `AddRuntime`, `Set`, commit 2085b854);
  newer toolkits write the runtime to a drop-in that the top-level file `imports`
  (config_drop_in.go `ensureImports`).
- enable_cdi is false by default in containerd 1.x and true in 2.x (containerd PR #9621,
  commit c8e8a093; docs/cri/config.md lists `enable_cdi = true` for 2.x).
- CRI-O: crio.runtime.runtimes.nvidia.runtime_path, crio.runtime.default_runtime, drop-ins in
  /etc/crio/crio.conf.d; CDI is always on (toolkit pkg/config/engine/crio/crio.go `EnableCDI`
  is a no-op, commit 03d77904).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import socket
import stat
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from agent._proto.podresources.v1 import api_pb2_grpc as pr_grpc
from agent.doctor import devnodes, kubelet, runtime, service, toolkit
from agent.doctor.context import make_context
from agent.doctor.model import EXIT_FAIL, EXIT_OK, EXIT_WARN, FAIL, OK, SKIP, WARN
from agent.doctor.report import SCHEMA_VERSION
from agent.doctor.runner import SPECS
from agent.sim import driver_tree
from agent.sim.driver_tree import build, containerd_config
from tests.conftest import ROOT, run_gpu_agent
from tests.daemon_harness import GPU, LIB, Node

STRATEGY = "envvar,cdi-cri"
# The checks, in report order: part of the --json schema (docs/troubleshooting.md).
CHECK_IDS = [
    "driver.nvml", "driver.versions", "driver.gpus", "driver.persistence", "driver.mig",
    "toolkit.nvidia-ctk", "toolkit.runtime", "toolkit.cdi-spec",
    "runtime.containerd", "runtime.crio",
    "kubelet.socket", "kubelet.podresources", "kubelet.allocatable", "kubelet.registration",
    "dra.sockets", "dra.driver",
    "devices.nodes", "devices.dev-char",
    "agent.unit", "agent.config", "agent.state-dir", "agent.journal",
]


@pytest.fixture
def tmp_root():
    d = tempfile.mkdtemp(prefix="gadr", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def live():
    """A simulated node (dgx1-v100) with kubelet and `gpu-agent run` registered, and a driver
    tree to point the doctor at; shared by the tests that only read it."""
    node = Node("dgx1-v100")
    tree = build(node.path("root"), "dgx1-v100")
    agent = node.agent("--device-list-strategy", STRATEGY,
                       "--cdi-spec-dirs", tree.path("/etc/cdi"))
    try:
        agent.wait_registered()
        node.status_when(lambda d: d["resources"] and d["resources"][0]["registered"]
                         and d.get("state") is not None, "registration and the journal")
        yield node, tree, agent
    finally:
        node.close()


def doctor_argv(node: Node, root: str, *extra: str, strategy: str = STRATEGY,
                state: str | None = None) -> list[str]:
    return ["doctor", "--json", "--root", root, "--kubelet-socket", node.kubelet_socket,
            "--pod-resources-socket", node.podresources_socket,
            "--state-dir", state or node.state, "--nvml-library", LIB,
            "--device-list-strategy", strategy,
            "--cdi-spec-dirs", os.path.join(root, "etc/cdi"), *extra]


def run_doctor(node: Node, root: str, *extra: str, env: dict | None = None, **kw):
    """(exit code, {check id: check}, the JSON document) of `gpu-agent doctor --json`."""
    proc = run_gpu_agent(*doctor_argv(node, root, *extra, **kw),
                         env=node.env() if env is None else env, check=False)
    assert proc.returncode in (0, 1, 2), proc.stderr
    doc = json.loads(proc.stdout)
    return proc.returncode, {c["id"]: c for c in doc["checks"]}, doc


def ctx_for(root: str, environ: dict | None = None, **flags: str):
    """An in-process doctor context on `root`, for the checks that read files only (NVML
    named by a path that does not exist: these never load a library into the test process)."""
    given = {"device_list_strategy": STRATEGY, "cdi_spec_dirs": os.path.join(root, "etc/cdi"),
             "nvml_library": "/nonexistent/libnvidia-ml.so.1", **flags}
    return make_context(given, environ or {}, root=root, timeout=2.0)


# ---------------------------------------------------------------------------------------------
# The whole command: schema and exit codes


def test_healthy_node_all_ok_exit_0_and_the_json_schema(live):
    node, tree, _agent = live
    code, checks, doc = run_doctor(node, tree.root)
    assert set(doc) == {"version", "agentVersion", "root", "status", "exitCode", "counts",
                        "checks"}
    assert doc["version"] == SCHEMA_VERSION == 1
    assert doc["root"] == tree.root
    assert [c["id"] for c in doc["checks"]] == CHECK_IDS == [s.id for s in SPECS]
    for c in doc["checks"]:
        assert set(c) == {"id", "group", "title", "status", "found", "fix"}
        assert c["group"] == c["id"].split(".")[0] and c["title"] and c["found"]
        assert c["status"] in (OK, WARN, FAIL, SKIP)
        assert (c["fix"] is None) == (c["status"] in (OK, SKIP)), c
    bad = {i: c["found"] for i, c in checks.items() if c["status"] not in (OK, SKIP)}
    assert not bad
    assert (code, doc["exitCode"], doc["status"]) == (EXIT_OK, 0, OK)
    assert doc["counts"] == {OK: 16, WARN: 0, FAIL: 0, SKIP: 6}
    # the skips are what the simulated node lacks: persistence mode and MIG (NVML says
    # NOT_SUPPORTED on this profile), CRI-O, systemd; and the DRA checks (device-plugin mode)
    assert {i for i, c in checks.items() if c["status"] == SKIP} == {
        "driver.persistence", "driver.mig", "runtime.crio", "agent.unit", "dra.sockets",
        "dra.driver"}
    assert "nvidia.com/gpu: 8 allocatable, as the running agent" in \
        checks["kubelet.allocatable"]["found"]
    assert "driver 535.129.03, CUDA driver 12.2" in checks["driver.versions"]["found"]
    assert "nvidia-ctk 1.17.8" in checks["toolkit.nvidia-ctk"]["found"]


def test_warnings_exit_1_failures_exit_2_and_the_text_report(live, tmp_root):
    node, _tree, _agent = live
    warned = build(os.path.join(tmp_root, "w"), "dgx1-v100", default_runtime=False)
    code, checks, doc = run_doctor(node, warned.root)
    assert [i for i, c in checks.items() if c["status"] == WARN] == ["runtime.containerd"]
    assert (code, doc["exitCode"], doc["status"]) == (EXIT_WARN, 1, WARN)

    failed = build(os.path.join(tmp_root, "f"), "dgx1-v100", dev_char=False)
    argv = [a for a in doctor_argv(node, failed.root) if a != "--json"]
    proc = run_gpu_agent(*argv, env=node.env(), check=False)
    text = proc.stdout
    assert proc.returncode == EXIT_FAIL, text
    assert "  FAIL  devices.dev-char" in text and "  ok    driver.nvml" in text
    assert f"fix: {devnodes.DEV_CHAR_COMMAND}" in text
    assert text.rstrip().endswith("15 ok, 0 warn, 1 fail, 6 skip: exit 2")


def test_bad_usage_exits_2():
    proc = run_gpu_agent("doctor", "--timeout", "0", check=False)
    assert proc.returncode == 2 and "--timeout" in proc.stderr


# ---------------------------------------------------------------------------------------------
# driver.*: through the simulated NVML in the doctor's own process


def test_driver_checks_on_a_mig_node_with_a_lost_gpu(live, tmp_root):
    node, _tree, _agent = live
    tree = build(tmp_root, "a100-mig")
    env = node.env(GPU_AGENT_SIM_PROFILE="a100-mig", GPU_AGENT_SIM_FAULTS="lost=2")
    _code, checks, _doc = run_doctor(node, tree.root, env=env)
    assert checks["driver.versions"]["found"].startswith("driver 550.54.15, CUDA driver 12.4")
    gpus = checks["driver.gpus"]
    assert gpus["status"] == FAIL and "cannot read GPU 2 (GPU_IS_LOST" in gpus["found"]
    mig = checks["driver.mig"]
    assert mig["status"] == WARN
    assert "pending (applied at the next GPU reset) on GPU 7 (MIG enabled after)" in mig["found"]
    assert "MIG is enabled on GPU 0, 1, 3, 4, 5: with migStrategy none the agent advertises " \
        "them as whole GPUs" in mig["found"]
    assert "nvidia-smi -i 7 -r" in mig["fix"]
    # the agent of `live` advertises dgx1-v100's GPUs: not this node's
    reg = checks["kubelet.registration"]
    assert reg["status"] == WARN and "not the node's GPUs now" in reg["found"]


def test_nvml_that_does_not_load_fails_and_the_driver_checks_skip(live, tmp_root):
    node, _tree, _agent = live
    tree = build(tmp_root, "dgx1-v100")
    env = node.env(GPU_AGENT_SIM_FAULTS="init=DRIVER_NOT_LOADED")
    code, checks, _doc = run_doctor(node, tree.root, env=env)
    assert code == EXIT_FAIL
    nvml = checks["driver.nvml"]
    assert nvml["status"] == FAIL and "DRIVER_NOT_LOADED" in nvml["found"]
    assert "lsmod | grep nvidia" in nvml["fix"]
    for check in ("driver.versions", "driver.gpus", "driver.persistence", "driver.mig",
                  "toolkit.cdi-spec"):
        assert checks[check]["status"] == SKIP, checks[check]
    assert checks["kubelet.allocatable"]["status"] == OK  # the running agent still says


# ---------------------------------------------------------------------------------------------
# toolkit.*


def test_toolkit_programs_present_missing_and_broken(tmp_root):
    tree = build(os.path.join(tmp_root, "t"), "dgx1-v100")
    ctx = ctx_for(tree.root)
    assert toolkit.check_ctk(ctx).found == \
        f"nvidia-ctk 1.17.8 ({tree.path('/usr/bin/nvidia-ctk')})"
    assert toolkit.check_runtime(ctx).status == OK

    bare = build(os.path.join(tmp_root, "b"), "dgx1-v100", toolkit=False)
    ctx = ctx_for(bare.root)
    assert toolkit.check_ctk(ctx).status == WARN
    missing = toolkit.check_runtime(ctx)  # envvar needs the runtime: a failure
    assert missing.status == FAIL and "dnf install nvidia-container-toolkit" in missing.fix
    assert toolkit.check_runtime(ctx_for(bare.root, device_list_strategy="cdi-cri")).status \
        == WARN

    Path(tree.path("/usr/bin/nvidia-ctk")).write_text("#!/bin/sh\necho broken >&2\nexit 1\n")
    broken = toolkit.check_ctk(ctx_for(tree.root))
    assert broken.status == WARN and "exited 1: broken" in broken.found


def test_cdi_spec_covering_and_missing_the_devices(live, tmp_root):
    node, _tree, _agent = live
    bare = build(tmp_root, "dgx1-v100", cdi_spec=False)
    _code, checks, _doc = run_doctor(node, bare.root)
    cdi = checks["toolkit.cdi-spec"]
    assert cdi["status"] == FAIL and "hands out device names that no CDI spec" in cdi["found"]
    assert "nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml" in cdi["fix"]
    # envvar alone hands out no CDI names
    _code, checks, _doc = run_doctor(node, bare.root, strategy="envvar")
    assert checks["toolkit.cdi-spec"]["status"] == SKIP


# ---------------------------------------------------------------------------------------------
# runtime.containerd: versions 2 and 3, with and without the nvidia runtime, CDI on and off


@pytest.mark.parametrize("version", [2, 3])
def test_containerd_with_the_nvidia_runtime_is_ok(tmp_root, version):
    tree = build(tmp_root, "dgx1-v100", containerd=version)
    found = runtime.check_containerd(ctx_for(tree.root))
    plugin = runtime.CRI_PLUGIN[version]
    assert found.status == OK, found
    assert f"version {version}" in found.found
    assert "runtime `nvidia` runs /usr/bin/nvidia-container-runtime" in found.found
    assert f'CDI on (plugins."{plugin}".enable_cdi = true)' in found.found


@pytest.mark.parametrize("version", [2, 3])
def test_containerd_without_the_nvidia_runtime_fails_for_envvar(tmp_root, version):
    tree = build(tmp_root, "dgx1-v100", containerd=version, nvidia_runtime=False)
    found = runtime.check_containerd(ctx_for(tree.root, device_list_strategy="envvar"))
    assert found.status == FAIL
    assert f'no `nvidia` runtime in [plugins."{runtime.CRI_PLUGIN[version]}".containerd.' \
           f'runtimes]' in found.found
    assert found.fix == "nvidia-ctk runtime configure --runtime=containerd --set-as-default " \
                        "&& systemctl restart containerd"
    # cdi-cri alone does not need the runtime
    assert runtime.check_containerd(
        ctx_for(tree.root, device_list_strategy="cdi-cri")).status == OK


def test_containerd_runtime_not_the_default_warns(tmp_root):
    tree = build(tmp_root, "dgx1-v100", default_runtime=False)
    found = runtime.check_containerd(ctx_for(tree.root))
    assert found.status == WARN and "the default runtime is `runc`" in found.found
    assert "--set-as-default" in found.fix


@pytest.mark.parametrize(("version", "enable_cdi", "containerd_says", "status"), [
    pytest.param(2, False, None, FAIL, id="v2-off"),
    pytest.param(3, False, None, FAIL, id="v3-off"),
    pytest.param(3, None, None, OK, id="v3-unset-on-by-default"),
    pytest.param(2, None, "containerd github.com/containerd/containerd v1.7.25 bcc810d6",
                 FAIL, id="v2-unset-containerd-1.7"),
    pytest.param(2, None, "containerd github.com/containerd/containerd/v2 v2.0.2 c5078b8c",
                 OK, id="v2-unset-containerd-2.0"),
    pytest.param(2, None, None, WARN, id="v2-unset-containerd-unknown"),
])
def test_containerd_cdi_for_the_cdi_strategies(tmp_root, version, enable_cdi, containerd_says,
                                               status):
    tree = build(tmp_root, "dgx1-v100", containerd=version, enable_cdi=enable_cdi)
    if containerd_says:
        Path(tree.path("/usr/bin/containerd")).write_text(
            f"#!/bin/sh\necho '{containerd_says}'\n")
        os.chmod(tree.path("/usr/bin/containerd"), 0o755)
    found = runtime.check_containerd(ctx_for(tree.root, device_list_strategy="cdi-cri"))
    assert found.status == status, found
    if status != OK:
        assert found.fix == runtime.CONTAINERD_CDI_FIX
    # envvar alone does not need CDI
    assert runtime.check_containerd(ctx_for(tree.root, device_list_strategy="envvar")).status \
        == OK


def test_containerd_reads_the_runtime_from_an_imported_drop_in(tmp_root):
    # What nvidia-ctk >= 1.17 writes: the runtime in /etc/containerd/conf.d/99-nvidia.toml,
    # and `imports` in the top-level file.
    tree = build(tmp_root, "dgx1-v100", containerd=3, nvidia_runtime=False)
    config = Path(tree.path("/etc/containerd/config.toml"))
    assert runtime.check_containerd(ctx_for(tree.root)).status == FAIL
    config.write_text('imports = ["/etc/containerd/conf.d/*.toml"]\n' + config.read_text())
    drop_in = Path(tree.path("/etc/containerd/conf.d/99-nvidia.toml"))
    drop_in.parent.mkdir(parents=True)
    drop_in.write_text(containerd_config(3, nvidia_runtime=True))
    found = runtime.check_containerd(ctx_for(tree.root))
    assert found.status == OK, found
    assert str(drop_in) in found.found


def test_containerd_config_that_is_not_toml_fails(tmp_root):
    tree = build(tmp_root, "dgx1-v100")
    Path(tree.path("/etc/containerd/config.toml")).write_text("version = 2\n[plugins\n")
    found = runtime.check_containerd(ctx_for(tree.root))
    assert found.status == FAIL and "is not valid TOML" in found.found


def test_no_container_runtime_at_all_warns(tmp_root):
    tree = build(tmp_root, "dgx1-v100", containerd=None)
    assert runtime.check_containerd(ctx_for(tree.root)).status == WARN
    assert runtime.check_crio(ctx_for(tree.root)).status == SKIP


# ---------------------------------------------------------------------------------------------
# runtime.crio


def test_crio_with_and_without_the_nvidia_runtime(tmp_root):
    tree = build(tmp_root, "dgx1-v100", containerd=None, crio=True)
    ctx = ctx_for(tree.root)
    assert runtime.check_containerd(ctx).status == SKIP
    found = runtime.check_crio(ctx)
    assert found.status == OK, found
    assert "CDI on (always" in found.found
    os.unlink(tree.path("/etc/crio/crio.conf.d/99-nvidia.conf"))
    Path(tree.path("/etc/crio/crio.conf")).write_text('[crio.runtime]\ndefault_runtime = "crun"\n')
    found = runtime.check_crio(ctx_for(tree.root))
    assert found.status == FAIL and "[crio.runtime.runtimes]" in found.found
    assert found.fix.startswith("nvidia-ctk runtime configure --runtime=crio --set-as-default")


# ---------------------------------------------------------------------------------------------
# devices.*: device nodes and their /dev/char links


@pytest.mark.parametrize("node_kind", driver_tree.NODE_KINDS)
def test_dev_char_links_present(tmp_root, node_kind):
    if node_kind == "char" and os.geteuid() != 0:
        pytest.skip("real character devices (the end-to-end tree) need root to mknod")
    tree = build(tmp_root, "dgx1-v100", node_kind=node_kind)
    ctx = ctx_for(tree.root)
    nodes = devnodes.list_nodes(ctx)
    assert {(n.name, n.major, n.minor) for n in nodes} == set(tree.nodes)
    # real character devices give their own numbers; the others' come from the record
    assert all(n.recorded == (node_kind != "char") for n in nodes)
    assert devnodes.check_nodes(ctx).status == OK
    found = devnodes.check_dev_char(ctx)
    assert (found.status, found.found) == (OK, "all 13 NVIDIA device nodes have their "
                                                "/dev/char link")


def test_dev_char_links_missing_and_wrong(tmp_root):
    tree = build(tmp_root, "dgx1-v100")
    os.unlink(tree.char_link("/dev/nvidia3"))
    os.unlink(tree.char_link("/dev/nvidia-uvm"))
    os.unlink(tree.char_link("/dev/nvidia5"))
    os.symlink("../nvidia4", tree.char_link("/dev/nvidia5"))
    found = devnodes.check_dev_char(ctx_for(tree.root))
    assert found.status == FAIL
    assert "2 of 13 NVIDIA device nodes have no /dev/char link: /dev/nvidia-uvm " \
           "(/dev/char/508:0), /dev/nvidia3 (/dev/char/195:3)" in found.found
    assert f"/dev/char/195:5 points to {tree.path('/dev/nvidia4')}, not /dev/nvidia5" \
        in found.found
    assert "Failed to initialize NVML: Unknown Error" in found.found
    assert found.fix.splitlines() == [
        f"remove the wrong links first: rm {tree.path('/dev/char/195:5')}",
        f"{devnodes.DEV_CHAR_COMMAND} --driver-root={tree.root} "
        f"--dev-char-path={tree.path('/dev/char')}"]
    # CDI puts the nodes in the spec, but runc still needs the links to tell systemd
    assert devnodes.check_dev_char(ctx_for(tree.root, device_list_strategy="cdi-cri")).status \
        == FAIL


@pytest.mark.parametrize(("flags", "status"), [
    pytest.param({"device_list_strategy": "envvar"}, WARN, id="envvar-hook-only"),
    pytest.param({"device_list_strategy": "envvar", "pass_device_specs": "true"}, OK,
                 id="envvar-pass-device-specs"),
    pytest.param({"device_list_strategy": "cdi-cri"}, OK, id="cdi"),
])
def test_devices_only_the_hook_adds_are_lost_even_with_the_links(tmp_root, flags, status):
    # NVIDIA's notice (nvidia-container-toolkit #48), for Kubernetes: the links and the device
    # nodes in the container's spec (passDeviceSpecs, or CDI)
    tree = build(tmp_root, "dgx1-v100")
    found = devnodes.check_dev_char(ctx_for(tree.root, **flags))
    assert found.status == status, found
    if status == WARN:
        assert "systemd never learns them" in found.found
        assert "passDeviceSpecs: true" in found.fix


def test_dev_char_fix_on_the_host_root_is_the_toolkits_command():
    ctx = make_context({}, {}, root="/")
    assert ctx.host("/dev/char/195:0") == "/dev/char/195:0"
    assert devnodes.DEV_CHAR_COMMAND == "nvidia-ctk system create-dev-char-symlinks --create-all"


def test_a_real_character_device_gives_its_own_numbers(tmp_root):
    if os.geteuid() != 0:
        pytest.skip("a real character device needs root to mknod")
    tree = build(tmp_root, "dgx1-v100")
    # /dev/nvidia9 here is a character device 1:3 (as /dev/null), whatever a record says: the
    # lister takes st_rdev, and the link must be /dev/char/1:3
    os.mknod(tree.path("/dev/nvidia9"), 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    ctx = ctx_for(tree.root)
    null = next(n for n in devnodes.list_nodes(ctx) if n.name == "/dev/nvidia9")
    assert (null.major, null.minor, null.recorded) == (1, 3, False)
    found = devnodes.check_dev_char(ctx)
    assert found.status == FAIL and "/dev/nvidia9 (/dev/char/1:3)" in found.found


def test_the_agents_start_log_and_the_doctor_see_the_same_device_nodes():
    # issue 38 item 9: on a simulated tree (regular files, numbers recorded) the agent said
    # "0 NVIDIA device nodes" while the doctor counted 13 without links; both list them with
    # agent.devchar.list_nodes now, so the agent links the 13 and the doctor finds them linked
    with Node("dgx1-v100") as node:
        tree = build(node.path("root"), "dgx1-v100", dev_char=False)
        agent = node.agent("--dev-root", tree.root)
        agent.wait_registered()
        agent.wait_log(f"13 NVIDIA device nodes under {tree.path('/dev')}, 13 with a link in "
                       f"{tree.path('/dev/char')} (13 created)")
        _, checks, _ = run_doctor(node, tree.root)
        assert checks["devices.nodes"]["found"].startswith(
            "13 NVIDIA device nodes (major:minor as the simulated driver tree records them)")
        assert checks["devices.dev-char"]["found"].startswith(
            "all 13 NVIDIA device nodes have their /dev/char link")
        assert agent.stop() == 0


def test_a_link_to_a_character_device_is_not_a_node_as_the_toolkit_decides(tmp_root):
    # nvidia-container-toolkit's AssertCharDevice lstats (internal/devices/devices.go), and so
    # does the agent's /dev/char keeper (agent.devchar): the doctor counts the same nodes
    tree = build(tmp_root, "dgx1-v100")
    os.symlink("/dev/null", tree.path("/dev/nvidia9"))
    ctx = ctx_for(tree.root)
    link = next(n for n in devnodes.list_nodes(ctx) if n.name == "/dev/nvidia9")
    assert (link.major, link.minor) == (None, None)
    found = devnodes.check_nodes(ctx)
    assert found.status == WARN and "not character devices: /dev/nvidia9" in found.found
    assert found.found.startswith("13 NVIDIA device nodes")


def test_device_nodes_missing(live, tmp_root):
    node, _tree, _agent = live
    tree = build(tmp_root, "dgx1-v100")
    os.unlink(tree.path("/dev/nvidia6"))
    Path(tree.path("/dev/nvidia7")).unlink()
    _code, checks, _doc = run_doctor(node, tree.root)
    nodes = checks["devices.nodes"]
    assert nodes["status"] == FAIL and "missing: /dev/nvidia6, /dev/nvidia7" in nodes["found"]
    assert nodes["fix"] == "nvidia-modprobe -u -c 6 && nvidia-modprobe -u -c 7"
    assert devnodes.check_nodes(ctx_for(tmp_root + "/nowhere")).status == FAIL


# ---------------------------------------------------------------------------------------------
# kubelet.*


def test_kubelet_with_a_different_device_set_fails_allocatable(live):
    node, tree, _agent = live
    with Node("pcie-8gpu") as other:
        other.agent().wait_registered()
        # the agent of `live` (dgx1-v100) against the other kubelet (pcie-8gpu's GPUs)
        code, checks, _doc = run_doctor(
            node, tree.root, "--pod-resources-socket", other.podresources_socket)
    alloc = checks["kubelet.allocatable"]
    assert code == EXIT_FAIL and alloc["status"] == FAIL
    assert "nvidia.com/gpu: kubelet's 8 allocatable devices differ from the 8 healthy ones " \
           "the running agent" in alloc["found"]
    assert "not allocatable in kubelet: GPU-" in alloc["found"]
    assert "allocatable in kubelet but not advertised: GPU-" in alloc["found"]
    assert "systemctl restart gpu-agent" in alloc["fix"]


def test_kubelet_reporting_zero_allocatable_without_an_agent(tmp_root):
    with Node("dgx1-v100") as bare:  # kubelet runs, no agent ever started
        tree = build(tmp_root, "dgx1-v100")
        code, checks, _doc = run_doctor(bare, tree.root)
    assert code == EXIT_FAIL
    assert checks["kubelet.socket"]["status"] == OK
    assert checks["kubelet.podresources"]["status"] == OK
    alloc = checks["kubelet.allocatable"]
    assert alloc["status"] == FAIL
    assert alloc["found"] == ("kubelet reports 0 allocatable nvidia.com/gpu, while discovery "
                              "and the config (no agent runs) advertises 8 healthy devices")
    reg = checks["kubelet.registration"]
    assert reg["status"] == FAIL and "no agent has run with state directory" in reg["found"]
    assert reg["fix"].startswith("systemctl enable --now gpu-agent")


def test_an_unhealthy_device_is_consistent_with_kubelet_and_warned(live):
    node, tree, agent = live
    uuid = agent.wait_registered().devices[5].id
    isolation = Path(node.isolation)
    isolation.write_text(json.dumps({"uuid": [uuid]}))
    try:
        node.status_when(lambda d: any(not dev["healthy"] for r in d["resources"]
                                       for dev in r["devices"]), "the isolated device")
        agent.wait_for(lambda s: uuid not in s.resource(GPU).healthy_ids, "kubelet sees it")
        code, checks, _doc = run_doctor(node, tree.root)
    finally:
        isolation.unlink()
        node.status_when(lambda d: all(dev["healthy"] for r in d["resources"]
                                       for dev in r["devices"]), "the device back")
    assert checks["kubelet.allocatable"]["status"] == OK  # 7 and 7
    assert "7 allocatable" in checks["kubelet.allocatable"]["found"]
    reg = checks["kubelet.registration"]
    assert reg["status"] == WARN and "1 of 8 devices unhealthy: GPU" in reg["found"]
    assert uuid in reg["found"] and code == EXIT_WARN


def test_kubelet_sockets_missing_and_stale(tmp_root):
    ctx = ctx_for(tmp_root, kubelet_socket=f"{tmp_root}/kubelet.sock",
                  pod_resources_socket=f"{tmp_root}/pr.sock")
    assert kubelet.check_socket(ctx).status == FAIL
    found = kubelet.check_podresources(ctx)
    assert found.status == FAIL and "does not exist" in found.found
    assert kubelet.check_allocatable(ctx).status == SKIP
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(f"{tmp_root}/kubelet.sock")  # bound, never listening: a dead kubelet's socket
    stale.close()
    found = kubelet.check_socket(ctx)
    assert found.status == FAIL and "does not answer" in found.found
    off = ctx_for(tmp_root, kubelet_socket="", pod_resources_socket="")
    assert kubelet.check_socket(off).status == kubelet.check_podresources(off).status == SKIP


def test_a_kubelet_without_get_allocatable_resources_warns(tmp_root):
    # a kubelet of Kubernetes 1.20-1.22: podresources v1 without GetAllocatableResources
    path = f"{tmp_root}/pr.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pr_grpc.add_PodResourcesListerServicer_to_server(pr_grpc.PodResourcesListerServicer(),
                                                     server)
    assert server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        ctx = ctx_for(tmp_root, pod_resources_socket=path)
        found = kubelet.check_podresources(ctx)
    finally:
        server.stop(None)
    assert found.status == WARN and "Kubernetes 1.23" in found.found
    assert kubelet.check_allocatable(ctx).status == SKIP


def test_a_stopped_agent_fails_registration(tmp_root):
    with Node("dgx1-v100") as n:
        tree = build(tmp_root, "dgx1-v100")
        agent = n.agent("--device-list-strategy", STRATEGY,
                        "--cdi-spec-dirs", tree.path("/etc/cdi"))
        agent.wait_registered()
        n.status_when(lambda d: d["resources"] and d["resources"][0]["registered"], "registered")
        assert agent.stop(signal.SIGKILL) == -signal.SIGKILL
        code, checks, _doc = run_doctor(n, tree.root)
    reg = checks["kubelet.registration"]
    assert code == EXIT_FAIL and reg["status"] == FAIL
    assert f"the agent (pid {agent.pid}) is not running" in reg["found"]
    assert "journalctl -u gpu-agent -e" in reg["fix"]


# ---------------------------------------------------------------------------------------------
# agent.*


@pytest.mark.parametrize(("state", "status"), [("active", OK), ("activating", WARN),
                                               ("failed", FAIL), (None, SKIP)])
def test_the_unit(tmp_root, state, status):
    tree = build(tmp_root, "dgx1-v100", systemctl=state)
    found = service.check_unit(ctx_for(tree.root))
    assert found.status == status, found
    if status == FAIL:
        assert found.fix.startswith("systemctl enable --now gpu-agent")


def test_a_bad_config_fails_and_the_other_checks_still_run(live, tmp_root):
    node, tree, _agent = live
    bad = Path(tmp_root, "config.yaml")
    bad.write_text("version: v1\nflags:\n  migStrategy: sometimes\n")
    code, checks, _doc = run_doctor(node, tree.root, "--config", str(bad))
    cfg = checks["agent.config"]
    assert code == EXIT_FAIL and cfg["status"] == FAIL
    assert "flags.migStrategy" in cfg["found"] and str(bad) in cfg["found"]
    assert "the other checks used the flags and environment without the file" in cfg["found"]
    assert "gpu-agent config check FILE" in cfg["fix"]
    assert checks["kubelet.allocatable"]["status"] == OK  # the flags still applied


def test_a_config_run_refuses_and_the_units_config_file(tmp_root):
    # IMEX channels parse, but `gpu-agent run` does not implement them yet
    bad = Path(tmp_root, "imex.yaml")
    bad.write_text("version: v1\nimex:\n  channelIDs: [0]\n")
    ctx = ctx_for(tmp_root, config_file=str(bad))
    found = service.check_config(ctx)
    assert found.status == FAIL and "refuses it" in found.found
    # without --config, the unit's /etc/gpu-agent/config.yaml (under the root) is read
    unit_config = Path(tmp_root, "etc/gpu-agent/config.yaml")
    unit_config.parent.mkdir(parents=True)
    unit_config.write_text("version: v1\nflags:\n  plugin:\n    deviceListStrategy: cdi-cri\n")
    ctx = make_context({}, {}, root=tmp_root)
    assert ctx.cfg.config_file == str(unit_config)
    assert ctx.cfg.device_list_strategy == ("cdi-cri",)
    assert f"the unit's config file {unit_config}" in service.check_config(ctx).found
    assert make_context({}, {"CONFIG_FILE": ""}, root=tmp_root).cfg.config_file is None


def test_state_dir_and_journal(live, tmp_root):
    node, tree, agent = live
    ctx = ctx_for(tmp_root, state_dir=f"{tmp_root}/state")
    assert service.check_state_dir(ctx).status == WARN  # not there yet
    assert service.check_journal(ctx).status == OK  # nothing recorded
    Path(tmp_root, "state").write_text("")
    assert service.check_state_dir(ctx).status == FAIL  # not a directory
    os.unlink(f"{tmp_root}/state")
    os.makedirs(f"{tmp_root}/state")
    Path(tmp_root, "state/checkpoint.msgpack").write_bytes(b"\x00not a checkpoint")
    found = service.check_journal(ctx)
    assert found.status == FAIL and "is unusable" in found.found
    assert found.fix.startswith("systemctl restart gpu-agent")
    os.rename(f"{tmp_root}/state/checkpoint.msgpack",
              f"{tmp_root}/state/checkpoint.msgpack.bad-20250101T000000Z")
    found = service.check_journal(ctx)
    assert found.status == WARN and "bad state files set aside earlier" in found.found

    # the live agent's journal after one Allocate
    uuid = agent.wait_registered().devices[0].id
    agent.allocate([uuid])
    _code, checks, _doc = run_doctor(node, tree.root)
    assert checks["agent.journal"]["status"] == OK
    assert "allocations recorded: 1" in checks["agent.journal"]["found"]
    assert checks["agent.state-dir"]["status"] == OK


# ---------------------------------------------------------------------------------------------
# The simulator, the boundaries, the packaging


def test_sim_driver_tree_command(tmp_root):
    out = run_gpu_agent("sim", "driver-tree", tmp_root, "--profile", "pcie-8gpu",
                        "--containerd", "3", "--node-kind", "fifo").stdout
    assert f"simulated driver tree in {tmp_root}: 13 device nodes" in out
    record = json.loads(Path(tmp_root, devnodes.SIM_NODES_FILE.lstrip("/")).read_text())
    assert record["nodes"]["/dev/nvidiactl"] == [195, 255]
    assert record["nodes"]["/dev/nvidia-caps/nvidia-cap2"] == [driver_tree.CAPS_MAJOR, 2]
    assert Path(tmp_root, "dev/nvidia7").is_fifo()
    assert os.readlink(Path(tmp_root, "dev/char/195:7")) == "../nvidia7"
    assert "version = 3" in Path(tmp_root, "etc/containerd/config.toml").read_text()
    assert "DeviceFileMinor: 1" in Path(
        tmp_root, "proc/driver/nvidia/capabilities/mig/config").read_text()
    assert "509 nvidia-caps" in Path(tmp_root, "proc/devices").read_text()


def test_doctor_talks_to_nvml_and_grpc_only_through_their_layers():
    for path in sorted((ROOT / "agent" / "doctor").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {"pynvml", "grpc"} & {n.split(".")[0] for n in names}, path


def test_tomli_is_a_requirement_below_python_3_11_and_the_rpm_installs_it():
    assert 'tomli>=2.0; python_version < "3.11"' in (ROOT / "requirements.txt").read_text()
    # the RPM builds wheels for `.` and installs gpu-agent from them: its dependencies are
    # requirements.txt, through pyproject.toml
    assert 'dependencies = { file = ["requirements.txt"] }' in \
        (ROOT / "pyproject.toml").read_text()
    assert "pip wheel -q --wheel-dir wheels ." in \
        (ROOT / "packaging/rpm/gpu-agent.spec").read_text()
