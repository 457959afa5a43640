"""Recovery that listens to the driver, end to end: `gpu-agent run` on the simulated NVML and
the simulated kubelet. A GPU withdrawn by a reset-class fault returns after its quiet period
only when its recovery probe passes, and the probe asks the driver as well as the GPU: while
the driver reports a recovery action other than none (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION), a
row remap pending or failed (Ampere and later), or pages pending retirement (before Ampere),
the GPU stays withdrawn; when the simulator clears it, the GPU returns. What kubelet sees is
read from the ListAndWatch snapshots the simulated kubelet received. Nothing here asserts on
timing: "past its quiet period" is the log line of a probe that ran, which the monitor runs
only once the quiet period is over.
"""

from __future__ import annotations

import pytest

from agent.sim import control
from agent.sim.profile import load_profile
from tests.daemon_harness import GPU, Node, first_snapshot, unhealthy

XID_DBE = 48  # reset class in NVIDIA's and our default table


@pytest.mark.parametrize("profile, pending, problem", [
    pytest.param("dgx1-v100", {"retired_pending": 1},
                 "pages are pending retirement: a GPU reset or a reboot retires them",
                 id="v100-pages-pending"),
    pytest.param("dgx-h100", {"remapped_pending": 1},
                 "a row remapping is pending: a GPU reset applies it", id="h100-remap-pending"),
    pytest.param("dgx-h100", {"remapped_failed": 1},
                 "a row remapping failed: the GPU needs service", id="h100-remap-failed"),
    pytest.param("dgx-h100", {"recovery_action": 1},
                 "the driver asks for a GPU reset (GPU recovery action 1)",
                 id="h100-action-gpu-reset"),
    pytest.param("dgx1-v100", {"recovery_action": 2},
                 "the driver asks for a node reboot (GPU recovery action 2)",
                 id="v100-action-node-reboot"),
])
def test_a_gpu_the_driver_still_wants_repaired_stays_withdrawn_until_that_clears(
        profile, pending, problem):
    uuid = load_profile(profile)["gpus"][6]["uuid"]
    with Node(profile=profile) as node:
        agent = node.agent("--recovery-quiet-period", "0.5s")
        seq = agent.wait_registered().snapshot_seq
        control.set_telemetry(6, node.ctl, **pending)
        control.inject_xid(node.ctl, 6, XID_DBE)
        agent.wait_for(lambda s: s.resource(GPU).snapshot_seq > seq, "the withdrawal")
        assert unhealthy(node.client.snapshots(GPU, after_seq=seq)[0]) == {uuid}
        # the quiet period is over and the probe ran: the driver's answer keeps the GPU out
        agent.wait_log(f"GPU 6 {uuid}: not recovered yet: {problem}")
        assert unhealthy(node.client.state().resource(GPU).latest_snapshot) == {uuid}
        assert node.client.state().resource(GPU).allocatable == 7
        control.set_telemetry(6, node.ctl, **{key: 0 for key in pending})
        agent.wait_for(lambda s: unhealthy(s.resource(GPU).latest_snapshot) == set(),
                       "GPU 6 back once the driver asks for nothing")
        assert f"GPU 6 {uuid}: healthy again (reset-class fault cleared" in agent.log
        assert agent.stop() == 0


def test_what_the_driver_does_not_offer_is_not_asked_for():
    # a V100 has no row remapping and an H100 no page retirement: NOT_SUPPORTED is skipped,
    # so those GPUs come back after the quiet period as before
    for profile in ("dgx1-v100", "dgx-h100"):
        uuid = load_profile(profile)["gpus"][2]["uuid"]
        with Node(profile=profile) as node:
            agent = node.agent("--recovery-quiet-period", "0.5s")
            seq = agent.wait_registered().snapshot_seq
            control.inject_xid(node.ctl, 2, XID_DBE)
            agent.wait_for(lambda s, seq=seq: s.resource(GPU).snapshot_seq > seq,
                           "the withdrawal")
            assert unhealthy(node.client.snapshots(GPU, after_seq=seq)[0]) == {uuid}
            agent.wait_for(lambda s: unhealthy(s.resource(GPU).latest_snapshot) == set(),
                           f"{uuid} back")
            assert "not recovered yet" not in agent.log
            assert agent.stop() == 0


def test_xid_154_reads_the_recovery_action_a_reset_returns_when_done_a_reboot_stays(tmp_path):
    uuids = [g["uuid"] for g in load_profile("dgx-h100")["gpus"]]
    boot = tmp_path / "boot_id"
    boot.write_text("boot-a\n")
    with Node(profile="dgx-h100") as node:
        agent = node.agent("--recovery-quiet-period", "0.5s",
                           env=node.env(GPU_AGENT_BOOT_ID_FILE=str(boot)))
        agent.wait_registered()
        control.set_telemetry(1, node.ctl, recovery_action=1)  # GPU reset
        control.set_telemetry(5, node.ctl, recovery_action=2)  # node reboot
        control.inject_xid(node.ctl, 1, 154)
        control.inject_xid(node.ctl, 5, 154)
        agent.wait_for(lambda s: unhealthy(s.resource(GPU).latest_snapshot) ==
                       {uuids[1], uuids[5]}, "GPUs 1 and 5 withdrawn")
        agent.wait_log(f"GPU 1 {uuids[1]}: unhealthy [xid=154 action=reset]: XID 154 (GPU "
                       f"recovery action changed, now 1): GPU reset required")
        agent.wait_log(f"GPU 5 {uuids[5]}: unhealthy [xid=154 action=reboot]: XID 154 (GPU "
                       f"recovery action changed, now 2): node reboot required")
        agent.wait_log(f"GPU 1 {uuids[1]}: not recovered yet: the driver asks for a GPU reset")
        control.set_telemetry(1, node.ctl, recovery_action=0)  # the reset was done
        control.set_telemetry(5, node.ctl, recovery_action=0)  # a reboot-class fault waits
        agent.wait_for(lambda s: unhealthy(s.resource(GPU).latest_snapshot) == {uuids[5]},
                       "GPU 1 back, GPU 5 still out")
        assert agent.stop() == 0
        # the reboot-class fault is kept across a restart in the same boot, as XID 79's
        agent = node.agent("--recovery-quiet-period", "0.5s",
                           env=node.env(GPU_AGENT_BOOT_ID_FILE=str(boot)))
        agent.wait_registered(registrations=2)
        assert unhealthy(first_snapshot(node)) == {uuids[5]}
        assert agent.stop() == 0
