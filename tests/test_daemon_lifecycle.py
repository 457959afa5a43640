"""The daemon's lifecycle, `gpu-agent run` as a real subprocess: kubelet restarts (20 in a
row), our socket removed, kubelet dropping the agent when a plugin it replaced stops, kubelet
starting after the agent, SIGHUP with a changed and with a
broken config, NVML init failure with failOnInitError true and false (and recovery), every
kind of bad config value refused by `run` naming its key, and the systemd notify protocol.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from agent.sim import PROFILES_DIR, control
from agent.sim.profile import load_profile
from agent.status import read_status
from tests.conftest import ROOT, run_gpu_agent
from tests.daemon_harness import GPU, WAIT, Node, NotifySocket, clean_env, log_level

INDEX = {g["uuid"]: g["index"] for g in load_profile("dgx1-v100")["gpus"]}


@pytest.fixture
def node():
    with Node() as n:
        yield n


def admit_response(node: Node, name: str, count: int = 1):
    pod = node.client.admit_pod(name, {"main": {GPU: count}})
    alloc = pod.container("main").allocation(GPU)
    return alloc.device_ids, alloc.container_response


# -- kubelet restarts --------------------------------------------------------------------------


def test_twenty_kubelet_restarts_in_a_row_each_re_register(node):
    agent = node.agent()
    agent.wait_registered(1)
    for n in range(2, 22):
        removed = node.client.restart()
        assert node.plugin_socket in removed
        res = agent.wait_registered(n)
        assert res.registrations == n and len(res.healthy_ids) == 8
    # the last registration serves: a pod gets its GPUs
    ids, response = admit_response(node, "after-restarts", 2)
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(ids)
    assert node.client.state().resource(GPU).registrations == 21
    assert os.path.exists(node.plugin_socket)
    assert "Traceback" not in agent.log and "ERROR" not in agent.log
    assert agent.stop() == 0


def test_our_socket_removed_restarts_the_server_and_re_registers(node):
    agent = node.agent()
    agent.wait_registered(1)
    os.unlink(node.plugin_socket)
    res = agent.wait_registered(2)
    assert res.connected and os.path.exists(node.plugin_socket)
    assert "our socket gpu-agent-gpu.sock was removed" in agent.log
    assert len(admit_response(node, "p")[0]) == 1


def test_dropped_by_kubelet_when_a_plugin_it_replaced_stops_the_agent_registers_again(node):
    # Switching from NVIDIA's plugin on kubelet <= 1.36 (seen on the real 1.34 in
    # tests/e2e/test_migration.py): the agent's registration replaces the old plugin's; when
    # the old one stops, kubelet disconnects the agent's stream without restarting. The agent
    # must register again, or the node keeps 0 allocatable GPUs until kubelet restarts.
    env = node.env()
    old = subprocess.Popen(
        [sys.executable, "-m", "tests.second_plugin", "--kubelet-socket",
         node.kubelet_socket, "--profile", str(PROFILES_DIR / "dgx1-v100.yaml"),
         "--dev-root", node.root], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert old.stdout.readline().startswith("registered nvidia.com/gpu")
        agent = node.agent()
        agent.wait_registered(2)
        old.send_signal(signal.SIGTERM)
        assert old.wait(WAIT) == 0
        res = agent.wait_registered(3)
        assert res.connected and len(res.healthy_ids) == 8
        assert "kubelet ended our ListAndWatch stream without restarting; registering " \
               "again" in agent.log
        assert len(admit_response(node, "after-the-switch", 2)[0]) == 2
    finally:
        if old.poll() is None:
            old.kill()
            old.wait()


def test_kubelet_starting_after_the_agent_gets_a_registration():
    with Node(start_kubelet=False) as node:
        agent = node.agent()
        agent.wait_log("is not serving")  # waiting for kubelet.sock, not failing
        assert agent.alive()
        node.start_kubelet()
        agent.wait_registered(1)
        assert agent.stop() == 0


def test_empty_kubelet_socket_means_discover_but_do_not_serve(node):
    agent = node.agent("--kubelet-socket=", kubelet=False)
    agent.wait_log("kubelet socket is empty (do not connect to kubelet): not serving")
    node.status_when(lambda doc: doc["summary"] ==
                     f"{GPU}: 8/8 healthy, not serving (no kubelet socket)", "not serving")
    assert node.client.state().resource(GPU) is None
    assert not os.path.lexists(node.plugin_socket)
    assert agent.stop() == 0


# -- SIGHUP -------------------------------------------------------------------------------------


def test_sighup_applies_a_changed_config_behind_the_running_server(node):
    config = node.write("config.yaml", "version: v1\nflags:\n  plugin:\n"
                                       "    deviceListStrategy: envvar\n")
    agent = node.agent("--config", config)
    agent.wait_registered(1)
    ids, before = admit_response(node, "before")
    assert before.envs["NVIDIA_VISIBLE_DEVICES"] == ids[0] and not before.cdi_devices
    # the same request before and after, as bytes the agent has seen (it keeps their IDs)
    before_ids = ids
    direct = agent.allocate(ids).container_responses[0]
    assert direct.envs["NVIDIA_VISIBLE_DEVICES"] == ids[0]

    node.write("config.yaml", "version: v1\nflags:\n  plugin:\n    deviceListStrategy: cdi-cri\n"
                              "    deviceIDStrategy: index\n")
    agent.send(signal.SIGHUP)
    agent.wait_log("configuration reloaded (reload 1)")
    res = node.client.state().resource(GPU)
    assert res.connected and res.registrations == 1  # the same stream: no gap for kubelet
    ids, after = admit_response(node, "after")
    assert "NVIDIA_VISIBLE_DEVICES" not in after.envs
    assert [c.name for c in after.cdi_devices] == [f"nvidia.com/gpu={INDEX[ids[0]]}"]
    direct = agent.allocate(before_ids).container_responses[0]
    assert "NVIDIA_VISIBLE_DEVICES" not in direct.envs
    assert [c.name for c in direct.cdi_devices] == [f"nvidia.com/gpu={INDEX[before_ids[0]]}"]
    assert read_status(node.state)["reloads"] == 1
    assert agent.stop() == 0


@pytest.mark.parametrize("broken, key", [
    ("version: v1\nflags:\n  migStrategy: bogus\n", "flags.migStrategy"),
    ("version: v1\nflags:\n  plugin:\n    deviceListStrategy: [envvar, envvar]\n",
     "flags.plugin.deviceListStrategy"),
    ("version: v1\nflags: [\n", "config.yaml"),
    ("version: v1\nimex:\n  channelIDs: [0]\n", "imex.channelIDs"),
], ids=["bad-choice", "repeated-item", "yaml-syntax", "unsupported-imex"])
def test_sighup_with_a_broken_config_keeps_the_running_one(node, broken, key):
    config = node.write("config.yaml", "version: v1\nflags:\n  plugin:\n"
                                       "    deviceListStrategy: cdi-cri\n")
    agent = node.agent("--config", config)
    agent.wait_registered(1)
    node.write("config.yaml", broken)
    agent.send(signal.SIGHUP)
    log = agent.wait_log("reload refused, keeping the running configuration")
    refusal = next(line for line in log.splitlines() if "reload refused" in line)
    assert key in refusal
    assert agent.alive()
    res = node.client.state().resource(GPU)
    assert res.connected and res.registrations == 1  # not restarted
    ids, response = admit_response(node, "p")
    assert [c.name for c in response.cdi_devices] == [f"nvidia.com/gpu={ids[0]}"]
    status = node.status_when(lambda doc: doc["lastError"], "the refused reload")
    assert status["lastError"].startswith("reload refused") and key in status["lastError"]
    assert agent.stop() == 0


# -- NVML init failure ------------------------------------------------------------------------


def test_init_failure_with_fail_on_init_error_exits_saying_what_to_check(node):
    agent = node.agent(env=node.env(GPU_AGENT_SIM_FAULTS="init=DRIVER_NOT_LOADED"))
    assert agent.wait_exit() == 1
    log = agent.log
    assert "gpu-agent: error: cannot initialise NVML with" in log
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in log
    assert "Check that the NVIDIA driver is loaded" in log
    assert "--nvml-library" in log and "--driver-root" in log
    assert "--fail-on-init-error=false" in log
    assert not os.path.lexists(node.plugin_socket)
    assert node.client.state().resource(GPU) is None


def test_init_failure_without_fail_on_init_error_stays_up_advertising_nothing(node):
    notify = NotifySocket(node)
    try:
        agent = node.agent("--fail-on-init-error=false", env=node.env(
            GPU_AGENT_SIM_FAULTS="init=DRIVER_NOT_LOADED", NOTIFY_SOCKET=notify.address))
        agent.wait_log("failOnInitError is false: advertising nothing, retrying NVML in 1 s")
        agent.wait_log("retrying NVML in 2 s (attempt 2)")  # backoff, still up
        ready = notify.wait_key("READY", "1")
        assert notify.messages[ready]["STATUS"].startswith("NVML unavailable, advertising nothing")
        status = read_status(node.state)
        assert status["running"] and not status["nvml"]["up"]
        assert "DRIVER_NOT_LOADED" in status["nvml"]["error"]
        assert status["summary"].startswith("NVML unavailable, advertising nothing, retrying")
        assert node.client.state().resource(GPU) is None
        assert not os.path.lexists(node.plugin_socket)
        assert agent.stop() == 0
    finally:
        notify.close()


def test_init_failure_without_fail_on_init_error_recovers_when_the_driver_comes(node):
    profile = node.profile_copy(faults="  init: DRIVER_NOT_LOADED\n")
    agent = node.agent("--fail-on-init-error", "false",
                       env=node.env(GPU_AGENT_SIM_PROFILE=profile))
    agent.wait_log("retrying NVML in 1 s")
    node.profile_copy()  # the same file without the fault: the "driver" is loaded now
    res = agent.wait_registered(1)
    assert len(res.healthy_ids) == 8
    assert "NVML initialised from" in agent.log and "attempts" in agent.log
    node.status_when(lambda doc: doc["nvml"]["up"], "NVML up")
    assert agent.stop() == 0


def test_missing_nvml_library_exits_naming_the_path(node):
    agent = node.agent("--nvml-library", node.path("no/libnvidia-ml.so.1"), nvml=False)
    assert agent.wait_exit() == 1
    assert f"cannot open NVML library {node.path('no/libnvidia-ml.so.1')}" in agent.log


# -- a thread's death ----------------------------------------------------------------------------


def test_a_thread_that_dies_of_an_exception_stops_the_agent_with_exit_code_1(node):
    """A thread that ends by an exception left the agent serving without it (the registrar
    did, of a race in agent/deferred.py: no registration after kubelet's next restart). The
    agent stops cleanly instead, naming the thread, and exits 1, so that systemd's
    Restart=always starts a whole one. The death is a thread tests/inject starts in the
    agent's process, which raises when asked; the agent's code is not touched."""
    trigger = node.path("die-now")
    agent = node.agent(env=node.env(PYTHONPATH=os.path.join(ROOT, "tests", "inject"),
                                    THREAD_DEATH_FILE=trigger))
    agent.wait_registered()
    open(trigger, "w").close()
    assert agent.wait_exit() == 1, agent.log
    log = agent.log
    assert "CRITICAL agent.daemon: thread doomed died: RuntimeError: injected by the test; " \
        "the agent stops (exit code 1)" in log, log
    assert 'raise RuntimeError("injected by the test")' in log  # the traceback, once
    assert "gpu-agent stopped" in log
    assert not os.path.lexists(node.plugin_socket)
    out = run_gpu_agent("status", "--state-dir", node.state, env=clean_env(), check=False).stdout
    assert "last error: thread doomed died: RuntimeError: injected by the test" in out, out


def test_without_the_injected_thread_the_same_agent_stops_with_exit_code_0(node):
    """The other side of the test above: the inject path alone changes nothing."""
    agent = node.agent(env=node.env(PYTHONPATH=os.path.join(ROOT, "tests", "inject")))
    agent.wait_registered()
    assert agent.stop() == 0, agent.log
    assert "died" not in agent.log


# -- bad configuration: one test per kind of bad value, through `run` ---------------------------

BAD_CONFIG = [
    # (id, file text or None, extra args, extra env, the key the message must name, problem)
    ("file-bad-choice", "version: v1\nflags:\n  migStrategy: bogus\n", [], {},
     "flags.migStrategy", "'bogus' is not one of none, single, mixed"),
    ("file-wrong-type", "version: v1\nflags:\n  plugin:\n    passDeviceSpecs: 'true'\n", [], {},
     "flags.plugin.passDeviceSpecs", "boolean"),
    ("file-unknown-key", "version: v1\nflags:\n  plugin:\n    bogusKey: 1\n", [], {},
     "flags.plugin.bogusKey", ""),
    ("file-bad-version", "version: v2\n", [], {}, "version", "unsupported version 'v2'"),
    ("file-bad-section", "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
     "      - name: nvidia.com/gpu\n        replicas: 1\n", [], {},
     "sharing.timeSlicing.resources[0].replicas", "must be at least 2"),
    ("file-bad-resource-name", "version: v1\nresources:\n  gpus:\n    - pattern: '*'\n"
     "      name: Bad_Name\n", [], {}, "resources.gpus[0].name", "not a valid resource name"),
    ("file-yaml-syntax", "version: v1\nflags: [\n", [], {}, "config.yaml", ""),
    ("file-missing", None, ["--config", "/nonexistent/config.yaml"], {},
     "/nonexistent/config.yaml", ""),
    ("env-bad-choice", None, [], {"DEVICE_ID_STRATEGY": "UUID"},
     "DEVICE_ID_STRATEGY", "'UUID' is not one of uuid, index"),
    ("env-bad-boolean", None, [], {"FAIL_ON_INIT_ERROR": "maybe"},
     "FAIL_ON_INIT_ERROR", "'maybe' is not a boolean"),
    ("env-empty", None, [], {"CDI_ANNOTATION_PREFIX": ""}, "CDI_ANNOTATION_PREFIX",
     "must not be empty"),
    ("env-repeated-item", None, [], {"DEVICE_LIST_STRATEGY": "envvar,envvar"},
     "DEVICE_LIST_STRATEGY", "'envvar' is listed twice"),
    ("env-not-a-library", None, [], {"GPU_AGENT_NVML_LIBRARY": "nvml.so"},
     "GPU_AGENT_NVML_LIBRARY", "'nvml.so' is neither libnvidia-ml.so.1"),
    ("flag-relative-path", None, ["--driver-root", "run/nvidia"], {},
     "--driver-root", "'run/nvidia' is not an absolute path"),
    ("flag-bad-choice", None, ["--device-list-strategy", "nope"], {},
     "--device-list-strategy", "'nope' is not one of"),
    # accepted by the config layer, refused by `run` until implemented
    ("run-imex", "version: v1\nimex:\n  channelIDs: [0]\n", [], {},
     "imex.channelIDs", "IMEX channels are not supported"),
]


@pytest.mark.parametrize("text, args, env, key, problem",
                         [pytest.param(*case[1:], id=case[0]) for case in BAD_CONFIG])
def test_bad_config_value_exits_2_naming_the_key(node, text, args, env, key, problem):
    if text is not None:
        args = ["--config", node.write("config.yaml", text), *args]
    agent = node.agent(*args, env=node.env(**env))
    assert agent.wait_exit() == 2, agent.log
    error = [line for line in agent.log.splitlines() if line.startswith("gpu-agent: error: ")]
    assert len(error) == 1, agent.log
    assert key in error[0] and problem in error[0], error[0]
    if text is not None:
        assert node.path("config.yaml") in error[0]  # and the file
    assert not os.path.lexists(node.plugin_socket)
    assert "Traceback" not in agent.log


@pytest.mark.parametrize("text, key, problem", [
    pytest.param(case[1], case[4], case[5], id=case[0]) for case in BAD_CONFIG
    if case[1] is not None and not case[2] and not case[3]])
def test_config_check_refuses_each_file_run_refuses_with_the_same_line(node, text, key, problem):
    # an operator checks a file before `systemctl reload`: what run would refuse, check does
    path = node.write("config.yaml", text)
    checked = run_gpu_agent("config", "check", path, env=clean_env(), check=False)
    assert checked.returncode == 2 and checked.stdout == "", checked
    agent = node.agent("--config", path)
    assert agent.wait_exit() == 2, agent.log
    error = [line for line in agent.log.splitlines() if line.startswith("gpu-agent: error: ")]
    assert checked.stderr.splitlines() == error, (checked.stderr, error)
    assert key in error[0] and problem in error[0]


def test_nvidias_keys_the_agent_ignores_are_named_in_a_warning_not_dropped_silently(node):
    path = node.write("config.yaml", "version: v1\nflags:\n  gdsEnabled: true\n  plugin:\n"
                                     "    containerDriverRoot: /driver-root\n")
    agent = node.agent("--config", path)
    agent.wait_registered()
    agent.wait_log(f"WARNING agent.daemon: config file {path}: gpu-agent accepts and ignores "
                   f"NVIDIA's flags.gdsEnabled, flags.plugin.containerDriverRoot")
    assert agent.stop() == 0


# -- systemd -----------------------------------------------------------------------------------


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_systemd_notify_ready_status_watchdog_reloading_stopping_in_order(node, abstract):
    notify = NotifySocket(node, abstract=abstract)
    try:
        agent = node.agent(env=node.env(NOTIFY_SOCKET=notify.address, WATCHDOG_USEC="200000"))
        ready = notify.wait_key("READY", "1")
        assert notify.messages[ready]["STATUS"] == f"{GPU}: 8/8 healthy, registered (1)"
        assert node.client.state().resource(GPU).connected  # READY after registration
        first_dog = notify.wait_key("WATCHDOG", "1")
        notify.wait_key("WATCHDOG", "1", after=first_dog + 1)  # it keeps pinging

        agent.send(signal.SIGHUP)
        reloading = notify.wait_key("RELOADING", "1", after=ready + 1)
        assert int(notify.messages[reloading]["MONOTONIC_USEC"]) > 0
        reloaded = notify.wait_key("READY", "1", after=reloading + 1)
        # hitless: the same registration serves on
        assert notify.messages[reloaded]["STATUS"] == f"{GPU}: 8/8 healthy, registered (1)"
        assert node.client.state().resource(GPU).registrations == 1

        assert agent.stop() == 0
        stopping = notify.wait_key("STOPPING", "1", after=reloaded + 1)
        assert ready < reloading < reloaded < stopping
        assert "Traceback" not in agent.log
    finally:
        notify.close()


def test_no_notify_socket_no_notifications(node):
    """Without NOTIFY_SOCKET (not under systemd) the agent runs the same and says nothing."""
    agent = node.agent()
    agent.wait_registered()
    assert agent.stop() == 0
    assert "notify" not in agent.log.lower()


def test_log_lines_carry_the_time_unless_stderr_is_the_journal(node):
    # off the journal every line starts with the local time; a withdrawal is a WARNING, so
    # that `journalctl -u gpu-agent -p warning` lists each one
    agent = node.agent()
    agent.wait_registered()
    control.inject_xid(node.ctl, 2, 79)
    agent.wait_log("unhealthy [xid=79")
    lines = [ln for ln in agent.log.splitlines() if ln and not ln.startswith("Traceback")]
    assert lines and all(log_level(ln) for ln in lines), lines[:5]
    withdrawn = next(ln for ln in lines if "unhealthy [xid=79" in ln)
    assert log_level(withdrawn) == "WARNING"
    assert agent.stop() == 0
    # under systemd, JOURNAL_STREAM names stderr's device and inode: the journal has the time
    log_file = node.path("journal-stand-in.log")
    with open(log_file, "w") as stderr:
        st = os.fstat(stderr.fileno())
        proc = subprocess.run(
            [sys.executable, "-c", "import sys; from agent.__main__ import main; "
             "sys.exit(main())", "run", "--kubelet-socket", "", "--state-dir", node.state,
             "--nvml-library", "/nonexistent/libnvidia-ml.so.1", "--kubeconfig", ""],
            stderr=stderr, env=node.env(JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}"),
            cwd=ROOT, timeout=60)
    text = open(log_file).read()
    assert proc.returncode == 1 and text.startswith("INFO agent.daemon: gpu-agent "), text
