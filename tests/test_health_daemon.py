"""Health end to end: `gpu-agent run` as a subprocess on the simulated NVML and the simulated
kubelet, with the compiled event loop and with its pure-Python twin (GPU_AGENT_PURE_PYTHON=1;
the tests that take conftest's `fast_impl`: all but the isolation file's, which no NVML event
drives). Each agent's log must name the implementation it runs. What kubelet sees is read
from the snapshots the simulated kubelet received over ListAndWatch.

Covers XID 79 → that GPU Unhealthy in the next snapshot and an ignored XID changing nothing,
`gpu-agent status` showing it, an event naming no GPU, a lost GPU and its return, a GPU without
events, DP_DISABLE_HEALTHCHECKS through the environment, recovery of a reset-class error, a
reboot-class error kept across agent restarts until the boot ID changes, and the isolation file
added, edited, made malformed and removed. Nothing here asserts on timing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent.sim import control
from agent.sim.profile import load_profile
from tests.conftest import wants_twins
from tests.daemon_harness import GPU, Node, first_snapshot, unhealthy

UUIDS = [g["uuid"] for g in load_profile("dgx1-v100")["gpus"]]


@pytest.fixture
def node(request, tmp_path):
    """A node whose agents run the compiled event loop, or its twin when the test takes
    `fast_impl` (conftest) and this is its "python" run."""
    with Node(pure_python=wants_twins(request)) as n:
        n.boot_file = str(tmp_path / "boot_id")
        Path(n.boot_file).write_text("boot-a\n")
        yield n


def start(node: Node, *args: str, **env: str):
    agent = node.agent("--recovery-quiet-period", "60s", *args,
                       env=node.env(GPU_AGENT_BOOT_ID_FILE=node.boot_file, **env))
    res = agent.wait_registered()
    agent.wait_log(f"implementation {'python' if node.pure_python else 'cython'}")
    return agent, res.snapshot_seq


def next_snapshot(node: Node, agent, after: int):
    """The first ListAndWatch snapshot after seq `after`."""
    agent.wait_for(lambda s: s.resource(GPU).snapshot_seq > after, f"a snapshot after #{after}")
    return node.client.snapshots(GPU, after_seq=after)[0]


def wait_unhealthy(node: Node, agent, ids: set[str], what: str):
    state = agent.wait_for(lambda s: unhealthy(s.resource(GPU).latest_snapshot) == ids, what)
    return state.resource(GPU)


def test_xid_79_withdraws_gpu_3_in_the_next_snapshot_and_xid_13_changes_nothing(node, fast_impl):
    agent, seq = start(node)
    control.inject_xid(node.ctl, 3, 13)
    control.inject_xid(node.ctl, 3, 79)
    snap = next_snapshot(node, agent, seq)
    assert unhealthy(snap) == {UUIDS[3]}, "XID 13 made no snapshot of its own"
    assert len(snap.devices) == 8
    agent.wait_log(f"GPU 3 {UUIDS[3]}: unhealthy [xid=79 action=reboot]: XID 79 (GPU has fallen "
                   f"off the bus): node reboot required; withdrawn: {UUIDS[3]}")
    res = node.client.state().resource(GPU)
    assert res.allocatable == 7
    out = node.status_with(f"GPU 3 {UUIDS[3]} NUMA 0: unhealthy (XID 79", "1 delivered")
    assert f"unhealthy: {UUIDS[3]} (GPU 3 {UUIDS[3]}) [xid=79 action=reboot]" in out
    assert f"GPU 3 {UUIDS[3]} unhealthy [xid=79 action=reboot]: XID 79" in out
    assert "1 delivered, 1 ignored XIDs" in out
    assert f"GPU 3 {UUIDS[3]} NUMA 0: unhealthy (XID 79" in out


def test_event_naming_no_gpu_withdraws_every_device_in_one_snapshot(node, fast_impl):
    agent, seq = start(node)
    control.inject_xid(node.ctl, None, 48)
    snap = next_snapshot(node, agent, seq)
    assert unhealthy(snap) == set(UUIDS)


def test_lost_gpu_is_withdrawn_and_returns_when_restored(node, fast_impl):
    agent, seq = start(node, "--recovery-quiet-period", "0.5s")
    control.lose(node.ctl, 2)
    snap = next_snapshot(node, agent, seq)
    assert unhealthy(snap) == {UUIDS[2]}
    control.restore(node.ctl, 2)
    res = wait_unhealthy(node, agent, set(), "GPU 2 back")
    # the event set was re-established with GPU 2 on it: an XID there is seen again
    control.inject_xid(node.ctl, 2, 48)
    wait_unhealthy(node, agent, {UUIDS[2]}, "GPU 2 withdrawn by XID 48")
    assert res.allocatable == 8
    assert f"GPU 2 {UUIDS[2]}: healthy again (reset-class fault cleared" in agent.log


def test_gpu_whose_events_are_not_supported_stays_healthy_with_one_warning(node, fast_impl):
    agent, seq = start(node, GPU_AGENT_SIM_FAULTS="events_unsupported=3")
    control.inject_xid(node.ctl, 4, 48)
    snap = next_snapshot(node, agent, seq)
    assert unhealthy(snap) == {UUIDS[4]}
    assert agent.log.count(f"GPU 3 {UUIDS[3]}: NVML events not supported") == 1
    assert "GPU 3: no NVML events" in node.status_with("GPU 3: no NVML events")


def test_disable_healthchecks_from_the_environment(node, fast_impl):
    agent, seq = start(node, DP_DISABLE_HEALTHCHECKS="48", DP_ENABLE_HEALTHCHECKS="31")
    control.inject_xid(node.ctl, 1, 48)
    control.inject_xid(node.ctl, 2, 31)
    snap = next_snapshot(node, agent, seq)
    assert unhealthy(snap) == {UUIDS[2]}


def test_the_catalog_xid_table_follows_the_catalog_where_it_differs_from_nvidia(node):
    """agent.health.xidPolicy catalog: XID 94 (contained ECC error) is RESTART_APP in NVIDIA's
    XID catalog and 109 (context switch timeout) RESET_GPU, the reverse of NVIDIA's plugin
    defaults (its issue #1974). The XIDs go in 94 first: one snapshot can only hold 109's."""
    agent, seq = start(node, "--xid-policy", "catalog")
    control.inject_xid(node.ctl, 1, 94)
    control.inject_xid(node.ctl, 2, 109)
    snap = next_snapshot(node, agent, seq)
    assert unhealthy(snap) == {UUIDS[2]}, "XID 94 withdrew nothing"
    agent.wait_log(f"GPU 2 {UUIDS[2]}: unhealthy [xid=109 action=reset]: XID 109 (context "
                   f"switch timeout, catalog: RESET_GPU): GPU reset required")
    assert "catalog XID table" in node.status_with("catalog XID table")


def test_reset_class_error_recovers_after_the_quiet_period(node, fast_impl):
    agent, seq = start(node, "--recovery-quiet-period", "0.5s")
    control.inject_xid(node.ctl, 6, 48)
    snap = next_snapshot(node, agent, seq)
    assert unhealthy(snap) == {UUIDS[6]}
    back = next_snapshot(node, agent, snap.seq)
    assert unhealthy(back) == set()
    assert "reset-class fault cleared" in node.status_with("reset-class fault cleared")


def test_reboot_class_error_survives_restarts_until_the_boot_id_changes(node, fast_impl):
    health_json = os.path.join(node.state, "health.json")
    agent, seq = start(node, "--recovery-quiet-period", "0s")
    assert not os.path.exists(health_json)  # no fault recorded: nothing to write at start
    control.inject_xid(node.ctl, 5, 79)
    assert unhealthy(next_snapshot(node, agent, seq)) == {UUIDS[5]}
    assert agent.stop() == 0
    written = os.stat(health_json)
    # same boot: the restarted agent's first snapshot already withholds GPU 5, and the file,
    # which says just that, is left as it is (an atomic rewrite would be a new inode)
    agent, seq = start(node, "--recovery-quiet-period", "0s")
    assert unhealthy(first_snapshot(node)) == {UUIDS[5]}
    assert agent.stop() == 0
    kept = os.stat(health_json)
    assert (kept.st_ino, kept.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    # a reboot: the boot ID changed, the fault is cleared
    Path(node.boot_file).write_text("boot-b\n")
    agent, seq = start(node, "--recovery-quiet-period", "0s")
    assert unhealthy(first_snapshot(node)) == set()
    assert f"GPU 5 {UUIDS[5]}: healthy again: reboot fault recorded before the last reboot " \
           f"is cleared (boot ID changed)" in agent.log
    with open(os.path.join(node.state, "health.json")) as f:
        assert json.load(f)["faults"] == []


def write_isolation(node: Node, text: str) -> None:
    tmp = node.isolation + ".tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, node.isolation)


def test_isolation_file_added_edited_malformed_and_removed(node):
    agent, seq = start(node)
    write_isolation(node, json.dumps({"index": [1]}))
    wait_unhealthy(node, agent, {UUIDS[1]}, "GPU 1 isolated")
    Path(node.isolation).write_text(json.dumps({"index": [], "uuid": [UUIDS[6], UUIDS[7]]}))
    res = wait_unhealthy(node, agent, {UUIDS[6], UUIDS[7]}, "GPUs 6 and 7 isolated instead")
    seq = res.snapshot_seq
    write_isolation(node, '{"index": [0,')  # malformed: reported, the previous set stays
    agent.wait_log("isolation file: ")
    assert "not valid JSON" in agent.log and "keeping the previous isolation set" in agent.log
    out = node.status_with("ERROR: ", "not valid JSON")
    assert "ERROR: " in out and "not valid JSON" in out
    assert node.client.state().resource(GPU).snapshot_seq == seq
    write_isolation(node, json.dumps({"index": ["two"]}))
    agent.wait_log("'two' is not a GPU index")
    os.unlink(node.isolation)
    wait_unhealthy(node, agent, set(), "every GPU back")
    assert f"GPU 6 {UUIDS[6]}: healthy again (no longer listed in {node.isolation})" in agent.log
    assert f"GPU 1 {UUIDS[1]}: unhealthy [xid=None action=isolate]: isolated by " \
           f"{node.isolation}" in agent.log
