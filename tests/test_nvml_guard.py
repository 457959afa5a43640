"""NVML calls under a time budget (agent.nvml.guard): a GPU whose calls hang holds up no caller.

The guard's own behaviour is checked with calls the test holds (a threading.Event stands in for
a driver call that does not return); what the agent reads through it (discovery, the link
model, the MIG layout) is checked on the simulated NVML with a GPU hung by `gpu-agent sim
hang`. Nothing asserts on durations: a test waits for the event it needs (a listener told, a
call returned) with a long bound.
"""

from __future__ import annotations

import threading
import time

import pytest

from agent.errors import NvmlError, NvmlNotAnswering
from agent.nvml import discovery, mig
from agent.nvml.guard import GUARD, Guard
from agent.sim import control

WAIT = 30.0  # bound on what must happen soon


class Held:
    """A call that does not return until the test lets it go; counts its starts."""

    def __init__(self):
        self.started = 0
        self.release = threading.Event()

    def __call__(self, value=None):
        self.started += 1
        if not self.release.wait(WAIT):
            raise AssertionError("never released")
        return value


class Told:
    """A guard listener: each (gpu, what) it was told, and an event per GPU."""

    def __init__(self):
        self.calls: list[tuple] = []
        self._cond = threading.Condition()

    def __call__(self, gpu, what):
        with self._cond:
            self.calls.append((gpu, what))
            self._cond.notify_all()

    def wait(self, n: int = 1) -> list[tuple]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.calls) >= n, WAIT), self.calls
            return list(self.calls)


@pytest.fixture
def guard():
    g = Guard(budget_s=0.2)
    g.on_hung, g.on_answered = Told(), Told()
    return g


def test_a_call_past_its_budget_is_given_up_and_the_gpu_fails_fast_until_it_returns(guard):
    held = Held()
    with pytest.raises(NvmlNotAnswering, match="GPU 3") as info:
        guard.call(3, "the held call", held, "late")
    assert info.value.gpu == 3 and info.value.is_timeout  # an NvmlError with NVML's TIMEOUT
    assert guard.on_hung.wait() == [(3, "the held call")]
    assert list(guard.not_answering()) == [3]
    again = Held()
    with pytest.raises(NvmlNotAnswering, match="has not returned"):
        guard.call(3, "another call", again)
    assert again.started == 0  # failed at once: no thread was started for it
    assert guard.call(4, "another GPU", len, "abc") == 3
    held.release.set()
    assert guard.on_answered.wait() == [(3, "the held call")]
    assert guard.not_answering() == {}
    assert guard.call(3, "after", len, "ab") == 2
    assert guard.on_hung.calls == [(3, "the held call")]  # told once


def test_a_call_nobody_waits_for_is_noticed_when_its_budget_passes(guard):
    held = Held()
    future = guard.submit(5, "telemetry", held)
    assert not future.done()
    assert guard.on_hung.wait() == [(5, "telemetry")]  # the watcher noticed, no caller
    held.release.set()
    assert guard.on_answered.wait() == [(5, "telemetry")]
    assert future.result(WAIT) is None


def test_calls_handed_over_together_run_in_turn_on_one_worker(guard):
    outcomes = guard.run_each("telemetry", [(gpu, threading.current_thread, ()) for gpu in
                                            range(8)], timeout=WAIT)
    threads = {future.result(0) for future in outcomes}
    assert len(threads) == 1 and threading.current_thread() not in threads
    assert guard.not_answering() == {}


def test_calls_behind_one_that_hangs_are_run_on_other_workers(guard):
    """A scrape of 8 GPUs where GPU 2's call hangs: the other 7 answer while it hangs, GPU
    2's is left running and the GPU marked not answering at the NVML budget."""
    held = Held()
    calls = [(gpu, held if gpu == 2 else threading.current_thread, ()) for gpu in range(8)]
    outcomes = guard.run_each("telemetry", calls, timeout=0.1)  # waits less than the budget
    answered = [future.result(WAIT) for gpu, future in enumerate(outcomes) if gpu != 2]
    assert not outcomes[2].done()
    assert len(answered) == 7
    assert len(set(answered[:2])) == 1  # GPUs 0 and 1: before it, on the worker in turn
    assert answered[0] not in answered[2:]  # GPUs 3 to 7: not left behind it
    assert guard.on_hung.wait() == [(2, "telemetry")]
    held.release.set()
    assert guard.on_answered.wait() == [(2, "telemetry")]
    assert outcomes[2].result(WAIT) is None


def test_a_call_handed_over_on_a_gpu_not_answering_fails_without_being_made(guard):
    held = Held()
    with pytest.raises(NvmlNotAnswering):
        guard.call(4, "the held call", held)
    again = Held()
    outcomes = guard.run_each("telemetry", [(3, len, ("ab",)), (4, again, ())], timeout=WAIT)
    assert outcomes[0].result(0) == 2
    assert isinstance(outcomes[1].exception(0), NvmlNotAnswering) and again.started == 0
    held.release.set()
    assert guard.on_answered.wait() == [(4, "the held call")]


def test_a_call_that_returned_keeps_nothing_of_its_result():
    """A scrape every 10 ms once kept a budget's worth of readings alive (the watcher dropped
    returned calls only at the earliest deadline): RSS grew with the scrape rate."""
    import gc
    import weakref

    class Reading:
        pass

    guard = Guard(budget_s=60.0)  # no deadline passes during the test
    alive = []
    for _ in range(25):  # as scrapes read: eight GPUs at once
        batch = []
        for gpu in range(8):
            future = guard.submit(gpu, "telemetry", Reading)
            after_the_guard = threading.Event()  # callbacks run in the order they were added
            future.add_done_callback(lambda _, e=after_the_guard: e.set())
            batch.append((future, after_the_guard))
        for future, after_the_guard in batch:
            alive.append(weakref.ref(future.result(WAIT)))
            assert after_the_guard.wait(WAIT)
        del batch, future
    gc.collect()
    assert sum(ref() is not None for ref in alive) == 0


def test_a_returned_call_is_freed_without_the_cyclic_collector():
    """A guarded call once formed a cycle (the call holds its future, the future its done
    callback, the callback the call): each NVML call left garbage that only the collector's
    full passes, rare in an agent holding thousands of records, freed."""
    import gc
    import weakref

    guard = Guard(budget_s=60.0)
    was = gc.isenabled()
    gc.disable()
    try:
        futures_made = []
        for gpu in range(8):
            future = guard.submit(gpu, "read", lambda: 1)
            assert future.result(WAIT) == 1
            futures_made.append(weakref.ref(future))
        del future
        # the guard's own callback runs on the worker just after result() returns here
        deadline = time.monotonic() + WAIT
        while any(ref() is not None for ref in futures_made):
            assert time.monotonic() < deadline, "calls kept alive by a reference cycle"
            time.sleep(0.01)
    finally:
        if was:
            gc.enable()


def test_a_call_that_fails_in_time_raises_its_own_error_and_leaves_the_gpu_answering(guard):
    def fails():
        raise NvmlError(15, "nvmlDeviceGetName")  # GPU_IS_LOST

    with pytest.raises(NvmlError) as info:
        guard.call(1, "name", fails)
    assert info.value.is_gpu_lost and not isinstance(info.value, NvmlNotAnswering)
    assert guard.not_answering() == {} and guard.on_hung.calls == []


def test_a_budget_of_zero_waits_for_the_call_on_the_callers_thread(guard):
    guard.budget_s = 0
    assert guard.call(1, "here", threading.current_thread) is threading.current_thread()


# -- what the agent reads through the process's guard, on the simulated NVML ------------------


@pytest.fixture
def hung(node, sim_control):
    """hang(gpu): GPU `gpu` of the simulated node hangs; GUARD has a 0.3 s budget and a
    listener. The hang is ended and the late calls waited out after the test."""
    node("a100-mig")
    told = Told()
    saved = GUARD.budget_s, GUARD.on_hung, GUARD.on_answered
    GUARD.budget_s, GUARD.on_hung, GUARD.on_answered = 0.3, told, Told()
    gpus: list[int] = []

    def hang(gpu: int) -> Told:
        gpus.append(gpu)
        control.hang(sim_control, gpu, 600)
        return told

    yield hang
    for gpu in gpus:
        control.hang(sim_control, gpu, 0)
    answered = GUARD.on_answered
    if GUARD.not_answering():
        answered.wait(len(gpus))
    GUARD.budget_s, GUARD.on_hung, GUARD.on_answered = saved


def test_discovery_keeps_what_it_read_of_a_gpu_that_does_not_answer(hung):
    before = discovery.discover()
    told = hung(2)
    again = discovery.discover(known=before)
    assert again == before  # GPU 2's record as read before
    assert told.wait() == [(2, "GPU discovery")]
    assert [g.index for g in discovery.discover()] == [0, 1, 3, 4, 5, 6, 7]  # none known


def test_the_link_model_counts_a_gpu_that_does_not_answer_as_sys(hung):
    gpus = discovery.discover()
    full = discovery.read_links(gpus)
    hung(2)
    links = discovery.read_links(gpus)
    assert links[(2, 3)].level == discovery.LEVEL_SYSTEM
    assert {k: v for k, v in links.items() if 2 not in k} == \
        {k: v for k, v in full.items() if 2 not in k}


def test_a_mig_gpu_that_does_not_answer_keeps_its_layout_and_devices(hung):
    gpus = discovery.discover()
    devices, shape = mig.read_mig_devices(gpus), mig.layout(gpus)
    on_zero = [d for d in devices if d.parent.index == 0]
    assert on_zero  # a100-mig: GPU 0 has MIG devices
    hung(0)
    assert mig.layout(gpus, known=shape) == shape
    assert mig.read_mig_devices(gpus) == devices
