"""An idle agent sleeps: while nothing changes, no thread of `gpu-agent run` wakes on a timer.

Measured as an operator would see it: `gpu-agent run` on the simulated dgx1-v100 node (8 GPUs)
with the metrics endpoint on and nobody scraping it, each thread's voluntary context switches
(/proc/PID/task/TID/status, every thread named by agent.threadnames) counted over WINDOW_S once
the start has settled. A thread asleep on a descriptor or a lock does not switch at all; one
woken by something rarer than every 30 s (a reconciliation every 60 s, the ListAndWatch
stream's 60 s safety net) may fall in the window once, which costs at most MAX_SWITCHES (the
wake-up, and a wait for the GIL). A thread on a timer of 5 s or less switches at least three
times. A count of wake-ups is a behaviour, not a timing: nothing here depends on how fast the
machine is.

Not held to it (EXEMPT): gRPC's own threads, and the one of the agent that still wakes every
second (health-events), named with why. Also: the pieces that made the threads sleep
(agent.dirwatch's kinds and MissingDir, the isolation file's directory waited for, the MIG check skipped on a
node without a MIG-capable GPU).
"""

from __future__ import annotations

import select
import threading
import time
from types import SimpleNamespace

from agent import threadnames
from agent.dirwatch import CREATED, MOVED_IN, DirWatch, MissingDir
from agent.health.isolation import IsolationWatch
from agent.rm.migwatch import MigWatch
from tests.daemon_harness import WAIT, Node, thread_switches

WINDOW_S = 15.0
SETTLE_S = 3.0  # after the first reconciliation: the start's last work (journal, services) done
MAX_SWITCHES = 2
# thread name (as /proc shows it) -> why it may wake more often than every 30 s
EXEMPT = {
    "_serve": "gRPC's server thread polls its completion queue every 200 ms (grpc/_cython "
              "completion_queue.pyx.pxi, _INTERRUPT_CHECK_PERIOD_MS), in every gRPC Python server",
    "grpc_global_tim": "gRPC's timer thread (about once a second)",
    "event_engine": "gRPC's event engine thread pool (about once a second each)",
    "lifeguard": "gRPC's event engine pool watcher (once a second)",
    "health-events": "NVML's event wait cannot be woken, so its timeout (agent/health/monitor.py "
                     "WAIT_MS, 1 s) is also how long stop() and re-registering a recovered GPU "
                     "take",
}


def _table(before: dict, after: dict) -> str:
    return "\n".join(f"  {name:16} {count - before.get(tid, (name, 0))[1]:5d}"
                     f"{'  (exempt)' if name in EXEMPT else ''}"
                     for tid, (name, count) in sorted(after.items()))


def test_no_thread_of_an_idle_agent_wakes_on_a_timer():
    with Node() as node:  # dgx1-v100; the metrics endpoint on (the harness's default)
        agent = node.agent()
        agent.wait_registered()
        node.status_when(lambda d: d["phase"] == "running" and (d.get("metrics") or {}).get(
            "listening") and d["state"]["podResources"]["reconciles"] >= 1, "settled")
        time.sleep(SETTLE_S)
        before = thread_switches(agent.pid)
        time.sleep(WINDOW_S)
        after = thread_switches(agent.pid)
        assert agent.alive(), agent.log
    unnamed = sorted(name for tid, (name, _) in after.items()
                     if tid != agent.pid and name in ("python", "python3"))
    assert not unnamed, f"threads without a name of their own:\n{_table(before, after)}"
    awake = {name: count - before.get(tid, (name, 0))[1]
             for tid, (name, count) in after.items() if name not in EXEMPT}
    assert all(n <= MAX_SWITCHES for n in awake.values()), (
        f"voluntary context switches per thread in {WINDOW_S:g} s of an idle agent (at most "
        f"{MAX_SWITCHES} but for the exempt):\n{_table(before, after)}")
    assert {"registrar", "health-isolatio", "health-recovery", "dev-char", "metrics-http",
            "kube-faults", "reconcile"} <= set(awake), _table(before, after)


# -- the pieces ---------------------------------------------------------------------------------


def _readable(fd: int) -> bool:
    """Whether `fd` has something to read now (inotify queues events within the syscall)."""
    return bool(select.select([fd], [], [], 0)[0])


def test_a_watch_for_new_names_is_not_woken_by_writes(tmp_path):
    existing = tmp_path / "null"
    existing.write_bytes(b"")
    watch = DirWatch(str(tmp_path), frozenset((CREATED, MOVED_IN)))
    try:
        with open(existing, "wb") as f:  # as every write to /dev/null does in /dev
            f.write(b"x")
        assert not _readable(watch.fileno())
        (tmp_path / "nvidia0").write_bytes(b"")
        assert _readable(watch.fileno())
        assert [(e.kind, e.name) for e in watch.read()] == [(CREATED, "nvidia0")]
    finally:
        watch.close()


def test_a_missing_directory_is_waited_for_level_by_level(tmp_path):
    path = tmp_path / "a" / "b"
    missing = MissingDir(str(path))
    try:
        assert not _readable(missing.fileno())
        (tmp_path / "a").mkdir()
        assert _readable(missing.fileno()) and not missing.appeared()
        assert not _readable(missing.fileno())  # read, and now watching a/
        path.mkdir()
        assert _readable(missing.fileno()) and missing.appeared()
    finally:
        missing.close()


def _switches(thread: threading.Thread) -> int:
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        return int(f.read().split("\nvoluntary_ctxt_switches:")[1].split()[0])


def _asleep(thread: threading.Thread) -> int:
    """The switches of `thread` once it has started and gone to sleep (none for 0.2 s)."""
    deadline = time.monotonic() + WAIT
    count = _switches(thread)
    while True:
        time.sleep(0.2)
        now = _switches(thread)
        if now == count or time.monotonic() > deadline:
            return now
        count = now


def test_the_isolation_watch_sleeps_until_its_directory_appears(tmp_path):
    path = tmp_path / "etc" / "nvidia-device-plugin" / "unhealthyDevices.json"
    seen: list = []
    changed = threading.Event()

    def on_change(isolation, error):
        seen.append((isolation, error))
        changed.set()

    watch = IsolationWatch(str(path), on_change)
    watch.start()
    watch.watch()
    try:
        assert seen == [((frozenset(), frozenset()), None)]  # nothing isolated meanwhile
        before = _asleep(watch._thread)
        time.sleep(2.5)  # the directory used to be looked for every 2 s
        assert _switches(watch._thread) == before
        changed.clear()
        path.parent.mkdir(parents=True)
        path.write_text('{"index": [3]}')
        assert changed.wait(WAIT)
        deadline = time.monotonic() + WAIT
        while seen[-1][0] is None or seen[-1][0].indexes != frozenset({"3"}):
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
    finally:
        watch.stop()


def _gpu(mig_pending):
    return SimpleNamespace(index=0, uuid="GPU-0", mig_pending=mig_pending)


def test_the_mig_check_sleeps_on_a_node_without_a_mig_capable_gpu():
    cfg = SimpleNamespace(mig_strategy="mixed", mig_check_interval=5.0)
    watch = MigWatch()
    watch.reset(cfg, [_gpu(None), _gpu(None)], now=100.0)  # (V100s: MIG not supported)
    assert watch.due is None and not watch.changed([_gpu(None)], now=1e9)


def test_threads_are_named_in_the_kernel():
    assert threadnames.kernel_name("Thread-3 (_serve)") == "_serve"
    assert threadnames.kernel_name("Thread-3", "_serve") == "_serve"  # Python 3.9's name
    assert threadnames.kernel_name("Thread-3") == "Thread-3"
    assert threadnames.kernel_name("health-isolation") == "health-isolatio"
    assert threadnames.kernel_name("plugin_0") == "plugin_0"
