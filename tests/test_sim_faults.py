"""Faults on the simulated node: injected at run time through the control channel, or at start.

Owns: checking that `gpu-agent sim inject-xid|lose|restore|ecc` (run as commands) and the
agent.sim.control API reach pynvml's nvmlEventSetWait_v2 in this process with the right GPU,
XID and GPU/compute instance, only for event sets that registered that GPU; lost and
restored GPUs; hung GPUs (`hang`: every call naming the GPU blocks, no other call does, the
event wait is not affected, `--seconds 0` lets the waiting calls go); ECC counters; start-up faults (init, events_unsupported, lost); wait
timeouts; bad profiles; bad command input. Must not patch pynvml and must not assert on
durations (a wait that should wake early has a long timeout instead: if the library failed
to wake it, the test sees TIMEOUT, not a slow pass).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pynvml
import pytest

from agent.errors import SimError
from agent.sim import control
from agent.sim.profile import load_profile
from tests.conftest import ROOT, drain_nvml, run_gpu_agent

XID = pynvml.nvmlEventTypeXidCriticalError
NONE_ID = 0xFFFFFFFF
LONG_MS = 20000  # a wait that must be woken by the event, long before this






class Waiter(threading.Thread):
    """nvmlEventSetWait_v2 on another thread; .data or .error once joined."""

    def __init__(self, event_set, timeout_ms: int = LONG_MS):
        super().__init__(daemon=True)
        self.event_set = event_set
        self.timeout_ms = timeout_ms
        self.data = None
        self.error: pynvml.NVMLError | None = None
        self.start()

    def run(self) -> None:
        try:
            self.data = pynvml.nvmlEventSetWait_v2(self.event_set, self.timeout_ms)
        except pynvml.NVMLError as exc:
            self.error = exc

    def result(self):
        self.join(LONG_MS / 1000 + 10)
        assert not self.is_alive()
        return self


def handle(i: int):
    return pynvml.nvmlDeviceGetHandleByIndex(i)


def index_of(device) -> int | None:
    return pynvml.nvmlDeviceGetIndex(device) if device else None


def registered(*gpus: int, types: int = XID):
    es = pynvml.nvmlEventSetCreate()
    for i in gpus:
        pynvml.nvmlDeviceRegisterEvents(handle(i), types, es)
    return es


def sim(*args: str, env: dict) -> str:
    return run_gpu_agent("sim", *args, env=env).stdout


# ---- XIDs ----

@pytest.mark.parametrize("extra,gi,ci", [
    pytest.param((), NONE_ID, NONE_ID, id="no-instance"),
    pytest.param(("--gi", "1", "--ci", "0"), 1, 0, id="gi-ci"),
])
def test_inject_xid_command_wakes_a_blocked_pynvml_wait(node, extra, gi, ci):
    env = node()
    es = registered(3)
    waiter = Waiter(es)
    sim("inject-xid", "--gpu", "3", "--xid", "79", *extra, env=env)
    w = waiter.result()
    assert w.error is None
    assert index_of(w.data.device) == 3
    assert (w.data.eventType, w.data.eventData) == (XID, 79)
    assert (w.data.gpuInstanceId, w.data.computeInstanceId) == (gi, ci)


def test_inject_xid_by_uuid(node):
    env = node()
    es = registered(5)
    sim("inject-xid", "--gpu", pynvml.nvmlDeviceGetUUID(handle(5)), "--xid", "48", env=env)
    data = pynvml.nvmlEventSetWait_v2(es, LONG_MS)
    assert (index_of(data.device), data.eventData) == (5, 48)


def test_inject_xid_for_a_mig_device_names_its_instance(node):
    env = node("a100-mig")
    es = registered(1)
    mig = load_profile("a100-mig")["gpus"][1]["mig"]["instances"][2]
    sim("inject-xid", "--gpu", mig["uuid"], "--xid", "94", env=env)
    data = pynvml.nvmlEventSetWait_v2(es, LONG_MS)
    assert index_of(data.device) == 1
    assert (data.eventData, data.gpuInstanceId, data.computeInstanceId) == (94, mig["gi"],
                                                                          mig["ci"])


def test_event_for_gpu3_does_not_reach_a_set_that_registered_only_gpu1(node):
    env = node()
    only_gpu1 = registered(1)
    gpu3 = registered(3)
    sim("inject-xid", "--gpu", "3", "--xid", "13", env=env)
    sim("inject-xid", "--gpu", "1", "--xid", "31", env=env)
    first = pynvml.nvmlEventSetWait_v2(only_gpu1, LONG_MS)
    assert (index_of(first.device), first.eventData) == (1, 31)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(only_gpu1, 0)
    assert index_of(pynvml.nvmlEventSetWait_v2(gpu3, LONG_MS).device) == 3


def test_registering_other_event_types_does_not_receive_xids(node):
    env = node()
    ecc_only = registered(2, types=pynvml.nvmlEventTypeDoubleBitEccError)
    sim("inject-xid", "--gpu", "2", "--xid", "79", env=env)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(ecc_only, 100)


def test_xid_with_gpu_none_reaches_every_set_with_a_null_device(node):
    env = node()
    nothing = pynvml.nvmlEventSetCreate()
    gpu0 = registered(0)
    sim("inject-xid", "--gpu", "none", "--xid", "119", env=env)
    for es in (nothing, gpu0):
        data = pynvml.nvmlEventSetWait_v2(es, LONG_MS)
        assert not data.device
        assert (data.eventType, data.eventData) == (XID, 119)


def test_events_queue_in_order(node, sim_control):
    node()
    es = registered(0, 1)
    for xid in (1, 2, 3):
        control.inject_xid(sim_control, xid % 2, xid)
    got = [pynvml.nvmlEventSetWait_v2(es, LONG_MS) for _ in range(3)]
    assert [(index_of(d.device), d.eventData) for d in got] == [(1, 1), (0, 2), (1, 3)]


def test_two_threads_on_two_sets_both_get_the_event(node, sim_control):
    node()
    a, b = registered(4), registered(4)
    waiters = [Waiter(a), Waiter(b)]
    control.inject_xid(sim_control, 4, 45)
    for w in waiters:
        w.result()
        assert w.error is None
        assert (index_of(w.data.device), w.data.eventData) == (4, 45)


def test_two_threads_on_one_set_share_its_events(node, sim_control):
    node()
    es = registered(6)
    waiters = [Waiter(es), Waiter(es)]
    control.inject_xid(sim_control, 6, 61)
    control.inject_xid(sim_control, 6, 62)
    got = sorted(w.result().data.eventData for w in waiters)
    assert got == [61, 62]


def test_events_from_before_init_are_not_delivered(node, sim_control, monkeypatch):
    node()
    control.inject_xid(sim_control, 0, 79)  # logged while this process has a set open
    drain_nvml()
    pynvml.nvmlInit()
    es = registered(0)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(es, 50)


def test_wait_timeout_returns_timeout(node):
    node()
    es = registered(0)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(es, 200)


def test_freeing_a_set_wakes_its_waiter(node):
    node()
    es = registered(0)
    waiter = Waiter(es)
    time.sleep(0.2)  # let it block (if it has not yet, it sees the freed set at once)
    pynvml.nvmlEventSetFree(es)
    w = waiter.result()
    assert isinstance(w.error, (pynvml.NVMLError_Uninitialized, pynvml.NVMLError_InvalidArgument))


# ---- hung GPUs ----

class Call(threading.Thread):
    """fn() on another thread; `.value` or `.error` once `.done` is set."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.value, self.error = fn, None, None
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            self.error = exc
        finally:
            self.done.set()


def test_a_hung_gpu_blocks_each_call_naming_it_until_the_hang_is_ended(node):
    env = node()
    h2 = handle(2)
    uuid2, bus2 = pynvml.nvmlDeviceGetUUID(h2), pynvml.nvmlDeviceGetPciInfo(h2).busId
    es = registered(2)
    sim("hang", "--gpu", "2", "--seconds", "600", env=env)
    calls = {"name": Call(lambda: pynvml.nvmlDeviceGetName(h2)),
             "by index": Call(lambda: pynvml.nvmlDeviceGetUUID(handle(2))),
             "by UUID": Call(lambda: pynvml.nvmlDeviceGetUUID(
                 pynvml.nvmlDeviceGetHandleByUUID(uuid2))),
             "by PCI": Call(lambda: pynvml.nvmlDeviceGetUUID(
                 pynvml.nvmlDeviceGetHandleByPciBusId(bus2))),
             "memory": Call(lambda: pynvml.nvmlDeviceGetMemoryInfo(h2).total)}
    for _ in range(200):  # the other GPUs, the system and the event wait answer meanwhile
        assert pynvml.nvmlDeviceGetName(handle(3)) == "Tesla V100-SXM2-16GB"
        assert pynvml.nvmlDeviceGetCount() == 8
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(es, 10)
    assert [name for name, c in calls.items() if c.done.is_set()] == []
    sim("hang", "--gpu", "2", "--seconds", "0", env=env)
    for name, c in calls.items():
        assert c.done.wait(LONG_MS / 1000), f"{name}: still blocked after the hang ended"
        assert c.error is None, name
    assert {calls[k].value for k in ("by index", "by UUID", "by PCI")} == {uuid2}
    assert calls["memory"].value == 16 * 1024**3


def test_a_hung_gpu_still_delivers_its_events(node, sim_control):
    node()
    es = registered(2)
    control.hang(sim_control, 2, 600)
    waiter = Waiter(es)
    control.inject_xid(sim_control, 2, 79)
    w = waiter.result()
    assert w.error is None and w.data.eventData == 79
    control.hang(sim_control, 2, 0)
    assert index_of(w.data.device) == 2  # answers again


@pytest.mark.parametrize("gpu,seconds,message", [
    pytest.param("MIG-1234", 1, "a hang is per GPU", id="mig-uuid"),
    pytest.param(1, -1, "expected 0 to", id="negative"),
    pytest.param(1, control.MAX_HANG_S + 1, "expected 0 to", id="too-long"),
    pytest.param(1, True, "expected 0 to", id="bool"),
])
def test_hang_refuses_bad_input(sim_control, gpu, seconds, message):
    with pytest.raises(SimError, match=message):
        control.hang(sim_control, gpu, seconds)


# ---- lost GPUs ----

def test_lose_and_restore(node):
    env = node()
    es = registered(2)
    h2 = handle(2)
    waiter = Waiter(es)
    sim("lose", "--gpu", "2", env=env)
    w = waiter.result()
    assert isinstance(w.error, pynvml.NVMLError_GpuIsLost)
    for call in (lambda: pynvml.nvmlDeviceGetName(h2), lambda: pynvml.nvmlDeviceGetUUID(h2),
                 lambda: pynvml.nvmlDeviceGetMemoryInfo(h2), lambda: handle(2),
                 lambda: pynvml.nvmlDeviceGetTopologyCommonAncestor(handle(1), h2)):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    assert pynvml.nvmlDeviceGetName(handle(1)) == "Tesla V100-SXM2-16GB"
    assert pynvml.nvmlDeviceGetCount() == 8
    with pytest.raises(pynvml.NVMLError_Timeout):  # reported once
        pynvml.nvmlEventSetWait_v2(es, 50)
    sim("inject-xid", "--gpu", "2", "--xid", "79", env=env)  # a lost GPU sends nothing
    sim("restore", "--gpu", "2", env=env)
    assert pynvml.nvmlDeviceGetName(h2) == "Tesla V100-SXM2-16GB"
    sim("inject-xid", "--gpu", "2", "--xid", "80", env=env)
    data = pynvml.nvmlEventSetWait_v2(es, LONG_MS)
    assert (index_of(data.device), data.eventData) == (2, 80)


def test_lose_does_not_disturb_sets_of_other_gpus(node, sim_control):
    node()
    other = registered(1)
    control.lose(sim_control, 2)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(other, 50)


def test_lost_gpu_takes_its_mig_devices_with_it(node, sim_control):
    node("a100-mig")
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle(0), 0)
    control.lose(sim_control, 0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetUUID(mig)
    control.restore(sim_control, pynvml.nvmlDeviceGetUUID(handle(1)))  # another GPU: no effect
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetUUID(mig)


def test_lost_state_outlives_the_process_that_saw_it(node, sim_control):
    """A GPU lost before nvmlInit is lost after it: state comes from the whole log."""
    node()
    control.lose(sim_control, 7)
    drain_nvml()
    pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        handle(7)


# ---- ECC ----

@pytest.mark.parametrize("flag,event,error_type", [
    pytest.param("--double-bit", pynvml.nvmlEventTypeDoubleBitEccError,
                 pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, id="double-bit"),
    pytest.param("--single-bit", pynvml.nvmlEventTypeSingleBitEccError,
                 pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, id="single-bit"),
])
def test_ecc_event_and_counters(node, flag, event, error_type):
    env = node()
    es = registered(3, types=event)
    other = 1 - error_type
    sim("ecc", "--gpu", "3", flag, env=env)
    data = pynvml.nvmlEventSetWait_v2(es, LONG_MS)
    assert (index_of(data.device), data.eventType) == (3, event)
    for counter in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
        assert pynvml.nvmlDeviceGetTotalEccErrors(handle(3), error_type, counter) == 1
        assert pynvml.nvmlDeviceGetTotalEccErrors(handle(3), other, counter) == 0
        assert pynvml.nvmlDeviceGetTotalEccErrors(handle(2), error_type, counter) == 0


# ---- start-up faults ----

@pytest.mark.parametrize("faults,error", [
    pytest.param("init=DRIVER_NOT_LOADED", pynvml.NVMLError_DriverNotLoaded, id="name"),
    pytest.param("init=NVML_ERROR_NO_PERMISSION", pynvml.NVMLError_NoPermission, id="prefixed"),
    pytest.param("init=18", pynvml.NVMLError_LibRmVersionMismatch, id="number"),
])
def test_init_fault_from_the_environment(node, faults, error, capfd):
    with pytest.raises(error):
        node(faults=faults)
    assert "injected start-up fault" in capfd.readouterr().err


def test_init_fault_from_the_profile(node, tmp_path):
    path = tmp_path / "p.yaml"
    text = (ROOT / "agent/sim/profiles/pcie-8gpu.yaml").read_text()
    path.write_text(text + "faults:\n  init: DRIVER_NOT_LOADED\n")
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        node(str(path))


def test_events_unsupported_fault(node):
    node(faults="events_unsupported=3+5")
    es = pynvml.nvmlEventSetCreate()
    for i in (3, 5):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceRegisterEvents(handle(i), XID, es)
    pynvml.nvmlDeviceRegisterEvents(handle(4), XID, es)


def test_lost_fault_at_start(node, sim_control):
    node(faults="lost=1")
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        handle(1)
    control.restore(sim_control, 1)
    assert pynvml.nvmlDeviceGetIndex(handle(1)) == 1


def test_unsupported_event_type_cannot_be_registered(node):
    node("pcie-8gpu")
    es = pynvml.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceRegisterEvents(handle(0), pynvml.nvmlEventTypeGpuUnavailableError, es)


def test_mig_handles_cannot_register_events(node):
    node("a100-mig")
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle(0), 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceRegisterEvents(mig, XID, pynvml.nvmlEventSetCreate())


# ---- bad configuration: errors, never crashes ----

@pytest.mark.parametrize("profile,faults,message", [
    pytest.param("no-such-profile", None, "no profile named 'no-such-profile'", id="unknown-name"),
    pytest.param("/nonexistent/p.yaml", None, "cannot open", id="missing-file"),
    pytest.param("bad name!", None, "neither a profile name", id="bad-name"),
    pytest.param("dgx1-v100", "init=BOGUS", "init=BOGUS", id="bad-init-fault"),
    pytest.param("dgx1-v100", "lost=8", "lost=8", id="fault-gpu-out-of-range"),
    pytest.param("dgx1-v100", "color=blue", "unknown key 'color'", id="unknown-fault"),
])
def test_bad_configuration_fails_init_with_one_clear_line(node, capfd, profile, faults, message):
    capfd.readouterr()
    with pytest.raises(pynvml.NVMLError_Unknown):
        node(profile, faults=faults)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("gpu-agent simulated NVML: nvmlInit failed")
    assert message in err[0]


@pytest.mark.parametrize("content", [
    pytest.param("gpus: [\n", id="broken-yaml"),
    pytest.param("", id="empty"),
    pytest.param("\x00\x01\x02", id="binary"),
    pytest.param("- just\n- a list\n", id="not-a-mapping"),
    pytest.param("schema: 1\n" * 2, id="duplicate-key"),
])
def test_bad_profile_file_is_an_error_in_a_child_process_not_a_crash(tmp_path, sim_env, content):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    code = ("import pynvml, sys\n"
            "from agent.nvml import library\nfrom agent.sim import lib_path\n"
            "try:\n    library.init(str(lib_path()))\nexcept Exception as e:\n"
            "    print(type(e).__name__, e)\n    sys.exit(0)\nsys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=sim_env(str(path)), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NvmlError" in proc.stdout and "UNKNOWN" in proc.stdout
    assert str(path) in proc.stderr


def test_control_directory_is_created_by_the_library(node, monkeypatch, tmp_path):
    node()
    drain_nvml()
    fresh = tmp_path / "made-by-library"
    monkeypatch.setenv("GPU_AGENT_SIM_CONTROL", str(fresh))
    pynvml.nvmlInit()
    assert fresh.is_dir()


@pytest.mark.parametrize("args,message", [
    pytest.param(("inject-xid", "--gpu", "abc", "--xid", "79"), "expected a GPU index",
                 id="gpu-not-a-number"),
    pytest.param(("inject-xid", "--gpu", "1", "--xid", "-1"), "must not be negative",
                 id="negative-xid"),
    pytest.param(("inject-xid", "--gpu", "1", "--xid", "seventy"), "is not an integer",
                 id="xid-not-a-number"),
    pytest.param(("inject-xid", "--gpu", "1"), "--xid", id="missing-xid"),
    pytest.param(("inject-xid", "--gpu", "1", "--xid", "79", "--gi", "4294967296"),
                 "GPU instance id", id="gi-too-big"),
    pytest.param(("inject-xid", "--gpu", "8", "--xid", "79"), "has GPUs 0-7",
                 id="gpu-past-profile"),
    pytest.param(("inject-xid", "--gpu", "GPU-not-here", "--xid", "79"), "no GPU or MIG device",
                 id="unknown-uuid"),
    pytest.param(("lose", "--gpu", "none"), "only valid for inject-xid", id="lose-none"),
    pytest.param(("ecc", "--gpu", "0"), "--double-bit", id="ecc-without-kind"),
    pytest.param(("ecc", "--gpu", "0", "--single-bit", "--double-bit"), "not allowed",
                 id="ecc-both-kinds"),
])
def test_bad_command_input_is_a_clear_error(sim_env, args, message):
    proc = run_gpu_agent("sim", *args, env=sim_env("dgx1-v100"), check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("setup,message", [
    pytest.param("unset", "GPU_AGENT_SIM_CONTROL", id="no-env"),
    pytest.param("missing", "does not exist", id="missing-directory"),
])
def test_control_directory_must_exist_for_commands(sim_env, tmp_path, setup, message):
    env = sim_env("dgx1-v100")
    if setup == "unset":
        env.pop("GPU_AGENT_SIM_CONTROL")
    else:
        env["GPU_AGENT_SIM_CONTROL"] = str(tmp_path / "nope")
    proc = run_gpu_agent("sim", "lose", "--gpu", "1", env=env, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.parametrize("call", [
    pytest.param(lambda d: control.inject_xid(d, -1, 79), id="negative-gpu"),
    pytest.param(lambda d: control.inject_xid(d, 0, -5), id="negative-xid"),
    pytest.param(lambda d: control.inject_xid(d, True, 5), id="bool-gpu"),
    pytest.param(lambda d: control.ecc(d, "GPU x"), id="space-in-uuid"),
    pytest.param(lambda d: control.restore(d / "missing", 0), id="missing-dir"),
])
def test_control_api_rejects_bad_input(sim_control, call):
    with pytest.raises(SimError):
        call(sim_control)


def test_control_records_are_single_lines(sim_control):
    control.inject_xid(sim_control, 0, 79)
    control.inject_xid(sim_control, None, 13, gi=2, ci=1)
    control.lose(sim_control, "GPU-abc")
    control.ecc(sim_control, 1, double_bit=False)
    assert (sim_control / control.LOG_NAME).read_text().splitlines() == [
        "xid gpu=0 xid=79 gi=4294967295 ci=4294967295",
        "xid gpu=none xid=13 gi=2 ci=1",
        "lose gpu=GPU-abc",
        "ecc gpu=1 type=sbe",
    ]
