"""agent.health.monitor in this process, on the simulated NVML, with the compiled event set and
its pure-Python twin: fan-out to replicas and MIG instances (a100-mig profile; MIG devices are
built from the profile since MIG resources are advertised by a later issue), events naming no
GPU, each DP_DISABLE/ENABLE_HEALTHCHECKS form, NOT_SUPPORTED registration, a lost GPU found by
probing and the event set re-established, reset-class recovery, recovery probes that run outside
the monitor's lock (a probe held in flight stalls nothing, and its result is dropped when a
fault came meanwhile), and stop() within one wait.

The sink is a plain recorder of the batches the monitor hands out (what the daemon passes on to
the resource managers); every wait on it is bounded.
"""

from __future__ import annotations

import json
import threading

import pytest

from agent.health.monitor import HealthMonitor
from agent.health.policy import XidPolicy
from agent.nvml import discovery, probe
from agent.rm.devices import Device, full_gpu_devices
from agent.sim import control, lib_path
from agent.sim.profile import load_profile

WAIT = 20.0


@pytest.fixture
def events(fast_impl):
    """The event-set module the monitor runs on: compiled, then the twin (conftest)."""
    return fast_impl.events


class Recorder:
    """The sink: keeps every batch and the latest (healthy, reason) of each device."""

    def __init__(self):
        self.batches: list[dict] = []
        self.state: dict[str, tuple[bool, str]] = {}
        self._cond = threading.Condition()

    def __call__(self, changes):
        with self._cond:
            self.batches.append(dict(changes))
            self.state.update(changes)
            self._cond.notify_all()

    def unhealthy(self) -> set[str]:
        with self._cond:
            return {i for i, (ok, _) in self.state.items() if not ok}

    def wait(self, predicate, what: str):
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self), WAIT):
                raise AssertionError(f"no {what} within {WAIT:g} s; batches: {self.batches}")


@pytest.fixture
def monitor(node, sim_control, tmp_path, events):
    """monitor(profile="dgx1-v100", devices=None, faults=None, **kw) -> (HealthMonitor, sink)."""
    made = []

    def make(profile="dgx1-v100", devices=None, faults=None, **kw):
        node(profile, faults=faults)
        gpus = discovery.discover()
        sink = Recorder()
        kw.setdefault("policy", XidPolicy.build())
        kw.setdefault("quiet_period_s", 60.0)
        m = HealthMonitor(library_path=str(lib_path()), gpus=gpus,
                          devices=devices if devices is not None else full_gpu_devices(gpus),
                          sink=sink, state_dir=str(tmp_path), events_module=events, **kw)
        m.start()
        made.append(m)
        return m, sink

    make.ctl = str(sim_control)
    yield make
    for m in made:
        m.stop()


def inject(ctl, gpu, xid, **kw):
    control.inject_xid(ctl, gpu, xid, **kw)


def uuids(profile="dgx1-v100"):
    return [g["uuid"] for g in load_profile(profile)["gpus"]]


# -- fan-out ---------------------------------------------------------------------------------


def test_xid_79_withdraws_that_gpu_and_ignored_xids_change_nothing(monitor):
    m, sink = monitor()
    u = uuids()
    inject(monitor.ctl, 3, 13)
    inject(monitor.ctl, 3, 43)
    inject(monitor.ctl, 3, 79)
    sink.wait(lambda s: s.batches, "a batch")
    assert sink.batches[0] == {u[3]: (False, "XID 79 (GPU has fallen off the bus): node "
                                              "reboot required")}
    assert m.counters["ignored"] == 2 and m.counters["delivered"] == 1
    assert m.status()["unhealthy"][0]["action"] == "reboot"


def test_every_replica_of_a_gpu_is_withdrawn_in_one_batch(monitor):
    """Shared replicas (a later issue) are devices with the same GPU: all go, in one batch."""
    profile = load_profile("dgx1-v100")
    devs = []
    for g in profile["gpus"][:4]:
        for r in range(3):
            devs.append(Device(id=f"{g['uuid']}::{r}", index=f"{g['index']}", gpu_uuid=g["uuid"],
                               gpu_index=g["index"], numa_node=None, paths=()))
    m, sink = monitor(devices=devs)
    inject(monitor.ctl, 2, 48)
    sink.wait(lambda s: s.batches, "a batch")
    u2 = profile["gpus"][2]["uuid"]
    assert set(sink.batches[0]) == {f"{u2}::0", f"{u2}::1", f"{u2}::2"}


def test_event_naming_no_gpu_withdraws_every_device(monitor):
    m, sink = monitor()
    inject(monitor.ctl, None, 48)
    sink.wait(lambda s: s.batches, "a batch")
    assert set(sink.batches[0]) == set(uuids()) and len(sink.batches) == 1
    assert all("names no GPU" in reason for _, reason in sink.batches[0].values())


def mig_devices():
    out = []
    for g in load_profile("a100-mig")["gpus"]:
        for n, inst in enumerate(g.get("mig", {}).get("instances", [])):
            out.append(Device(id=inst["uuid"], index=f"{g['index']}:{n}", gpu_uuid=g["uuid"],
                              gpu_index=g["index"], numa_node=None, paths=(),
                              gi=inst["gi"], ci=inst["ci"]))
    return out


def test_mig_instance_event_withdraws_only_that_instance(monitor):
    devs = mig_devices()
    m, sink = monitor("a100-mig", devices=devs)
    gpu0 = [d for d in devs if d.gpu_index == 0]
    gpu1 = [d for d in devs if d.gpu_index == 1]
    # an event naming one instance (the simulator gives its GI/CI): that instance only
    inject(monitor.ctl, gpu0[2].id, 48)
    sink.wait(lambda s: s.batches, "a batch")
    assert set(sink.batches[-1]) == {gpu0[2].id}
    # GI given, CI not: the instances of that GPU instance
    inject(monitor.ctl, 1, 48, gi=gpu1[1].gi)
    sink.wait(lambda s: len(s.batches) == 2, "a second batch")
    assert set(sink.batches[-1]) == {gpu1[1].id}
    # no instance named: every instance of the GPU, none of another GPU's
    inject(monitor.ctl, 1, 48)
    sink.wait(lambda s: len(s.batches) == 3, "a third batch")
    assert set(sink.batches[-1]) == {d.id for d in gpu1} - {gpu1[1].id}
    assert sink.unhealthy() == {gpu0[2].id} | {d.id for d in gpu1}


# -- DP_DISABLE_HEALTHCHECKS / DP_ENABLE_HEALTHCHECKS ------------------------------------------


@pytest.mark.parametrize("disable, enable, xid, withdrawn", [
    ("", "", 13, False),
    ("", "", 48, True),
    ("48", "", 48, False),
    ("48,63", "", 63, False),
    ("", "13", 13, True),
    ("", "all", 31, True),
    ("11", "11", 11, True),
    ("all", "all", 109, True),
], ids=["default-13", "default-48", "disable-48", "disable-list", "enable-13", "enable-all",
        "enable-beats-disable", "disable-all-enable-all"])
def test_each_healthcheck_form(monitor, disable, enable, xid, withdrawn):
    m, sink = monitor(policy=XidPolicy.build(disable, enable))
    u = uuids()
    inject(monitor.ctl, 1, xid)
    inject(monitor.ctl, 6, 79)  # a marker: withdrawn in every form here
    sink.wait(lambda s: u[6] in s.unhealthy(), "the marker")
    assert (u[1] in sink.unhealthy()) is withdrawn
    assert m.counters["ignored"] == (0 if withdrawn else 1)


@pytest.mark.parametrize("disable", ["all", "xids", "all,48"])
def test_healthchecks_disabled_runs_no_event_loop(monitor, disable):
    m, sink = monitor(policy=XidPolicy.build(disable, "48"))
    assert not m.status()["enabled"] and m.status()["eventSet"] == "closed"
    inject(monitor.ctl, 1, 48)
    inject(monitor.ctl, None, 79)
    assert m._thread is None and sink.batches == []


# -- NOT_SUPPORTED, lost GPUs, recovery ------------------------------------------------------


def test_gpu_without_events_stays_healthy_with_one_warning(monitor, caplog):
    m, sink = monitor(faults="events_unsupported=3")
    u = uuids()
    inject(monitor.ctl, 4, 48)
    sink.wait(lambda s: s.batches, "a batch")
    assert sink.unhealthy() == {u[4]}
    assert caplog.text.count(f"GPU 3 {u[3]}: NVML events not supported") == 1
    assert 3 in m.status()["unsupported"]


def test_lost_gpu_is_found_by_probing_then_recovers_and_is_watched_again(monitor):
    m, sink = monitor(quiet_period_s=0.5)
    u = uuids()
    control.lose(monitor.ctl, 2)
    sink.wait(lambda s: u[2] in s.unhealthy(), "GPU 2 withdrawn")
    assert sink.unhealthy() == {u[2]}, "only the lost GPU"
    assert "GPU is lost" in sink.state[u[2]][1]
    control.restore(monitor.ctl, 2)
    sink.wait(lambda s: not s.unhealthy(), "GPU 2 back")
    assert m.status()["counters"]["reestablished"] == 1
    inject(monitor.ctl, 2, 48)  # registered on the re-established set
    sink.wait(lambda s: u[2] in s.unhealthy(), "GPU 2 withdrawn by an XID")


def test_reset_class_recovers_after_the_quiet_period_and_a_new_event_restarts_it(monitor):
    m, sink = monitor(quiet_period_s=0.5)
    u = uuids()
    inject(monitor.ctl, 5, 48)
    sink.wait(lambda s: u[5] in s.unhealthy(), "GPU 5 withdrawn")
    sink.wait(lambda s: not s.unhealthy(), "GPU 5 back")
    assert [b[u[5]][0] for b in sink.batches] == [False, True]
    transitions = m.status()["transitions"]
    assert [t["healthy"] for t in transitions] == [False, True]
    assert "reset-class fault cleared" in transitions[-1]["reason"]


def test_reboot_class_does_not_recover_while_running(monitor):
    m, sink = monitor(quiet_period_s=0.0)
    u = uuids()
    inject(monitor.ctl, 0, 79)
    sink.wait(lambda s: u[0] in s.unhealthy(), "GPU 0 withdrawn")
    inject(monitor.ctl, 1, 48)  # reset-class with no quiet period: back at the next check
    sink.wait(lambda s: any(b.get(u[1]) and b[u[1]][0] for b in s.batches), "GPU 1 back")
    assert sink.unhealthy() == {u[0]}


def test_stop_returns_within_one_wait(monitor, events):
    m, _ = monitor()
    assert m._thread.is_alive()
    m.stop()
    assert m._thread is None and m.status()["eventSet"] == "closed"


# -- recovery probes run outside the lock ------------------------------------------------------


class HeldProbe:
    """The recovery probe handed to the monitor: agent.nvml.probe.recovery_probe (the monitor's
    own) on the simulated NVML, except that each probe of GPU `uuid` is held (at most WAIT s)
    until the test lets it go, as a probe of a sick GPU hangs in NVML. Leaving the `with`
    block lets every probe go."""

    def __init__(self, uuid: str):
        self.uuid = uuid
        self.calls = 0  # probes of the GPU begun
        self.released = 0  # probes of the GPU let go
        self._cond = threading.Condition()

    def __call__(self, uuid, pci_bus_id=None):
        if uuid == self.uuid:
            with self._cond:
                self.calls += 1
                n = self.calls
                self._cond.notify_all()
                self._cond.wait_for(lambda: self.released >= n, WAIT)
        return probe.recovery_probe(uuid, pci_bus_id)

    def wait_call(self, n: int, sink: Recorder | None = None) -> None:
        """Until probe number `n` of the GPU is in flight (a failure shows `sink`'s batches)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.calls >= n, WAIT):
                raise AssertionError(f"no probe {n} of {self.uuid} within {WAIT:g} s; batches: "
                                     f"{sink.batches if sink else '?'}")

    def release(self, n: int) -> None:
        """Let probes 1..n of the GPU go."""
        with self._cond:
            self.released = max(self.released, n)
            self._cond.notify_all()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release(2**31)


def returns_promptly(fn, what: str):
    """fn() run on another thread; fails unless it returns within WAIT s."""
    done, out = threading.Event(), []

    def run():
        out.append(fn())
        done.set()

    threading.Thread(target=run, name="test-caller", daemon=True).start()
    assert done.wait(WAIT), f"{what} did not return within {WAIT:g} s: it waits for the probe"
    return out[0]


def test_a_hanging_recovery_probe_holds_up_neither_status_nor_isolation_nor_events(
        monitor, tmp_path):
    u = uuids()
    isolation = tmp_path / "unhealthy-devices.json"
    with HeldProbe(u[5]) as held:
        m, sink = monitor(quiet_period_s=0.2, isolation_file=str(isolation),
                          recovery_probe=held)
        inject(monitor.ctl, 5, 48)
        sink.wait(lambda s: u[5] in s.unhealthy(), "GPU 5 withdrawn")
        held.wait_call(1)  # GPU 5 is quiet: its recovery probe begins, and hangs
        doc = returns_promptly(m.status, "status()")
        assert [d["id"] for d in doc["unhealthy"]] == [u[5]]
        isolation.write_text(json.dumps({"index": [1]}))
        sink.wait(lambda s: u[1] in s.unhealthy(), "GPU 1 isolated by the file")
        inject(monitor.ctl, 2, 79)
        sink.wait(lambda s: u[2] in s.unhealthy(), "GPU 2 withdrawn by an XID")
        assert held.calls == 1 and held.released == 0, "all that while the probe hung"
        assert sink.unhealthy() == {u[1], u[2], u[5]}
        held.release(1)
        sink.wait(lambda s: u[5] not in s.unhealthy(), "GPU 5 back once its probe passed")
        assert sink.unhealthy() == {u[1], u[2]}


def test_a_fault_raised_while_a_probe_runs_is_not_cleared_by_that_probe(monitor):
    """Two MIG instances of one GPU: B's fault comes while the probe that A's quiet period
    started is in flight; that probe passes, but began before B's fault, so it clears nothing
    (not B, nor A on its own); the next probe, after B's quiet period, returns both at once."""
    devs = mig_devices()
    a, b = [d for d in devs if d.gpu_index == 0][:2]
    with HeldProbe(a.gpu_uuid) as held:
        m, sink = monitor("a100-mig", devices=devs, quiet_period_s=0.3, recovery_probe=held)
        inject(monitor.ctl, a.id, 48)
        sink.wait(lambda s: s.unhealthy() == {a.id}, "instance A withdrawn")
        held.wait_call(1)  # A is quiet: GPU 0's probe begins, and is held
        inject(monitor.ctl, b.id, 48)
        sink.wait(lambda s: s.unhealthy() == {a.id, b.id}, "instance B withdrawn meanwhile")
        held.release(1)  # it passes, too late
        held.wait_call(2, sink)  # the next check began, so the first one's result was handled
        assert sink.unhealthy() == {a.id, b.id}
        assert all(not ok for batch in sink.batches for ok, _ in batch.values()), sink.batches
        held.release(2)
        sink.wait(lambda s: not s.unhealthy(), "A and B back")
        assert sink.batches[-1] == {a.id: (True, ""), b.id: (True, "")}
        assert "reset-class fault cleared" in m.status()["transitions"][-1]["reason"]
