"""NVML calls under a time budget: a GPU whose driver calls hang holds up no caller.

Owns: `Guard` and the process's one instance `GUARD` (NVML is one library per process): every
NVML call the agent makes on a GPU outside the event wait runs on a worker thread; the caller
waits at most the budget (`agent.nvmlCallTimeout`) and then gets NvmlNotAnswering while the
call goes on without it. A GPU with a call past its budget is *not answering*: `on_hung` is
told once (the running health monitor withdraws the GPU), further calls on it fail at once
without starting a thread, and when its last late call returns it answers again
(`on_answered`, agent.nvml.session: one discovery left out is looked for again; the health
monitor's recovery probe finds the others back). A watcher thread notices a call that nobody
waits for (a scrape that gave up on it) reaching its budget; it sleeps while no call is in
flight, so an idle agent stays idle. A thread that must keep doing
something while it waits (the daemon's main loop pings the systemd watchdog) registers it as
`while_waiting`: its calls wait in WAIT_SLICE_S slices and run it between. A caller with
many GPUs to read (a scrape) hands them over together (`run_each`): one worker reads them in
turn, and those whose turn has not come after ALONE_AFTER_S are handed out one by one. Also
`Workers`, the daemon threads the calls run on (not a ThreadPoolExecutor: its threads are
joined at interpreter exit, so a hung call would hold up the agent's stop).

Must not know what a call does or decide what a hang means for the GPU's devices (the health
monitor does), nor hold its lock while calling back or calling NVML.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
import weakref
from collections.abc import Hashable
from concurrent import futures
from typing import Any, Callable

from agent.constants import DEFAULT_NVML_CALL_TIMEOUT_S
from agent.errors import NvmlNotAnswering

log = logging.getLogger(__name__)

# (GPU key, what did not answer) -> None; called from the thread that noticed, no lock held.
Listener = Callable[[Hashable, str], None]
# How often a `while_waiting` thread's hook runs while its call is in flight.
WAIT_SLICE_S = 0.25
# How long `run_each`'s calls wait for their turn on the one worker before they are handed
# out one by one, as `submit` hands out a call.
# Eight simulated GPUs are read in 1-2 ms; this leaves a real GPU's slow queries room and a
# hung GPU's calls behind it hold up a scrape this long, not its budget.
ALONE_AFTER_S = 0.05


class Workers:
    """Daemon threads made as calls need them and then kept idle (one per call in flight)."""

    def __init__(self, name: str):
        self.name = name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0

    def submit(self, fn: Any, *args: Any) -> futures.Future:
        future: futures.Future = futures.Future()
        self._tasks.put((future, fn, args))
        with self._lock:
            if self._idle:
                self._idle -= 1
                return future
            self._threads += 1
            name = f"{self.name}-{self._threads}"
        threading.Thread(target=self._work, name=name, daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._tasks.get()
            _fulfil(future, fn, args)
            del future, fn, args  # an idle worker keeps no result alive
            with self._lock:
                self._idle += 1


def _fulfil(future: futures.Future, fn: Callable[..., Any], args: tuple) -> None:
    """fn(*args)'s result or exception into `future`, unless it was cancelled."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - the caller reads it from the future
            future.set_exception(exc)


class _Turn:
    """One of `run_each`'s calls: taken once, by the worker in turn or by a worker of its own."""
    __slots__ = ("gpu", "fn", "args", "future", "taken")

    def __init__(self, gpu: Hashable, fn: Callable[..., Any], args: tuple):
        self.gpu, self.fn, self.args = gpu, fn, args
        self.future: futures.Future = futures.Future()
        self.taken = False


class _Call:
    __slots__ = ("gpu", "what", "started", "deadline", "future", "late", "done", "__weakref__")

    def __init__(self, gpu: Hashable, what: str, started: float, deadline: float,
                 future: futures.Future):
        self.gpu, self.what, self.started, self.deadline = gpu, what, started, deadline
        self.future = future
        self.late = False  # past its budget while still running
        self.done = False

    def __lt__(self, other: _Call) -> bool:
        return self.deadline < other.deadline


class Guard:
    """NVML calls per GPU (`gpu`: its index, or its UUID where no index is known) under a
    budget of `budget_s` seconds."""

    def __init__(self, budget_s: float = DEFAULT_NVML_CALL_TIMEOUT_S):
        self.budget_s = budget_s
        self.on_hung: Listener | None = None
        self.on_answered: Listener | None = None
        # (thread ident, hook): calls from that thread run hook() every WAIT_SLICE_S they wait
        self.while_waiting: tuple[int, Callable[[], None]] | None = None
        self._workers = Workers("nvml-call")
        self._cond = threading.Condition(threading.Lock())
        self._late: dict[Hashable, list[_Call]] = {}  # GPU -> its calls past their budget
        self._deadlines: list[_Call] = []  # heap of the calls in flight
        self._watcher: threading.Thread | None = None

    def call(self, gpu: Hashable, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on a worker; its result or exception, or NvmlNotAnswering after the
        budget (or at once while the GPU has a call past its budget). A budget of 0: fn(*args)
        here, waited for however long it takes."""
        if self.budget_s <= 0:
            return fn(*args)
        c = self._start(gpu, what, fn, args)
        hook = self.while_waiting
        hook = hook[1] if hook is not None and hook[0] == threading.get_ident() else None
        while True:
            left = c.deadline - time.monotonic()
            try:
                if left > 0:
                    return c.future.result(timeout=min(left, WAIT_SLICE_S) if hook else left)
            except futures.TimeoutError:
                if hook is not None:
                    hook()
                continue
            self._overdue(c)
            raise NvmlNotAnswering(gpu, what, self.budget_s)

    def submit(self, gpu: Hashable, what: str, fn: Callable[..., Any],
               *args: Any) -> futures.Future:
        """fn(*args) on a worker, for a caller that waits less than the budget (a scrape):
        the watcher marks the GPU not answering if the call outlives the budget. Raises
        NvmlNotAnswering at once while the GPU has a call past its budget."""
        return self._start(gpu, what, fn, args).future

    def run_each(self, what: str, calls: list[tuple[Hashable, Callable[..., Any], tuple]],
                 timeout: float) -> list[futures.Future]:
        """fn(*args) for each (gpu, fn, args), waited for at most `timeout` seconds: their
        futures, in order, done or not. One worker runs them in turn (a scrape of 8 GPUs on 8
        workers spent half its CPU waking them: bench/bench_metrics.py); those whose turn has
        not come after ALONE_AFTER_S are handed out one by one, as `submit` hands out one.
        Each call is under the budget from when it starts; one on a GPU with a call past its
        budget fails with NvmlNotAnswering without being made."""
        turns = [_Turn(gpu, fn, args) for gpu, fn, args in calls]
        outcomes = [t.future for t in turns]
        if not turns:
            return outcomes
        deadline = time.monotonic() + timeout
        self._workers.submit(self._in_turn, what, turns)
        _, pending = futures.wait(outcomes, timeout=min(timeout, ALONE_AFTER_S))
        if pending:
            for t in turns:
                if self._take(t):
                    self._workers.submit(self._run, what, t)
            futures.wait(outcomes, timeout=max(0.0, deadline - time.monotonic()))
        return outcomes

    def not_answering(self) -> dict[Hashable, tuple[str, float]]:
        """GPU -> (what has not returned, since when: time.monotonic()), for every GPU with
        a call past its budget."""
        with self._cond:
            return {gpu: (calls[0].what, calls[0].started) for gpu, calls in self._late.items()}

    # -- inside --------------------------------------------------------------------------------

    def _refusal(self, gpu: Hashable, what: str, now: float) -> NvmlNotAnswering | None:
        """The error a call on `gpu` fails with at once while it has a call past its budget."""
        with self._cond:
            late = self._late.get(gpu)
            started = late[0].started if late else None
        if started is None:
            return None
        return NvmlNotAnswering(gpu, what, self.budget_s, now - started)

    def _start(self, gpu: Hashable, what: str, fn: Callable[..., Any], args: tuple) -> _Call:
        now = time.monotonic()
        refusal = self._refusal(gpu, what, now)
        if refusal is not None:
            raise refusal
        c = _Call(gpu, what, now, now + self.budget_s, self._workers.submit(fn, *args))
        self._track(c)
        return c

    def _track(self, c: _Call) -> None:
        """Watch `c` for its deadline until its future is done."""
        if self.budget_s <= 0:  # no budget: nothing to watch
            return
        with self._cond:
            heapq.heappush(self._deadlines, c)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="nvml-guard",
                                                 daemon=True)
                self._watcher.start()
            elif len(self._deadlines) == 1:  # the watcher sleeps for want of calls
                self._cond.notify()
        # the callback holds the call weakly: the call holds the future, which holds its
        # callbacks, and a cycle per call would wait for the collector's full passes
        call = weakref.ref(c)
        c.future.add_done_callback(lambda _: self._done_ref(call))

    def _done_ref(self, call: weakref.ref) -> None:
        c = call()
        if c is not None:  # else no heap or list holds it: nothing to take out
            self._done(c)

    def _take(self, t: _Turn) -> bool:
        with self._cond:
            if t.taken:
                return False
            t.taken = True
            return True

    def _in_turn(self, what: str, turns: list[_Turn]) -> None:
        for t in turns:
            if self._take(t):
                self._run(what, t)

    def _run(self, what: str, t: _Turn) -> None:
        """`t` on this worker, tracked as `_start` tracks a call; the outcome in its future."""
        now = time.monotonic()
        refusal = self._refusal(t.gpu, what, now)
        if refusal is not None:  # the future's waiters told with no lock of ours held
            t.future.set_exception(refusal)
            return
        c = _Call(t.gpu, what, now, now + self.budget_s, t.future)
        self._track(c)
        _fulfil(c.future, t.fn, t.args)
        del c, t  # an idle worker keeps no result alive

    def _done(self, c: _Call) -> None:
        with self._cond:
            c.done = True
            # Returned calls leave the heap from its top now, not when the watcher next wakes
            # (the earliest deadline): each holds its result, and a scrape every 10 ms kept a
            # budget's worth of them (500 readings a second), RSS growing with them.
            while self._deadlines and self._deadlines[0].done:
                heapq.heappop(self._deadlines)
            calls = self._late.get(c.gpu, [])
            if c not in calls:
                return
            calls.remove(c)
            if calls:
                return
            del self._late[c.gpu]
        log.info("GPU %s answers NVML again: %s returned after %.1f s", c.gpu, c.what,
                 time.monotonic() - c.started)
        if self.on_answered is not None:
            self.on_answered(c.gpu, c.what)

    def _overdue(self, c: _Call) -> None:
        """Mark `c` late (its caller gave up, or the watcher saw its deadline pass); tell
        on_hung when it is the GPU's first late call."""
        with self._cond:
            if c.late or c.done:
                return
            c.late = True
            calls = self._late.setdefault(c.gpu, [])
            calls.append(c)
            first = len(calls) == 1
        if first:
            log.warning("GPU %s: NVML not answering: %s did not return within %g s; calls on "
                        "this GPU fail at once until it does", c.gpu, c.what, self.budget_s)
            if self.on_hung is not None:
                self.on_hung(c.gpu, c.what)

    def _watch(self) -> None:
        """Sleeps while no call is in flight; else until the earliest deadline."""
        while True:
            with self._cond:
                now = time.monotonic()
                due = []
                while self._deadlines and (self._deadlines[0].done or
                                           self._deadlines[0].deadline <= now):
                    c = heapq.heappop(self._deadlines)
                    if not c.done:
                        due.append(c)
                if not due:
                    self._cond.wait(self._deadlines[0].deadline - now if self._deadlines
                                    else None)
                    continue
            for c in due:
                self._overdue(c)


GUARD = Guard()
