"""GPU telemetry of the simulated libnvidia-ml.so.1, read through unmodified pynvml.

Owns: checking each profile's idle telemetry, that `telemetry` records (agent.sim.control's
set_telemetry and `gpu-agent sim telemetry`) are seen by the very next query in this process
and in another one, that they persist (until changed, across nvmlInit), which memory-repair
queries each architecture answers (retired pages before Ampere, remapped rows from Ampere
on), NVML's argument errors, MIG handles, lost GPUs, `delay_ms` (getters sleep at least that
long without holding up other calls or other GPUs; discovery and health queries are never
delayed), and that bad values are refused by the writer with the key named and by the library
all or nothing. Must not patch pynvml and must not put an upper bound on a duration: a call
that must not be delayed runs while its GPU has the longest delay, so a regression hangs
(the suite's timeout) instead of passing slowly.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pynvml
import pytest

from agent.errors import SimError
from agent.sim import control, profile_names
from agent.sim.profile import load_profile
from tests.conftest import ROOT, drain_nvml, run_gpu_agent

MIB = 1024 * 1024
IDLE = pynvml.nvmlClocksThrottleReasonGpuIdle
NOT_SUPPORTED = pynvml.NVMLError_NotSupported

# What each shipped profile's GPUs answer idle: power and limit in mW, SM and memory clock
# in MHz, and how the GPU reports repaired memory ("pages" before Ampere, "rows" after).
DEFAULTS = {
    "dgx1-v100": dict(power=42000, limit=300000, sm=135, mem=877, repair="pages"),
    "dgx-h100": dict(power=72000, limit=700000, sm=345, mem=2619, repair="rows"),
    "h100-mig": dict(power=72000, limit=700000, sm=345, mem=2619, repair="rows"),
    "a100-mig": dict(power=58000, limit=400000, sm=210, mem=1593, repair="rows"),
    "a30-mig": dict(power=30000, limit=165000, sm=210, mem=1215, repair="rows"),
    "pcie-8gpu": dict(power=35000, limit=350000, sm=210, mem=405, repair="rows"),
}


def handle(i: int):
    return pynvml.nvmlDeviceGetHandleByIndex(i)


def reading(h) -> dict:
    """Every telemetry value of handle `h` (the memory-repair ones where supported)."""
    util = pynvml.nvmlDeviceGetUtilizationRates(h)
    memory = pynvml.nvmlDeviceGetMemoryInfo(h)
    out = dict(
        gpu_util=util.gpu, mem_util=util.memory, memory_used=memory.used,
        memory_free=memory.free, temperature_c=pynvml.nvmlDeviceGetTemperature(h, 0),
        power_mw=pynvml.nvmlDeviceGetPowerUsage(h),
        limit_mw=pynvml.nvmlDeviceGetEnforcedPowerLimit(h),
        sm_clock_mhz=pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
        graphics_clock_mhz=pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_GRAPHICS),
        mem_clock_mhz=pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
        throttle_reasons=pynvml.nvmlDeviceGetCurrentClocksEventReasons(h),
        throttle_reasons_old=pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h),
    )
    try:
        out["retired_pending"] = pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h)
    except NOT_SUPPORTED:
        pass
    try:
        out["remapped"] = pynvml.nvmlDeviceGetRemappedRows(h)
    except NOT_SUPPORTED:
        pass
    return out


# ---- defaults ----

@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_idle_defaults_of_each_shipped_profile(node, name):
    node(name)
    want = DEFAULTS[name]
    gpus = load_profile(name)["gpus"]
    for i, gpu in enumerate(gpus):
        got = reading(handle(i))
        reserved, used = gpu["memory"]["reserved"], gpu["memory"]["used"]
        assert got["memory_used"] == reserved + used
        assert got["memory_free"] == gpu["memory"]["total"] - reserved - used
        assert (got["gpu_util"], got["mem_util"], got["temperature_c"]) == (0, 0, 35)
        assert (got["power_mw"], got["limit_mw"]) == (want["power"], want["limit"])
        assert (got["sm_clock_mhz"], got["graphics_clock_mhz"], got["mem_clock_mhz"]) == (
            want["sm"], want["sm"], want["mem"])
        assert got["throttle_reasons"] == got["throttle_reasons_old"] == IDLE
        if want["repair"] == "pages":
            assert got["retired_pending"] == pynvml.NVML_FEATURE_DISABLED
            assert "remapped" not in got
        else:
            assert got["remapped"] == (0, 0, 0, 0)
            assert "retired_pending" not in got


@pytest.mark.parametrize("name", profile_names())
def test_every_profile_idles_below_its_power_limit(node, name):
    node(name)
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = handle(i)
        assert 0 < pynvml.nvmlDeviceGetPowerUsage(h) < pynvml.nvmlDeviceGetEnforcedPowerLimit(h)
        assert pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) > 0


# ---- setting values ----

def test_set_values_are_seen_by_the_next_query(node, sim_control):
    node("dgx1-v100")
    before_gpu1 = reading(handle(1))
    record = control.set_telemetry(
        0, sim_control, gpu_util=97, mem_util=41, memory_used_mib=2048, temperature_c=85,
        power_mw=251500, sm_clock_mhz=1530, throttle_reasons=0x24, retired_pending=1)
    assert record == ("telemetry gpu=0 gpu_util=97 mem_util=41 memory_used_mib=2048 "
                      "temperature_c=85 power_mw=251500 sm_clock_mhz=1530 throttle_reasons=36 "
                      "retired_pending=1")
    got = reading(handle(0))
    total = load_profile("dgx1-v100")["gpus"][0]["memory"]["total"]
    assert got == dict(
        gpu_util=97, mem_util=41, memory_used=2048 * MIB, memory_free=total - 2048 * MIB,
        temperature_c=85, power_mw=251500, limit_mw=300000, sm_clock_mhz=1530,
        graphics_clock_mhz=1530, mem_clock_mhz=877, throttle_reasons=0x24,
        throttle_reasons_old=0x24, retired_pending=pynvml.NVML_FEATURE_ENABLED)
    assert reading(handle(1)) == before_gpu1


def test_every_write_is_seen_by_the_query_right_after_it(node, sim_control):
    node()
    h = handle(4)
    uuid = pynvml.nvmlDeviceGetUUID(h)
    for value in range(20, 120):
        control.set_telemetry(uuid if value % 2 else 4, sim_control, temperature_c=value,
                              power_mw=value * 1000)
        assert pynvml.nvmlDeviceGetTemperature(h, 0) == value
        assert pynvml.nvmlDeviceGetPowerUsage(h) == value * 1000


CHILD = """
import sys
import pynvml
from agent.nvml import library
from agent.sim import lib_path
library.init(str(lib_path()))
h = pynvml.nvmlDeviceGetHandleByIndex(2)
print(pynvml.nvmlDeviceGetTemperature(h, 0), flush=True)
for _ in sys.stdin:
    print(pynvml.nvmlDeviceGetTemperature(h, 0), flush=True)
"""


def test_another_process_sees_each_value_at_its_next_query(node, sim_control):
    env = node()
    control.set_telemetry(2, sim_control, temperature_c=50)  # before it starts: replayed
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, cwd=ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "50"
        for value in range(60, 100):
            control.set_telemetry(2, sim_control, temperature_c=value)
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == str(value)
    finally:
        child.stdin.close()
        assert child.wait(timeout=60) == 0


def test_values_persist_until_changed_and_across_init(node, sim_control):
    node("dgx-h100")
    control.set_telemetry(3, sim_control, temperature_c=70, gpu_util=30)
    control.set_telemetry(3, sim_control, power_mw=400000)
    control.set_telemetry(3, sim_control, gpu_util=0)
    drain_nvml()
    pynvml.nvmlInit()
    got = reading(handle(3))
    assert (got["temperature_c"], got["power_mw"], got["gpu_util"]) == (70, 400000, 0)


def test_memory_used_leaves_reserved_memory_apart(node, sim_control):
    node("dgx-h100")
    memory = load_profile("dgx-h100")["gpus"][5]["memory"]
    total, reserved = memory["total"], memory["reserved"]
    control.set_telemetry(5, sim_control, memory_used_mib=10240)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(handle(5), version=pynvml.nvmlMemory_v2)
    assert (v2.total, v2.reserved, v2.used) == (total, reserved, 10240 * MIB)
    assert v2.free == total - reserved - 10240 * MIB
    v1 = pynvml.nvmlDeviceGetMemoryInfo(handle(5))
    assert (v1.used, v1.free) == (reserved + 10240 * MIB, total - reserved - 10240 * MIB)
    most = (total - reserved) // MIB
    control.set_telemetry(5, sim_control, memory_used_mib=most)
    assert pynvml.nvmlDeviceGetMemoryInfo(handle(5)).free == total - reserved - most * MIB


def test_clock_event_bits_read_back_through_both_names(node, sim_control):
    node()
    bits = (pynvml.nvmlClocksEventReasonSwPowerCap
            | pynvml.nvmlClocksEventReasonHwThermalSlowdown)
    control.set_telemetry(6, sim_control, throttle_reasons=bits)
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle(6)) == bits
    assert pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle(6)) == bits
    control.set_telemetry(6, sim_control, throttle_reasons=0)
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle(6)) == 0


# ---- memory repair by architecture ----

def test_v100_retires_pages_and_has_no_row_remapping(node, sim_control):
    node("dgx1-v100")
    h = handle(0)
    for cause in (pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                  pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR):
        assert pynvml.nvmlDeviceGetRetiredPages(h, cause) == []
        assert pynvml.nvmlDeviceGetRetiredPages_v2(h, cause) == []
    assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h) == pynvml.NVML_FEATURE_DISABLED
    control.set_telemetry(0, sim_control, retired_pending=True)
    assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h) == pynvml.NVML_FEATURE_ENABLED
    control.set_telemetry(0, sim_control, remapped_correctable=3)  # kept, never answered
    with pytest.raises(NOT_SUPPORTED):
        pynvml.nvmlDeviceGetRemappedRows(h)


@pytest.mark.parametrize("name", ["a100-mig", "a30-mig", "dgx-h100"])
def test_ampere_and_newer_remap_rows_and_retire_no_pages(node, sim_control, name):
    node(name)
    h = handle(2)
    assert pynvml.nvmlDeviceGetRemappedRows(h) == (0, 0, 0, 0)
    control.set_telemetry(2, sim_control, remapped_correctable=3, remapped_uncorrectable=1,
                          remapped_pending=1)
    assert pynvml.nvmlDeviceGetRemappedRows(h) == (3, 1, 1, 0)
    assert pynvml.nvmlDeviceGetRemappedRows(handle(1)) == (0, 0, 0, 0)
    for call in (pynvml.nvmlDeviceGetRetiredPagesPendingStatus,
                 lambda h: pynvml.nvmlDeviceGetRetiredPages(h, 0),
                 lambda h: pynvml.nvmlDeviceGetRetiredPages_v2(h, 1)):
        with pytest.raises(NOT_SUPPORTED):
            call(h)
    control.set_telemetry(2, sim_control, remapped_failed=1)
    assert pynvml.nvmlDeviceGetRemappedRows(h) == (3, 1, 1, 1)


def recovery_action(h, *more_fields: int) -> list[tuple[int, int]]:
    """(nvmlReturn, value) of the recovery action field, then of each field in more_fields."""
    values = pynvml.nvmlDeviceGetFieldValues(
        h, [pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, *more_fields])
    return [(v.nvmlReturn, v.value.uiVal) for v in values]


@pytest.mark.parametrize("name", ["dgx1-v100", "dgx-h100"])
def test_the_recovery_action_field_reads_what_was_set_and_other_fields_are_not_supported(
        node, sim_control, name):
    node(name)
    none = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    assert recovery_action(handle(3)) == [(pynvml.NVML_SUCCESS, none)]
    control.set_telemetry(3, sim_control, recovery_action=pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    got = recovery_action(handle(3), pynvml.NVML_FI_DEV_ECC_CURRENT)
    assert got[0] == (pynvml.NVML_SUCCESS, pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    assert got[1][0] == pynvml.NVML_ERROR_NOT_SUPPORTED  # the call succeeds, the field does not
    assert recovery_action(handle(2)) == [(pynvml.NVML_SUCCESS, none)]  # per GPU
    with pytest.raises(SimError, match="recovery_action"):
        control.set_telemetry(3, sim_control, recovery_action=8)


# ---- NVML's errors ----

@pytest.mark.parametrize("call", [
    pytest.param(lambda h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU_MAX),
                 id="temperature-other-sensor"),
    pytest.param(lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_VIDEO),
                 id="clock-video"),
    pytest.param(lambda h: pynvml.nvmlDeviceGetClockInfo(h, 17), id="clock-unknown"),
    pytest.param(lambda h: pynvml.nvmlDeviceGetRetiredPages(h, 2), id="retired-pages-cause"),
])
def test_bad_arguments_are_invalid(node, call):
    node("dgx1-v100")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        call(handle(0))


GETTERS = [
    pytest.param(pynvml.nvmlDeviceGetUtilizationRates, id="utilization"),
    pytest.param(lambda h: pynvml.nvmlDeviceGetTemperature(h, 0), id="temperature"),
    pytest.param(pynvml.nvmlDeviceGetPowerUsage, id="power"),
    pytest.param(pynvml.nvmlDeviceGetEnforcedPowerLimit, id="power-limit"),
    pytest.param(lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM), id="sm-clock"),
    pytest.param(pynvml.nvmlDeviceGetCurrentClocksEventReasons, id="clock-event-reasons"),
    pytest.param(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, id="throttle-reasons"),
    pytest.param(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, id="retired-pending"),
    pytest.param(lambda h: pynvml.nvmlDeviceGetRetiredPages(h, 0), id="retired-pages"),
    pytest.param(lambda h: pynvml.nvmlDeviceGetRetiredPages_v2(h, 0), id="retired-pages-v2"),
    pytest.param(pynvml.nvmlDeviceGetRemappedRows, id="remapped-rows"),
]


@pytest.mark.parametrize("call", GETTERS)
def test_mig_devices_have_no_telemetry_of_their_own(node, call):
    node("a100-mig")
    with pytest.raises(NOT_SUPPORTED):
        call(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle(0), 0))


@pytest.mark.parametrize("name", ["dgx1-v100", "dgx-h100"])
def test_a_lost_gpu_answers_gpu_is_lost_until_restored(node, sim_control, name):
    node(name)
    h = handle(1)
    control.set_telemetry(1, sim_control, temperature_c=88)
    control.lose(sim_control, 1)
    for param in GETTERS:
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            param.values[0](h)
    assert pynvml.nvmlDeviceGetTemperature(handle(2), 0) == 35
    control.restore(sim_control, 1)
    assert pynvml.nvmlDeviceGetTemperature(h, 0) == 88


# ---- delay ----

@pytest.mark.parametrize("name", ["dgx1-v100", "dgx-h100"])
@pytest.mark.parametrize("call", GETTERS)
def test_delay_makes_each_getter_take_at_least_that_long(node, sim_control, call, name):
    node(name)
    delay_ms = 100
    control.set_telemetry(3, sim_control, delay_ms=delay_ms)
    start = time.monotonic_ns()
    try:
        call(handle(3))
    except NOT_SUPPORTED:
        pass  # the other architecture's memory-repair query: delayed all the same
    assert time.monotonic_ns() - start >= delay_ms * 1_000_000


def test_delay_spares_other_queries_and_other_gpus_and_clears(node, sim_control):
    """GPU 0 gets the longest delay: if any call here were delayed, the test would hang."""
    node("a100-mig")
    control.set_telemetry(0, sim_control, delay_ms=600_000)
    h = handle(0)
    es = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, es)
    assert pynvml.nvmlDeviceGetName(h) == "NVIDIA A100-SXM4-80GB"
    assert pynvml.nvmlDeviceGetHandleByUUID(pynvml.nvmlDeviceGetUUID(h))
    assert pynvml.nvmlDeviceGetPciInfo(h).busId
    assert pynvml.nvmlDeviceGetMemoryInfo(h).total > 0
    assert pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).total > 0
    assert pynvml.nvmlDeviceGetTotalEccErrors(h, 1, pynvml.NVML_VOLATILE_ECC) == 0
    assert pynvml.nvmlDeviceGetMigMode(h)[0] == 1
    assert pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    control.inject_xid(sim_control, 0, 79)
    assert pynvml.nvmlEventSetWait_v2(es, 20000).eventData == 79
    assert reading(handle(1))["temperature_c"] == 35
    control.set_telemetry(0, sim_control, delay_ms=0)
    assert reading(h)["temperature_c"] == 35


def test_a_delayed_call_holds_no_lock_and_answers_the_state_after_its_delay(node, sim_control):
    """The delayed call sleeps in another thread while this one queries and writes: with the
    library's lock held through the sleep, these calls would wait for it to end first."""
    node()
    control.set_telemetry(0, sim_control, delay_ms=3000)
    h0 = handle(0)
    calling = threading.Event()
    result: list = []

    def delayed() -> None:
        calling.set()
        result.append(pynvml.nvmlDeviceGetTemperature(h0, 0))

    thread = threading.Thread(target=delayed, daemon=True)
    thread.start()
    calling.wait()
    control.set_telemetry(0, sim_control, temperature_c=77)
    assert pynvml.nvmlDeviceGetName(h0) == "Tesla V100-SXM2-16GB"
    assert pynvml.nvmlDeviceGetTemperature(handle(1), 0) == 35
    assert thread.is_alive()
    thread.join(60)
    assert result == [77]


# ---- bad input ----

@pytest.mark.parametrize("gpu,values,message", [
    pytest.param(0, {"temperature": 50}, "unknown key 'temperature'", id="unknown-key"),
    pytest.param(0, {"gpu_util": 101}, "gpu_util (--gpu-util) 101", id="util-over-100"),
    pytest.param(0, {"temperature_c": -1}, "temperature_c (--temperature-c) -1",
                 id="negative"),
    pytest.param(0, {"power_mw": 2.5}, "power_mw", id="not-an-integer"),
    pytest.param(0, {"power_mw": True}, "power_mw", id="bool-for-a-number"),
    pytest.param(0, {"retired_pending": 2}, "retired_pending", id="flag-not-0-or-1"),
    pytest.param(0, {"delay_ms": 600_001}, "delay_ms", id="delay-too-long"),
    pytest.param(0, {"memory_used_mib": 16385}, "memory_used_mib (--memory-used-mib) 16385",
                 id="more-memory-than-the-gpu"),
    pytest.param(0, {}, "no values", id="no-values"),
    pytest.param(8, {"gpu_util": 1}, "has GPUs 0-7", id="gpu-past-profile"),
    pytest.param(None, {"gpu_util": 1}, "only valid for inject-xid", id="gpu-none"),
])
def test_set_telemetry_rejects_bad_input_naming_it(sim_env, sim_control, gpu, values, message):
    sim_env("dgx1-v100")
    with pytest.raises(SimError) as error:
        control.set_telemetry(gpu, sim_control, **values)
    assert message in str(error.value)
    assert not (sim_control / control.LOG_NAME).exists()


def test_set_telemetry_refuses_a_mig_device(sim_env, sim_control):
    sim_env("a100-mig")
    mig = load_profile("a100-mig")["gpus"][0]["mig"]["instances"][0]["uuid"]
    with pytest.raises(SimError, match="telemetry is per GPU"):
        control.set_telemetry(mig, sim_control, gpu_util=5)


@pytest.mark.parametrize("record", [
    pytest.param("telemetry gpu=0 temperature_c=60 gpu_util=101", id="one-value-out-of-range"),
    pytest.param("telemetry gpu=0 temperature_c=60 fan_speed=5", id="unknown-key"),
    pytest.param("telemetry gpu=0 temperature_c=60 power_mw=-5", id="negative"),
    pytest.param("telemetry gpu=0 temperature_c=60 power_mw=lots", id="not-a-number"),
    pytest.param("telemetry gpu=0 temperature_c=60 memory_used_mib=16385", id="too-much-memory"),
    pytest.param("telemetry gpu=0 temperature_c=60 retired_pending=2", id="flag-past-1"),
])
def test_the_library_applies_a_bad_record_not_at_all(node, sim_control, record):
    node("dgx1-v100")
    control.append_record(sim_control, record)
    got = reading(handle(0))
    assert (got["temperature_c"], got["gpu_util"], got["power_mw"]) == (35, 0, 42000)
    assert (got["memory_used"], got["retired_pending"]) == (0, 0)
    control.set_telemetry(0, sim_control, temperature_c=61)  # the log reads on past it
    assert pynvml.nvmlDeviceGetTemperature(handle(0), 0) == 61


# ---- command line ----

def test_telemetry_command_sets_values_seen_here(node):
    env = node("dgx-h100")
    uuid = pynvml.nvmlDeviceGetUUID(handle(3))
    out = run_gpu_agent("sim", "telemetry", "--gpu", uuid, "--temperature-c", "85",
                        "--throttle-reasons", "0x20", "--remapped-pending", "1", env=env).stdout
    assert out.strip() == (f"telemetry gpu={uuid} temperature_c=85 throttle_reasons=32 "
                           f"remapped_pending=1")
    h = handle(3)
    assert pynvml.nvmlDeviceGetTemperature(h, 0) == 85
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) == 0x20
    assert pynvml.nvmlDeviceGetRemappedRows(h) == (0, 0, 1, 0)


@pytest.mark.parametrize("args,message", [
    pytest.param(("--gpu", "0"), "no values", id="no-values"),
    pytest.param(("--gpu", "0", "--temperature-c", "300"), "temperature_c (--temperature-c)",
                 id="out-of-range"),
    pytest.param(("--gpu", "0", "--gpu-util", "lots"), "is not an integer", id="not-a-number"),
    pytest.param(("--gpu", "0", "--power-mw", "-1"), "must not be negative", id="negative"),
    pytest.param(("--gpu", "0", "--fan-speed", "5"), "unrecognized arguments", id="unknown"),
    pytest.param(("--temperature-c", "50",), "--gpu", id="no-gpu"),
])
def test_telemetry_command_rejects_bad_input(sim_env, args, message):
    proc = run_gpu_agent("sim", "telemetry", *args, env=sim_env("dgx1-v100"), check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
