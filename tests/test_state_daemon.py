"""Allocation state end to end: `gpu-agent run` (a real subprocess on the simulated NVML)
against the simulated kubelet, Allocate over the real plugin socket, podresources over the
real pod-resources socket. Allocations survive restarts (SIGTERM and kill -9, also at random
moments during concurrent Allocates), attribution follows what podresources reports (pods that
ended while the agent was down included), bad checkpoints are set aside and reported, the
index key survives a UUID change, another boot's records stand only where kubelet confirms
them, and an Allocate that cannot be recorded is refused.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter

import grpc
import pytest

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.host import BOOT_ID_ENV
from agent.sim.kubelet import SimKubelet
from agent.sim.profile import load_profile
from agent.state.checkpoint import Checkpoint
from agent.state.journal import JOURNAL_FILE, read_journal
from agent.status import read_status
from tests.conftest import run_gpu_agent
from tests.daemon_harness import GPU, WAIT, Node, clean_env

UUIDS = [g["uuid"] for g in load_profile("dgx1-v100")["gpus"]]


@pytest.fixture
def node():
    with Node() as n:
        yield n


def checkpoint(node: Node) -> Checkpoint | None:
    return read_journal(os.path.join(node.state, JOURNAL_FILE))


def show(node: Node) -> dict:
    """`gpu-agent state show --json`, as an operator runs it."""
    return json.loads(run_gpu_agent("state", "show", "--json", "--state-dir", node.state,
                                    env=clean_env()).stdout)


def attributed(doc: dict) -> set[tuple]:
    """(namespace, pod, container, resource, devices) of every attributed allocation."""
    return {(a["namespace"], a["pod"], a["container"], a["resource"], tuple(sorted(a["devices"])))
            for a in doc["allocations"] if a["pod"] is not None}


def kubelet_view(node: Node) -> set[tuple]:
    """The same, from the simulated kubelet's own record of what each container got."""
    return {(p.namespace, p.name, c.name, a.resource, tuple(sorted(a.device_ids)))
            for p in node.client.state().pods for c in p.containers for a in c.allocations}


def wait_records(agent, predicate, what: str, timeout: float = WAIT) -> Checkpoint:
    """Poll the checkpoint until predicate(its records); fail with the log if it never holds."""
    deadline = time.monotonic() + timeout
    while True:
        cp = checkpoint(agent.node)
        if cp is not None and predicate(cp.records):
            return cp
        if not agent.alive():
            raise AssertionError(f"the agent exited while waiting for {what}:\n{agent.log}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s; records: "
                                 f"{cp.records if cp else None}\n{agent.log}")
        time.sleep(0.05)


def all_attributed(n: int):
    return lambda records: len(records) == n and all(r.pod is not None for r in records)


def reconciled_since(agent, runs: int, timeout: float = WAIT) -> dict:
    """status.json's state once the agent has reconciled more than `runs` times."""
    deadline = time.monotonic() + timeout
    while True:
        doc = read_status(agent.node.state)
        state = (doc or {}).get("state") or {}
        if doc and doc.get("pid") == agent.pid and \
                state.get("podResources", {}).get("reconciles", 0) > runs:
            return doc
        if not agent.alive() or time.monotonic() > deadline:
            raise AssertionError(f"no reconciliation reported in status.json:\n{agent.log}")
        time.sleep(0.05)


# -- restarts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
def test_allocations_survive_an_agent_restart(node, stop):
    agent = node.agent()
    agent.wait_registered()
    node.client.admit_pod("train", {"main": {GPU: 2}}, namespace="ml")
    node.client.admit_pod("infer", {"a": {GPU: 1}, "b": {GPU: 1}})
    before = wait_records(agent, all_attributed(3), "3 attributed allocations")
    agent.stop(stop)

    again = node.agent()
    again.wait_registered(registrations=2)
    reconciled_since(again, 1)
    doc = show(node)
    assert attributed(doc) == kubelet_view(node) and len(doc["allocations"]) == 3
    after = checkpoint(node)
    assert {r.id: (r.pod, r.devices, r.gpus, r.response, r.time) for r in after.records} == \
        {r.id: (r.pod, r.devices, r.gpus, r.response, r.time) for r in before.records}
    # the response recorded is the one the kubelet got
    got = {(p.name, c.name): a.container_response.envs["NVIDIA_VISIBLE_DEVICES"]
           for p in node.client.state().pods for c in p.containers for a in c.allocations}
    assert {(r.pod.name, r.pod.container): r.response.envs["NVIDIA_VISIBLE_DEVICES"]
            for r in after.records} == got


def test_attribution_follows_podresources_including_pods_that_ended_while_down(node):
    agent = node.agent("--reconcile-interval", "200ms", "--ended-pod-grace", "1s")
    agent.wait_registered()
    for name in ("a", "b", "c"):
        node.client.admit_pod(name, {"main": {GPU: 2}})
    wait_records(agent, all_attributed(3), "3 attributed allocations")
    agent.stop(signal.SIGKILL)
    node.client.delete_pod("b")  # ends while the agent is down

    again = node.agent("--reconcile-interval", "200ms", "--ended-pod-grace", "1s")
    again.wait_registered(registrations=2)
    wait_records(again, lambda rs: {r.pod.name for r in rs if r.pod} == {"a", "c"} and
                 len(rs) == 2, "b's record dropped")
    assert "(pod default/b container main) not listed by podresources; dropped if still not " \
           "listed in 1 s" in again.log
    assert attributed(show(node)) == kubelet_view(node)
    assert "(pod default/b container main) dropped: pod default/b has ended" in again.log

    node.client.admit_pod("d", {"main": {GPU: 1}, "side": {GPU: 1}})  # after each Allocate
    node.client.delete_pod("a")  # while running: the periodic pass notices
    wait_records(again, lambda rs: {(r.pod.name, r.pod.container) for r in rs if r.pod} ==
                 {("c", "main"), ("d", "main"), ("d", "side")} and len(rs) == 3,
                 "d attributed and a dropped")
    assert attributed(show(node)) == kubelet_view(node)
    expected = ("allocations: 3 recorded (3 attributed to pods, 0 waiting)",
                f"podresources: answering on {node.podresources_socket}",
                "allocatable nvidia.com/gpu: 8)")
    status = node.status_with(*expected)
    assert all(t in status for t in expected), status


def test_a_kubelet_restart_keeps_the_records_of_running_pods():
    # The real kubelet lists a running pod again only once it has read it from the API server
    # (tests/e2e/test_restarts.py saw the record dropped, then adopted without its Allocate);
    # the simulated one lists none for `relist_after_restart` seconds, 3 here.
    with Node(start_kubelet=False) as node:
        node.kubelet = SimKubelet(node.kdir, dial_timeout=5.0, relist_after_restart=3.0)
        node.kubelet.start()
        agent = node.agent("--reconcile-interval", "200ms")
        agent.wait_registered()
        node.client.admit_pod("a", {"main": {GPU: 2}})
        before = wait_records(agent, all_attributed(1), "a attributed").records
        node.client.restart()
        agent.wait_registered(registrations=2)
        agent.wait_log("(pod default/a container main) not listed by podresources; dropped if "
                       "still not listed in 30 s")
        runs = read_status(node.state)["state"]["podResources"]["reconciles"]
        node.status_when(lambda d: d["state"]["podResources"]["reconciles"] > runs
                         and d["state"]["podResources"]["lastOutcome"]["unlisted"] == 0,
                         "a pass that lists the pod again")
        after = checkpoint(node)
        assert [(r.id, r.pod, r.response) for r in after.records] == \
            [(r.id, r.pod, r.response) for r in before]
        assert " dropped: " not in agent.log and "adopted" not in agent.log


# -- kill -9 at random moments ----------------------------------------------------------------

LIVES = 100
MEAN_PER_LIFE = 20  # about 2,000 Allocates returned in all
CALLERS = 4


def _life(node: Node, rng: random.Random, returned: list[str], strategy: str
          ) -> tuple[int, int]:
    """Start the agent, Allocate from CALLERS threads until a kill -9 after a random number
    of answers plus a random pause of up to 3 ms; (answered, calls that failed). What each
    answer adds to `returned`: its CDI annotation's key with cdi-annotations (unique per
    response), else its device set."""
    agent = node.agent("--device-list-strategy", strategy)
    agent.wait_registered(registrations=len(node.agents))
    channel = grpc.insecure_channel(f"unix:{node.plugin_socket}",
                                    options=[("grpc.enable_http_proxy", 0)])
    stub = dp_grpc.DevicePluginStub(channel)
    lock = threading.Lock()
    answered = threading.Condition(lock)
    mine: list[str] = []
    failed = [0]
    kill_after = rng.randint(1, 2 * MEAN_PER_LIFE - 1)
    picks = [rng.sample(UUIDS, rng.randint(1, 2)) for _ in range(4 * MEAN_PER_LIFE)]

    def caller(n: int) -> None:
        for k in range(n, len(picks), CALLERS):
            request = dp.AllocateRequest(container_requests=[
                dp.ContainerAllocateRequest(devices_ids=picks[k])])
            try:
                response = stub.Allocate(request, timeout=WAIT)
            except grpc.RpcError:
                with lock:
                    failed[0] += 1
                return  # killed under us
            answer = response.container_responses[0]
            if "cdi-annotations" in strategy:
                [key] = answer.annotations  # unique per response
            else:
                key = ",".join(sorted(picks[k]))
            with lock:
                mine.append(key)
                answered.notify_all()

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(CALLERS)]
    for t in threads:
        t.start()
    with lock:
        assert answered.wait_for(lambda: len(mine) >= kill_after or failed[0], WAIT), agent.log
    time.sleep(rng.uniform(0, 0.003))
    os.kill(agent.pid, signal.SIGKILL)
    for t in threads:
        t.join(WAIT)
    channel.close()
    agent.wait_exit()
    assert "moved aside" not in agent.log, agent.log
    returned.extend(mine)
    return len(mine), failed[0]


# 100 agent starts: about 60 s on an idle 2-CPU machine and over twice that under
# `make test-under-load` (stress-ng on both CPUs); every wait inside is for an event
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", [
    # every response differs (its CDI annotation): each record holds its own
    "envvar,cdi-annotations",
    # the same device sets again and again: records of one answer share its parts
    "envvar",
])
def test_kill_9_at_random_moments_never_loses_an_answered_allocation(node, strategy):
    rng = random.Random(int(os.environ.get("GPU_AGENT_TEST_SEED", "6")))
    returned: list[str] = []
    refused = 0
    for life in range(LIVES):
        _, failed = _life(node, rng, returned, strategy)
        refused += failed
        cp = checkpoint(node)  # loads: a complete, valid file after every kill
        if "cdi-annotations" in strategy:
            on_disk = Counter(k for r in cp.records for k in r.response.annotations)
        else:  # no pod claims them: every record of every life stays (grace period)
            on_disk = Counter(",".join(sorted(r.devices)) for r in cp.records)
        missing = Counter(returned) - on_disk
        assert not missing, f"life {life}: answered allocations not on disk: {missing}"
    # every life answered at least one; the callers' failed calls are those the kill cut
    assert len(returned) >= LIVES and refused >= LIVES
    if "cdi-annotations" in strategy:
        assert len(set(returned)) == len(returned)


# -- bad checkpoints ----------------------------------------------------------------------------


def _truncate(raw: bytes) -> bytes:
    return raw[: len(raw) // 3]


def _flip(raw: bytes) -> bytes:
    from agent.state import frames

    data = bytearray(raw)
    data[len(frames.MAGIC) + 12] ^= 0x04  # inside the first entry, with more after it
    return bytes(data)


def _future(raw: bytes) -> bytes:
    import msgpack

    from agent.state import frames
    meta = frames.frame(msgpack.packb(["meta", frames.VERSION + 1, "b", "uuid", 0.0]))
    return frames.MAGIC + meta + raw[len(frames.MAGIC):]


def _not_a_journal(raw: bytes) -> bytes:
    return b"\x83 a checkpoint of some other program" + raw


@pytest.mark.parametrize("damage, kind", [(_not_a_journal, "corrupt"), (_flip, "corrupt"),
                                          (_future, "version")],
                         ids=["not-a-journal", "bit-flipped", "future-version"])
def test_a_bad_checkpoint_is_set_aside_reported_and_rebuilt_from_podresources(node, damage,
                                                                              kind):
    agent = node.agent()
    agent.wait_registered()
    node.client.admit_pod("train", {"main": {GPU: 2}})
    wait_records(agent, all_attributed(1), "the pod's allocation")
    agent.stop()
    path = os.path.join(node.state, JOURNAL_FILE)
    bad = damage(open(path, "rb").read())
    with open(path, "wb") as f:
        f.write(bad)

    again = node.agent()
    again.wait_registered(registrations=2)
    doc = reconciled_since(again, 1)
    [aside] = doc["state"]["setAside"]
    assert aside["kind"] == kind
    assert os.path.basename(aside["path"]).startswith(JOURNAL_FILE + ".bad-")
    assert open(aside["path"], "rb").read() == bad  # never overwritten
    assert f"moved aside to {aside['path']}" in again.log
    assert f"bad journal set aside: {aside['path']}" in doc["summary"]
    expected = f"bad journal set aside ({kind}): {aside['path']}"
    assert expected in node.status_with(expected)
    # started from podresources: the running pod's allocation is adopted
    cp = wait_records(again, all_attributed(1), "the adopted allocation")
    assert attributed(show(node)) == kubelet_view(node)
    assert cp.records[0].response is None and "adopted from podresources" in again.log
    # and new allocations are recorded as usual
    node.client.admit_pod("next", {"main": {GPU: 1}})
    wait_records(again, all_attributed(2), "the next allocation")
    assert open(aside["path"], "rb").read() == bad


# -- device ID strategy for checkpoints -----------------------------------------------------------


@pytest.mark.parametrize("key", ["index", "uuid"])
def test_index_key_survives_a_uuid_change_and_uuid_key_does_not(node, key):
    profile = node.profile_copy()
    env = node.env(GPU_AGENT_SIM_PROFILE=profile)
    agent = node.agent("--checkpoint-device-id-strategy", key, env=env)
    agent.wait_registered()
    node.client.admit_pod("train", {"main": {GPU: 2}})
    [before] = wait_records(agent, all_attributed(1), "the pod's allocation").records
    agent.stop()
    # the VM moved: same GPUs by index, every UUID new
    text = open(profile).read()
    new = {u: "GPU-" + "%08x" % (i + 0xabc0) + u[12:] for i, u in enumerate(UUIDS)}
    for old, fresh in new.items():
        text = text.replace(old, fresh)
    with open(profile, "w") as f:
        f.write(text)

    again = node.agent("--checkpoint-device-id-strategy", key, env=env)
    res = again.wait_for(lambda s: s.resource(GPU) and set(new.values()) <= {
        d.id for d in s.resource(GPU).devices}, "the new UUIDs advertised")
    assert res
    reconciled_since(again, 0)  # the journal loads once the GPUs are known: every pass sees them
    records = checkpoint(node).records
    if key == "index":
        [after] = records
        assert after.id == before.id and after.pod == before.pod
        assert after.devices == before.devices  # the IDs kubelet holds them under
        assert [g.index for g in after.gpus] == [g.index for g in before.gpus]
        assert [g.uuid for g in after.gpus] == [new[g.uuid] for g in before.gpus]
        assert "is now" in again.log and "checkpointDeviceIDStrategy index" in again.log
        doc = show(node)
        assert [g["uuid"] for g in doc["allocations"][0]["gpus"]] == \
            [new[g.uuid] for g in before.gpus]
    else:
        assert records == ()
        g = before.gpus[0]
        assert "is no longer on this host (checkpointDeviceIDStrategy uuid)" in again.log
        assert f"GPU {g.uuid} (index {g.index})" in again.log


# -- another boot ---------------------------------------------------------------------------------


def test_another_boots_checkpoint_is_kept_only_where_podresources_confirms_it(node):
    boot = node.write("boot_id", "11111111-1111-1111-1111-111111111111\n")
    env = node.env(**{BOOT_ID_ENV: boot})
    agent = node.agent(env=env)
    agent.wait_registered()
    node.client.admit_pod("train", {"main": {GPU: 1}})
    agent.allocate([UUIDS[7]])  # answered, but no pod ever runs with it
    wait_records(agent, lambda rs: len(rs) == 2 and sum(r.pod is not None for r in rs) == 1,
                 "one attributed and one pending allocation")
    agent.stop()

    node.write("boot_id", "22222222-2222-2222-2222-222222222222\n")  # the host rebooted
    again = node.agent(env=env)
    again.wait_registered(registrations=2)
    [kept] = wait_records(again, lambda rs: len(rs) == 1, "only the confirmed record").records
    assert kept.pod.name == "train" and kept.boot.startswith("1111")
    assert "written in boot 11111111-1111-1111-1111-111111111111, this is boot 2222" in again.log
    assert "allocated in another boot (11111111-1111-1111-1111-111111111111) and not listed " \
           "by podresources" in again.log


# -- podresources unavailable; state not writable ---------------------------------------------------


def test_a_missing_podresources_socket_is_reported_not_fatal(node):
    missing = node.path("nowhere/kubelet.sock")
    agent = node.agent("--pod-resources-socket", missing)
    agent.wait_registered()
    node.client.admit_pod("train", {"main": {GPU: 1}})
    [r] = wait_records(agent, lambda rs: len(rs) == 1, "the recorded allocation").records
    assert r.pod is None  # recorded, not attributed
    expected = (f"podresources: kubelet's podresources socket {missing} does not exist",
                "allocations: 1 recorded (0 attributed to pods, 1 waiting)")
    status = node.status_with(*expected)
    assert all(t in status for t in expected), status
    assert agent.alive()


def test_an_allocate_that_cannot_be_recorded_is_refused_with_the_reason(node):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs as the state directory needs root (CI runs as root)")
    os.makedirs(node.state, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", node.state], check=True)
    try:
        agent = node.agent()
        agent.wait_registered()
        agent.allocate([UUIDS[0]])
        filler = os.open(os.path.join(node.state, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(filler, b"x" * 512)
        except OSError:
            os.close(filler)
        with pytest.raises(grpc.RpcError) as info:
            for _ in range(100):  # the journal's last page may take a few more
                agent.allocate([UUIDS[1]])
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert info.value.details().startswith(
            f"allocation not recorded: cannot write the journal {node.state}/{JOURNAL_FILE}")
        assert "No space left on device" in info.value.details()
        assert agent.log.count("Allocate answers UNAVAILABLE until it works again") == 1
        os.unlink(os.path.join(node.state, "filler"))  # (status.json cannot be written either)
        agent.allocate([UUIDS[2]])  # recovered by itself
        expected = "last journal error: cannot write the journal"
        assert expected in node.status_with(expected)
        assert checkpoint(node).records[-1].devices == (UUIDS[2],)
        assert agent.alive()
        agent.stop()
    finally:
        subprocess.run(["umount", "-l", node.state], check=False)


def test_sighup_applies_new_state_settings(node):
    config = node.write("config.yaml", "version: v1\nagent:\n  checkpointDeviceIDStrategy: uuid\n"
                                       "  reconcileInterval: 60s\n")
    agent = node.agent("--config", config)
    agent.wait_registered()
    state = reconciled_since(agent, 0)["state"]
    assert state["keyedBy"] == "uuid" and state["podResources"]["period"] == 60.0
    node.write("config.yaml", "version: v1\nagent:\n  checkpointDeviceIDStrategy: index\n"
                              "  reconcileInterval: 1m30s\n")
    agent.send(signal.SIGHUP)
    agent.wait_log("configuration reloaded")
    deadline = time.monotonic() + WAIT
    while True:
        state = read_status(node.state)["state"]
        if state["keyedBy"] == "index" and state["podResources"]["period"] == 90.0:
            break
        assert time.monotonic() < deadline, f"settings not applied: {state}\n{agent.log}"
        time.sleep(0.05)
    assert "checkpointDeviceIDStrategy is now index (was uuid)" in agent.log
    assert node.client.state().resource(GPU).registrations == 1  # served on through it
    node.client.admit_pod("train", {"main": {GPU: 1}})
    wait_records(agent, all_attributed(1), "an allocation recorded after the reload")
    assert checkpoint(node).keyed_by == "index"
