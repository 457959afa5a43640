"""MPS through `gpu-agent run` on the simulated node, with the simulated
nvidia-cuda-mps-control (agent/sim/bin): one control daemon per shared GPU, started with its
own pipe and log directories and CUDA_VISIBLE_DEVICES, its default limits sent, restarted when
it dies (its replicas withdrawn meanwhile), kept and adopted across an agent kill -9, told to
quit when sharing is turned off; what a container gets.

NVIDIA's rules, read in k8s-device-plugin v0.20.0 (the tags are used below):
- [RESP] internal/plugin/mps.go updateReponse: CUDA_MPS_PIPE_DIRECTORY=/mps/<resource>/pipe,
  that directory mounted from the host's, and the root's shm mounted at /dev/shm
  (cmd/mps-control-daemon/mps/root.go PipeDir, ShmDir, ContainerRoot "/mps").
- [LIMITS] cmd/mps-control-daemon/mps/daemon.go Start: set_default_active_thread_percentage
  100/N and set_default_device_pinned_mem_limit <device> <memory/N>M after `-d`.
- [FAIL] api/config/v1/config.go NewConfig: failRequestsGreaterThanOne defaults to true for
  MPS; internal/rm/rm.go ValidateRequest gives the message.
- [MIG] internal/plugin/mps.go getMPSOptions: "sharing using MPS is not supported for MIG
  devices".
Beyond NVIDIA (docs/sharing.md): a daemon per GPU (NVIDIA runs one per resource, in a
DaemonSet, and never notices it die), restarts and withdrawal, adoption, and k/N limits per
container in its environment.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import grpc
import pytest

from agent.mps.control import Control, launcher
from agent.rm.sharing import mps_log_dir, mps_pipe_dir
from agent.sim.profile import load_profile
from tests.daemon_harness import GPU, Node
from tests.test_metrics import metrics_port, samples
from tests.test_mig import _variant

STAND_IN = str(Path(__file__).resolve().parent.parent / "agent" / "sim" / "bin" /
               "nvidia-cuda-mps-control")
DGX = load_profile("dgx1-v100")
GPUS = sorted(DGX["gpus"], key=lambda g: g["index"])
UUIDS = [g["uuid"] for g in GPUS]
MIB = 1 << 20


def _config(node: Node, resources: str, **flags: bool) -> str:
    lines = ["version: v1", "sharing:", "  mps:"]
    lines += [f"    {k}: {str(v).lower()}" for k, v in flags.items()]
    lines += ["    resources:", *(f"    {line}" for line in resources.strip().splitlines())]
    return node.write("config.yaml", "\n".join(lines) + "\n")


def _pid(root: str, uuid: str) -> int | None:
    try:
        return int(Path(mps_pipe_dir(root, uuid), "nvidia-cuda-mps-control.pid").read_text())
    except FileNotFoundError:
        return None


def _alive(pid: int | None) -> bool:
    return pid is not None and os.path.exists(f"/proc/{pid}")


def _control_log(root: str, uuid: str) -> str:
    return Path(mps_log_dir(root, uuid), "control.log").read_text()


class Mps:
    """A node with MPS on GPUs 0 and 1 (4 replicas each); its daemons are quit at the end."""

    def __init__(self, node: Node):
        self.node = node
        self.root = node.path("mps")
        self.args = ["--mps-root", self.root, "--mps-control", STAND_IN]

    def agent(self, config: str, *args: str):
        return self.node.agent("--config", config, *self.args, *args)

    def cleanup(self) -> None:
        for name in os.listdir(self.root) if os.path.isdir(self.root) else ():
            pid = _pid(self.root, name)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def mps():
    with Node() as node:
        m = Mps(node)
        try:
            yield m
        finally:
            for agent in node.agents:  # first: no agent restarts a daemon killed below
                agent.kill()
            m.cleanup()


SHARED_01 = "- name: nvidia.com/gpu\n  replicas: 4\n  devices: [0, 1]"


def _unhealthy(state) -> set[str]:
    return {d.id for d in state.resource(GPU).devices if not d.healthy}


def test_a_daemon_per_shared_gpu_with_its_dirs_gpu_and_nvidias_default_limits(mps):
    agent = mps.agent(_config(mps.node, SHARED_01))
    res = agent.wait_registered()
    assert len(res.devices) == 6 + 8  # GPUs 2-7 whole, GPUs 0 and 1 x 4
    for uuid in UUIDS[:2]:
        assert _alive(_pid(mps.root, uuid))
        text = _control_log(mps.root, uuid)
        assert f"CUDA_VISIBLE_DEVICES={uuid})" in text  # the daemon sees its GPU only
        # [LIMITS], with failRequestsGreaterThanOne (default true, [FAIL]): 1/4 each
        assert "Command: set_default_active_thread_percentage 25 -> ok" in text
        assert f"Command: set_default_device_pinned_mem_limit 0 {(16 << 30) // 4 // MIB}M " \
            "-> ok" in text
    assert not any(os.path.exists(mps_pipe_dir(mps.root, u)) for u in UUIDS[2:])
    line = f"GPU 0 {UUIDS[0]}: running (pid {_pid(mps.root, UUIDS[0])}); 4 replicas, 25% of " \
        "the SMs and 4096 MiB a client by default; restarted 0 times"
    assert line in mps.node.status_with(line)  # (status.json may follow kubelet's list)


def test_allocate_gives_nvidias_pipe_and_shm_and_the_containers_share(mps):
    agent = mps.agent(_config(mps.node, SHARED_01, failRequestsGreaterThanOne=False))
    agent.wait_registered()
    got = agent.allocate([f"{UUIDS[1]}::0", f"{UUIDS[1]}::2", f"{UUIDS[1]}::3"])
    c = got.container_responses[0]
    assert dict(c.envs) == {
        "NVIDIA_VISIBLE_DEVICES": UUIDS[1],
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe",  # [RESP]
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75",  # 3 of 4 replicas
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={(16 << 30) * 3 // 4 // MIB}MB",
    }
    assert [(m.container_path, m.host_path) for m in c.mounts] == [
        ("/mps/nvidia.com/gpu/pipe", mps_pipe_dir(mps.root, UUIDS[1])),
        ("/dev/shm", os.path.join(mps.root, "shm"))]  # [RESP]
    # without failRequestsGreaterThanOne the daemon's defaults are the whole GPU: each
    # container's own share comes in its environment
    assert "set_default_active_thread_percentage 100 -> ok" in _control_log(mps.root, UUIDS[1])
    # a GPU shared whole is not touched; replicas of two GPUs cannot share one pipe directory
    assert "CUDA_MPS_PIPE_DIRECTORY" not in agent.allocate([UUIDS[5]]).container_responses[0].envs
    with pytest.raises(grpc.RpcError) as info:
        agent.allocate([f"{UUIDS[0]}::0", f"{UUIDS[1]}::0"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "MPS replicas of one container must be on one GPU" in info.value.details()
    assert "got GPU 0, GPU 1" in info.value.details()


def test_two_replicas_are_refused_by_default_with_nvidias_message(mps):
    agent = mps.agent(_config(mps.node, SHARED_01))
    agent.wait_registered()
    with pytest.raises(grpc.RpcError) as info:
        agent.allocate([f"{UUIDS[0]}::0", f"{UUIDS[0]}::1"])
    assert info.value.details() == (  # [FAIL]
        'invalid allocation request for "nvidia.com/gpu": invalid request: maximum request '
        'size for shared resources is 1; found 2')


def test_a_killed_daemon_is_restarted_and_its_replicas_withdrawn_meanwhile(mps):
    agent = mps.agent(_config(mps.node, SHARED_01))
    agent.wait_registered()
    before = len(mps.node.client.snapshots(GPU))
    first = _pid(mps.root, UUIDS[0])
    os.kill(first, signal.SIGKILL)
    agent.wait_log("MPS control daemon not running (pid")
    agent.wait_for(lambda s: not _unhealthy(s) and _alive(_pid(mps.root, UUIDS[0]))
                   and _pid(mps.root, UUIDS[0]) != first, "a new daemon, the replicas back")
    replicas = {f"{UUIDS[0]}::{n}" for n in range(4)}
    seen = [{d.id for d in s.devices if d.health != "Healthy"}
            for s in mps.node.client.snapshots(GPU)[before:]]
    assert replicas in seen  # kubelet saw exactly GPU 0's replicas withdrawn, then back
    assert seen[-1] == set()
    assert _alive(_pid(mps.root, UUIDS[1]))  # the other GPU's daemon was left alone
    assert "Command: set_default_active_thread_percentage 25 -> ok" in \
        _control_log(mps.root, UUIDS[0]).split(f"Startup (pid {_pid(mps.root, UUIDS[0])}")[1]
    assert "restarted 1 times" in mps.node.status_with("restarted 1 times")
    port = metrics_port(mps.node)  # and Prometheus sees it
    assert samples(port, "gpu_agent_mps_daemon_restarts_total", gpu="0")[0][1] == 1.0
    assert [v for _, v in samples(port, "gpu_agent_mps_daemon_up")] == [1.0, 1.0]


def test_agent_kill_9_and_sighup_keep_the_daemons_and_the_next_agent_adopts_them(mps):
    config = _config(mps.node, SHARED_01)
    agent = mps.agent(config)
    agent.wait_registered()
    pids = [_pid(mps.root, u) for u in UUIDS[:2]]
    agent.kill()
    assert all(_alive(p) for p in pids)  # the daemons outlive the agent
    agent = mps.agent(config)
    agent.wait_registered(registrations=2)
    agent.wait_log("MPS control daemon adopted (started by an earlier agent)")
    assert [_pid(mps.root, u) for u in UUIDS[:2]] == pids
    assert all(_control_log(mps.root, u).count("Startup") == 1 for u in UUIDS[:2])
    # a SIGHUP that keeps the sharing keeps the daemons too (and sends their limits again)
    agent.send(signal.SIGHUP)
    agent.wait_log("configuration reloaded (reload 1)")
    assert [_pid(mps.root, u) for u in UUIDS[:2]] == pids
    assert _control_log(mps.root, UUIDS[0]).count("set_default_active_thread_percentage 25") == 3


def test_sighup_turning_sharing_off_tells_the_daemons_to_quit(mps):
    agent = mps.agent(_config(mps.node, SHARED_01))
    agent.wait_registered()
    pids = [_pid(mps.root, u) for u in UUIDS[:2]]
    mps.node.write("config.yaml", "version: v1\n")
    agent.send(signal.SIGHUP)
    agent.wait_for(lambda s: len(s.resource(GPU).devices) == 8, "8 whole GPUs")
    agent.wait_for(lambda s: all("Command: quit -> ok" in _control_log(mps.root, u)
                                 for u in UUIDS[:2]), "both daemons told to quit")
    agent.wait_for(lambda s: not any(_alive(p) for p in pids), "the daemons gone")
    assert agent.log.count("MPS control daemon told to quit") == 2


def test_mps_on_mig_devices_is_refused_with_nvidias_words():
    a100 = load_profile("a100-mig")
    with Node("a100-mig") as node:
        node.profile = _variant(node, [a100["gpus"][0]] * 2)  # 2 GPUs of 7x 1g.10gb
        config = node.write("config.yaml", "version: v1\nsharing:\n  mps:\n    resources:\n"
                                           "    - name: nvidia.com/gpu\n      replicas: 2\n")
        agent = node.agent("--config", config, "--mig-strategy", "single",
                           "--mps-root", node.path("mps"), "--mps-control", STAND_IN)
        assert agent.wait_exit() == 1
        assert "sharing.mps: sharing using MPS is not supported for MIG devices" in agent.log
        assert not os.path.exists(node.path("mps"))  # no daemon was started


def test_a_control_program_that_is_not_there_withdraws_the_replicas_and_says_why():
    with Node() as node:
        config = _config(node, SHARED_01)
        agent = node.agent("--config", config, "--mps-root", node.path("mps"),
                           "--mps-control", node.path("no-such-program"))
        agent.wait_for(lambda s: (r := s.resource(GPU)) is not None and len(
            [d for d in r.devices if not d.healthy]) == 8, "GPUs 0 and 1's replicas withdrawn")
        why = f"GPU 0 {UUIDS[0]}: MPS control daemon not running: could not start the MPS " \
            f"control daemon of {UUIDS[0]}: "
        assert why in node.status_with(why)
        withdrawn = samples(metrics_port(node), "gpu_agent_device_healthy", reason="mps")
        assert sorted(lab["device"] for lab, v in withdrawn if v == 0.0) == sorted(
            f"{u}::{n}" for u in UUIDS[:2] for n in range(4))
        assert agent.alive()  # and the whole GPUs are served
        assert agent.allocate([UUIDS[4]]).container_responses[0].envs[
            "NVIDIA_VISIBLE_DEVICES"] == UUIDS[4]


def test_kubelet_gets_a_containers_replicas_on_one_gpu_and_pods_spread_over_gpus(mps):
    agent = mps.agent(_config(mps.node, "- name: nvidia.com/gpu\n  replicas: 4",
                              failRequestsGreaterThanOne=False))
    agent.wait_registered()
    got = mps.node.client.admit_pod("two", {"main": {GPU: 2}})
    alloc = got.container("main").allocation(GPU)
    assert alloc.preferred_called
    assert len({i.split("::")[0] for i in alloc.device_ids}) == 1  # one GPU: one daemon
    assert alloc.container_response.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    gpus = {alloc.device_ids[0].split("::")[0]}
    for i in range(3):  # one-replica pods go to GPUs nobody uses yet (distributed)
        one = mps.node.client.admit_pod(f"one-{i}", {"main": {GPU: 1}})
        gpus.add(one.container("main").devices(GPU)[0].split("::")[0])
    assert len(gpus) == 4


def test_under_systemd_the_daemon_is_a_transient_unit_with_the_shared_dev_shm():
    """What the agent runs on a systemd host (no systemd in CI: the command, not its run):
    a unit of its own outside the agent's sandbox, forking like `-d`, found by its PID file,
    with <root>/shm as its /dev/shm."""
    uuid = UUIDS[3]
    booted = os.path.isdir("/run/systemd/system") and shutil.which("systemd-run")
    assert launcher({"INVOCATION_ID": "x"}) == ("systemd-run" if booted else launcher({}))
    argv = Control("/usr/bin/nvidia-cuda-mps-control", "/run/nvidia/mps",
                   "systemd-run").start_command(uuid)
    assert argv[:2] == ["systemd-run", f"--unit=gpu-agent-mps-{uuid}"]
    assert "--service-type=forking" in argv and "--collect" in argv
    assert f"--property=PIDFile=/run/nvidia/mps/{uuid}/pipe/nvidia-cuda-mps-control.pid" in argv
    assert "--property=BindPaths=/run/nvidia/mps/shm:/dev/shm" in argv
    assert f"--setenv=CUDA_VISIBLE_DEVICES={uuid}" in argv
    assert f"--setenv=CUDA_MPS_PIPE_DIRECTORY=/run/nvidia/mps/{uuid}/pipe" in argv
    assert argv[-3:] == ["--", "/usr/bin/nvidia-cuda-mps-control", "-d"]


def test_gpu_managers_vcuda_core_preset_is_100_units_a_gpu_limited_in_proportion(mps):
    """TKEStack gpu-manager's tencent.com/vcuda-core (100 per GPU) on MPS, from the preset the
    RPM ships: 8 GPUs are 800 units, and a container asking for 30 gets 30% of one GPU's SMs
    and memory."""
    preset = Path(__file__).resolve().parent.parent / "packaging" / "presets" / "vcuda-core.yaml"
    core = "tencent.com/vcuda-core"
    agent = mps.agent(str(preset))
    res = agent.wait_registered(resource=core)
    assert len(res.devices) == 800
    assert mps.node.client.state().resource(GPU) is None  # every GPU went to vcuda-core
    got = mps.node.client.admit_pod("infer", {"main": {core: 30}})
    alloc = got.container("main").allocation(core)
    gpus = {i.split("::")[0] for i in alloc.device_ids}
    assert len(alloc.device_ids) == 30 and len(gpus) == 1  # 30 units of one GPU
    envs = alloc.container_response.envs
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={(16 << 30) * 30 // 100 // MIB}MB"
    assert envs["CUDA_MPS_PIPE_DIRECTORY"] == f"/mps/{core}/pipe"
    assert envs["NVIDIA_VISIBLE_DEVICES"] == gpus.pop()


def test_more_replicas_than_the_mps_server_takes_clients_is_refused_naming_the_entry():
    """device.go assertReplicas / maxClients: V100 (compute capability 7.0) takes 16."""
    with Node() as node:
        config = _config(node, "- name: nvidia.com/gpu\n  replicas: 20")
        agent = node.agent("--config", config, "--mps-root", node.path("mps"),
                           "--mps-control", STAND_IN)
        assert agent.wait_exit() == 2
        assert "sharing.mps.resources[0].replicas: invalid MPS configuration: invalid device " \
            "maximum allowed replicas exceeded: 20 > 16 (GPU 0, compute capability 7.0)" in agent.log
        assert not os.path.exists(node.path("mps"))


def test_a_reload_to_another_mps_root_moves_the_daemons(mps):
    first, second = mps.node.path("mps-a"), mps.node.path("mps-b")

    def config(root: str) -> str:
        return mps.node.write("config.yaml", f"version: v1\nflags:\n  mpsRoot: {root}\n"
                                             f"sharing:\n  mps:\n    resources:\n"
                                             f"    - name: nvidia.com/gpu\n      replicas: 2\n"
                                             f"      devices: [3]\n")
    agent = mps.node.agent("--config", config(first), "--mps-control", STAND_IN)
    try:
        agent.wait_registered()
        old = _pid(first, UUIDS[3])
        assert _alive(old)
        config(second)
        agent.send(signal.SIGHUP)
        agent.wait_for(lambda s: _alive(_pid(second, UUIDS[3])) and not _alive(old),
                       "the daemon under the new root only")
        assert "Command: quit -> ok" in _control_log(first, UUIDS[3])
        got = agent.allocate([f"{UUIDS[3]}::1"]).container_responses[0]
        assert (got.mounts[0].container_path, got.mounts[0].host_path) == (
            "/mps/nvidia.com/gpu/pipe", mps_pipe_dir(second, UUIDS[3]))
    finally:
        agent.kill()
        for root in (first, second):
            pid = _pid(root, UUIDS[3])
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
