"""agent._fast events (the NVML event set), run against the compiled module and its pure-Python
twin on the simulated libnvidia-ml.so.1 loaded in this process, as the daemon loads the driver's:
agent.nvml.library.init() first (pynvml bound and initialised), then an EventSet on the same path.
Events are injected by `gpu-agent sim` in a child process, through the simulator's control channel.

Covers delivery of an injected XID with the GPU's index and UUID, timeouts, registration masks,
events of unregistered GPUs, GPU/compute instance ids, a lost GPU, a GPU without events, the
filter (ignored XIDs dropped and counted, single-bit ECC counted, a storm still ending at the
timeout), the GIL being released during wait(), and close().
"""

from __future__ import annotations

import ctypes.util
import importlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pynvml
import pytest
from conftest import run_gpu_agent

from agent._fast import _types
from agent.errors import NvmlError, NvmlLibraryError
from agent.nvml import library
from agent.sim import lib_path

XID = 0x8  # nvmlEventTypeXidCriticalError
SBE, DBE = 0x1, 0x2
GPU = 2
# Long enough for a child `gpu-agent sim` to start and inject on a busy 2-core machine; a wait
# that should see an event returns as soon as it arrives, so this only bounds failures.
WAIT_MS = _types.MAX_WAIT_MS


@pytest.fixture
def events(fast_impl):
    """The module under test: agent._fast.events, then its twin (conftest's `fast_impl`)."""
    return fast_impl.events


@dataclass
class Node:
    """A simulated node initialised in this process; `env` is for `gpu-agent sim` children."""

    path: str
    env: dict
    control: Path

    def sim(self, *args: str) -> None:
        run_gpu_agent("sim", *args, env=self.env)

    def inject_xid(self, gpu: int, xid: int, *extra: str) -> None:
        self.sim("inject-xid", "--gpu", str(gpu), "--xid", str(xid), *extra)

    def uuid(self, index: int) -> str:
        return pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))

    def supported(self, index: int) -> int:
        return pynvml.nvmlDeviceGetSupportedEventTypes(pynvml.nvmlDeviceGetHandleByIndex(index))


@pytest.fixture
def make_node(sim_env, sim_control, monkeypatch):
    """make_node(faults=None) -> Node: a fresh simulated dgx1-v100 (its own control directory).

    The simulator reads its environment at the init that takes its count from 0 to 1, so each
    test starts from zero and the teardown brings the count back there.
    """
    started = []

    def make(faults: str | None = None) -> Node:
        if faults is not None:
            monkeypatch.setenv("GPU_AGENT_SIM_FAULTS", faults)
        env = sim_env("dgx1-v100")
        path = str(lib_path())
        library.init(path)
        started.append(path)
        return Node(path, env, sim_control)

    yield make
    for _ in started:
        library.shutdown()


@pytest.fixture
def node(make_node) -> Node:
    return make_node()


@pytest.fixture
def open_set(events):
    """open_set() -> EventSet on the simulated library; every one is closed at teardown.

    Call it after the node is made (`node`, or `make_node(...)` in the test), as the daemon
    opens its event set after agent.nvml.library.init.
    """
    made = []

    def make():
        es = events.EventSet(str(lib_path()))
        made.append(es)
        return es

    yield make
    for es in made:
        es.close()


def test_xid_on_registered_gpu_is_delivered(events, node, open_set):
    """The acceptance test: inject XID 79 on GPU 2 from another process, receive it in wait()."""
    es = open_set()
    assert es.register(GPU, XID) == XID
    node.inject_xid(GPU, 79)
    event = es.wait(WAIT_MS)
    assert isinstance(event, _types.Event)
    assert event.index == GPU
    assert event.uuid == node.uuid(GPU)
    assert event.event_type == XID
    assert event.xid == 79
    assert es.wait(100) is None, "one injection, one event"


def test_wait_times_out_with_none(events, node, open_set):
    es = open_set()
    es.register(GPU, XID)
    assert es.wait(50) is None
    assert es.wait(0) is None


def test_event_of_unregistered_gpu_is_not_delivered(events, node, open_set):
    es = open_set()
    es.register(GPU, XID)
    node.inject_xid(GPU + 1, 48)
    assert es.wait(300) is None
    node.inject_xid(GPU, 31)  # the set still works: the next event is GPU 2's, not GPU 3's
    event = es.wait(WAIT_MS)
    assert (event.index, event.xid) == (GPU, 31)


def test_events_arrive_in_order_from_several_gpus(events, node, open_set):
    es = open_set()
    for index in (0, GPU, 5):
        es.register(index, XID)
    for index, xid in ((5, 13), (0, 43), (GPU, 79)):
        node.inject_xid(index, xid)
    got = [es.wait(WAIT_MS) for _ in range(3)]
    assert [(e.index, e.uuid, e.xid) for e in got] == [
        (5, node.uuid(5), 13), (0, node.uuid(0), 43), (GPU, node.uuid(GPU), 79)
    ]


def test_event_naming_no_gpu_has_no_index_or_uuid(events, node, open_set):
    es = open_set()
    es.register(GPU, XID)
    node.inject_xid("none", 13)
    event = es.wait(WAIT_MS)
    assert event == _types.Event(None, None, XID, 13, _types.NO_INSTANCE, _types.NO_INSTANCE)


def test_every_set_gets_the_event_whichever_implementation(events, node, open_set):
    other = importlib.import_module(
        "agent._fast._events_py" if events.__name__.endswith(".events") else "agent._fast.events"
    )
    mine = open_set()
    with other.EventSet(node.path) as theirs:
        mine.register(GPU, XID)
        theirs.register(GPU, XID)
        node.inject_xid(GPU, 79)
        event = mine.wait(WAIT_MS)
        assert event is not None and (event.index, event.xid) == (GPU, 79)
        assert theirs.wait(WAIT_MS) == event


def test_gpu_and_compute_instance_ids_pass_through(events, node, open_set):
    es = open_set()
    es.register(GPU, XID)
    node.inject_xid(GPU, 79, "--gi", "1", "--ci", "0")
    event = es.wait(WAIT_MS)
    assert (event.index, event.xid) == (GPU, 79)
    assert (event.gpu_instance_id, event.compute_instance_id) == (1, 0)


def test_register_masks_with_supported_types(events, node, open_set):
    es = open_set()
    wanted = XID | SBE | DBE | (1 << 40)  # bit 40 is no NVML event type
    assert es.register(GPU, wanted) == wanted & node.supported(GPU)
    assert es.register(GPU, XID) & XID


def test_register_none_supported_returns_zero(events, node, open_set):
    es = open_set()
    assert es.register(GPU, 1 << 40) == 0


def test_register_gpu_without_events_raises_not_supported(events, make_node, open_set):
    make_node(faults=f"events_unsupported={GPU}")
    es = open_set()
    with pytest.raises(NvmlError) as info:
        es.register(GPU, XID)
    assert info.value.is_not_supported
    assert es.register(GPU + 1, XID) == XID  # only that GPU


def test_register_unknown_gpu_raises(events, node, open_set):
    es = open_set()
    with pytest.raises(NvmlError) as info:
        es.register(63, XID)
    assert info.value.function == "nvmlDeviceGetHandleByIndex_v2"
    with pytest.raises(ValueError):
        es.register(-1, XID)
    with pytest.raises(ValueError):
        es.register(GPU, -1)
    with pytest.raises(ValueError):
        es.register(GPU, 1 << 64)


def test_lost_gpu_raises_from_wait(events, node, open_set):
    es = open_set()
    es.register(GPU, XID)
    node.sim("lose", "--gpu", str(GPU))
    with pytest.raises(NvmlError) as info:
        es.wait(WAIT_MS)
    assert info.value.is_gpu_lost
    assert info.value.function == "nvmlEventSetWait_v2"
    with pytest.raises(NvmlError) as info:
        es.register(GPU, XID)
    assert info.value.is_gpu_lost


def test_double_bit_ecc_is_delivered_and_single_bit_counted_not_returned(events, node, open_set):
    es = open_set()
    assert es.register(GPU, DBE | SBE) == DBE | SBE  # not XID: an XID must not come through
    node.inject_xid(GPU, 79)
    node.sim("ecc", "--gpu", str(GPU), "--single-bit")
    node.sim("ecc", "--gpu", str(GPU), "--double-bit")
    node.sim("ecc", "--gpu", str(GPU), "--single-bit")
    got = es.wait(WAIT_MS)
    assert (got.index, got.event_type, got.xid) == (GPU, DBE, 0)
    assert es.wait(300) is None, "the single-bit errors are counted, never returned"
    assert es.counters == {"ignored": 0, "sbe": 2, "delivered": 1}


def test_ignored_xids_are_dropped_in_the_filter_and_counted(events, node, open_set):
    es = open_set()
    es.register(GPU, XID)
    es.set_ignored_xids([13, 31, 1023])
    assert es.ignored_xids == (13, 31, 1023)
    for xid in (13, 31, 1023, 13, 79, 31):
        node.inject_xid(GPU, xid)
    event = es.wait(WAIT_MS)
    assert (event.index, event.xid) == (GPU, 79)  # the three before it never came back
    assert es.wait(300) is None
    assert es.counters == {"ignored": 5, "sbe": 0, "delivered": 1}


def test_event_naming_no_gpu_is_filtered_by_its_xid_too(events, node, open_set):
    es = open_set()
    es.register(GPU, XID)
    es.set_ignored_xids([43])
    node.inject_xid("none", 43)
    node.inject_xid("none", 48)
    event = es.wait(WAIT_MS)
    assert (event.index, event.uuid, event.xid) == (None, None, 48)
    assert es.counters["ignored"] == 1


def test_filter_is_replaced_not_merged_and_xids_beyond_it_always_come_back(events, node, open_set):
    es = open_set()
    es.register(GPU, XID)
    es.set_ignored_xids([13])
    es.set_ignored_xids([31])
    assert es.ignored_xids == (31,)
    node.inject_xid(GPU, 13)
    node.inject_xid(GPU, 5000)  # beyond the bitmap: the caller's policy decides
    assert [es.wait(WAIT_MS).xid for _ in range(2)] == [13, 5000]
    es.set_ignored_xids([])
    assert es.ignored_xids == ()


@pytest.mark.parametrize("bad, error", [
    ([1024], ValueError), ([-1], ValueError), (["13"], TypeError), (13, TypeError)])
def test_ignored_xids_outside_the_bitmap_are_refused(events, node, open_set, bad, error):
    es = open_set()
    es.set_ignored_xids([7])
    with pytest.raises(error):
        es.set_ignored_xids(bad)
    assert es.ignored_xids == (7,), "a refused set leaves the previous one"


def test_a_storm_of_ignored_xids_still_returns_within_the_timeout(events, node, open_set):
    """Ignored events keep arriving, yet wait() gives up at its timeout: the caller gets to
    check its stop flag. (No timing asserted: the wait must simply end, with None.)"""
    from agent.sim import control
    es = open_set()
    es.register(GPU, XID)
    es.set_ignored_xids([13])
    control.inject_xids(str(node.control), [(GPU, 13)] * 2000)
    assert es.wait(50) is None
    assert 0 < es.counters["ignored"] <= 2000
    while es.wait(200) is not None:
        pass
    assert es.counters == {"ignored": 2000, "sbe": 0, "delivered": 0}


def _until_waiting(es) -> None:
    """Return once another thread is inside es.wait() (it flags that, then blocks)."""
    for _ in range(10_000):
        if es.waiting:
            return
        time.sleep(0.001)
    raise AssertionError("the waiter thread never got into wait()")


def test_wait_releases_the_gil(events, node, open_set):
    """A thread blocked in wait() must leave this thread running: it counts loop iterations while
    the waiter is inside wait(), checks the waiter is still there, then an injected XID ends it.
    Were the GIL held, this thread could not run until the wait timed out (and returned None).
    """
    es = open_set()
    es.register(GPU, XID)
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("event", es.wait(WAIT_MS)))
    waiter.start()
    _until_waiting(es)
    iterations = 0
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        iterations += 1
    still_waiting = waiter.is_alive() and es.waiting
    node.inject_xid(GPU, 79)
    waiter.join(30)
    assert still_waiting, "the wait ended before this thread got to run"
    assert iterations > 10_000
    assert result["event"] is not None and (result["event"].index, result["event"].xid) == (GPU, 79)


def test_one_waiter_at_a_time_and_no_close_under_it(events, node, open_set):
    es = open_set()
    es.register(GPU, XID)
    waiter = threading.Thread(target=es.wait, args=(WAIT_MS,))
    waiter.start()
    _until_waiting(es)
    with pytest.raises(RuntimeError, match="stop the waiter first"):
        es.wait(10)
    with pytest.raises(RuntimeError, match="stop the waiter first"):
        es.close()
    node.inject_xid(GPU, 79)
    waiter.join(30)
    assert not es.waiting
    es.close()
    assert es.closed


def test_close_is_idempotent(events, node, open_set):
    es = open_set()
    es.register(GPU, XID)
    assert not es.closed
    es.close()
    es.close()
    assert es.closed
    with pytest.raises(ValueError, match="closed"):
        es.wait(10)
    with pytest.raises(ValueError, match="closed"):
        es.register(GPU, XID)


def test_context_manager_closes(events, node):
    with events.EventSet(node.path) as es:
        assert es.register(GPU, XID) == XID
        assert node.path in repr(es)
    assert es.closed


def test_each_set_holds_one_nvml_init(events, node):
    """close() shuts NVML down once: the process's own init (agent.nvml.library) survives."""
    first = events.EventSet(node.path)
    second = events.EventSet(node.path)
    first.close()
    first.close()
    second.close()
    assert pynvml.nvmlDeviceGetCount() == 8  # still initialised by the node fixture


def test_huge_timeout_is_capped_not_overflowed(events, node, open_set):
    es = open_set()
    es.register(GPU, XID)
    node.inject_xid(GPU, 79)
    assert es.wait(2**40).xid == 79
    with pytest.raises(ValueError):
        es.wait(-1)


def test_timeout_cap():
    assert _types.MAX_WAIT_MS == 5000
    assert _types.check_timeout(10**12) == 5000
    assert _types.check_timeout(1234) == 1234


def test_missing_library_is_a_clear_error(events, tmp_path):
    with pytest.raises(NvmlLibraryError, match="cannot open NVML library"):
        events.EventSet(str(tmp_path / "libnvidia-ml.so.1"))


def test_library_without_nvml_names_the_missing_symbol(events):
    libc = ctypes.util.find_library("c")
    assert libc
    with pytest.raises(NvmlLibraryError, match=r"lacks nvmlInit"):
        events.EventSet(libc)
