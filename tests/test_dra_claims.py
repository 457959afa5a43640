"""Claims prepared for the DRA driver (agent.dra.claims) against the fast tests' API server:
the claim's CDI spec and answer named as NVIDIA's driver names them (kubernetes-sigs/
dra-driver-nvidia-gpu v0.4.1 cmd/gpu-kubelet-plugin cdi.go:45-46, 200, 300;
device_state.go:827-835), recorded before the answer so that a restarted agent answers a
repeated call the same and unprepares exactly what it made; bad claims refused, naming why,
with nothing written."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading

import pytest

from agent.dra.claims import ClaimError, Claims, NodeDevice
from agent.dra.plugin import ClaimRef
from agent.kubeapi.client import connect
from tests.kube_api import KubeApi

NODE = "n1"
GIB = 1 << 30
DEVICES = {"gpu-0": NodeDevice("GPU-aaa", (("/dev/nvidia0", "/drv/dev/nvidia0"),), "gpu",
                               80 * GIB, 0),
           "gpu-1": NodeDevice("GPU-bbb", (("/dev/nvidia1", "/drv/dev/nvidia1"),), "gpu",
                               80 * GIB, 1),
           "gpu-2-mig-1g10gb-19-0": NodeDevice("MIG-ccc", (("/dev/nvidia2", "/drv/dev/nvidia2"),),
                                               "mig", 10 * GIB, 2)}


def _claim(api: KubeApi, name: str, uid: str, results, config=()):
    api.claims[("ml", name)] = {
        "metadata": {"name": name, "namespace": "ml", "uid": uid},
        "status": {"allocation": {"devices": {"results": list(results),
                                              "config": list(config)}}}}
    return ClaimRef("ml", uid, name)


def _result(device: str, request: str = "gpu", pool: str = NODE, **extra) -> dict:
    return {"request": request, "driver": "gpu.nvidia.com", "pool": pool, "device": device,
            **extra}


def _config(params: dict, kind: str = "GpuConfig", api: str = "resource.nvidia.com/v1beta1",
            requests=(), source: str = "FromClaim") -> dict:
    """An opaque config as the API server copies it into the allocation (NVIDIA's shape:
    api/nvidia.com/resource/v1beta1 gpuconfig.go, sharing.go)."""
    return {"source": source, "requests": list(requests), "opaque": {
        "driver": "gpu.nvidia.com", "parameters": {"apiVersion": api, "kind": kind, **params}}}


@pytest.fixture
def env(tmp_path):
    api = KubeApi(NODE)
    client = connect(api.kubeconfig(str(tmp_path / "kubeconfig")))
    state, cdi = str(tmp_path / "state"), str(tmp_path / "cdi")
    os.makedirs(state)

    def claims(actions=None):
        return Claims(client, NODE, lambda: DEVICES, state, cdi, actions=actions)

    yield api, claims, cdi, state
    client.close()
    api.stop()


def test_prepare_writes_the_claims_cdi_spec_and_answers_its_cdi_ids(env):
    api, claims, cdi, _ = env
    ref = _claim(api, "train", "u-1", [_result("gpu-0"), _result("gpu-1", "second")])
    answer = claims().prepare(ref)
    assert [(p.requests, p.pool, p.device, p.cdi_ids) for p in answer] == [
        (("gpu",), NODE, "gpu-0", ("k8s.gpu.nvidia.com/claim=u-1-gpu-0",)),
        (("second",), NODE, "gpu-1", ("k8s.gpu.nvidia.com/claim=u-1-gpu-1",))]
    spec = json.loads(open(os.path.join(cdi, "k8s.gpu.nvidia.com-claim_u-1.json")).read())
    assert spec["kind"] == "k8s.gpu.nvidia.com/claim"
    assert [(d["name"], d["containerEdits"]["deviceNodes"]) for d in spec["devices"]] == [
        ("u-1-gpu-0", [{"path": "/dev/nvidia0", "hostPath": "/drv/dev/nvidia0"}]),
        ("u-1-gpu-1", [{"path": "/dev/nvidia1", "hostPath": "/drv/dev/nvidia1"}])]
    assert spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=GPU-aaa,GPU-bbb"]


def test_a_repeated_prepare_after_a_restart_answers_the_same_without_the_api(env):
    api, claims, cdi, _ = env
    ref = _claim(api, "train", "u-1", [_result("gpu-0")])
    first = claims().prepare(ref)
    asked = len(api.requests)
    api.stop()  # the API server is away: the record answers
    again = claims()  # the agent restarted
    assert again.prepare(ref) == first
    assert len(api.requests) == asked
    again.unprepare(ref)
    assert os.listdir(cdi) == []
    again.unprepare(ref)  # kubelet repeats: already done, no error
    assert claims().prepared == {}


@pytest.mark.parametrize("results, config, why", [
    ([_result("gpu-7")], (), "asks for device gpu-7 of pool n1, which node n1 does not have"),
    ([_result("gpu-0", pool="n2")], (), "asks for device gpu-0 of pool n2"),
    ([_result("gpu-0")], [_config({"sharing": {"strategy": "MPS"}}, kind="VfioDeviceConfig")],
     "config[0] (from FromClaim) parameters.kind: 'VfioDeviceConfig': gpu-agent takes "
     "GpuConfig and MigDeviceConfig"),
    ([_result("gpu-0")], [_config({"sharing": {"strategy": "MPS"}}, api="v1")],
     "parameters.apiVersion: 'v1': gpu-agent reads resource.nvidia.com/v1beta1"),
    ([_result("gpu-0")], [_config({"sharing": {"strategy": "Spatial"}})],
     "parameters.sharing.strategy: unknown GPU sharing strategy 'Spatial'"),
    ([_result("gpu-0")], [_config({"sharing": {"strategy": "MPS", "replicas": 2}})],
     "parameters.sharing.replicas: unknown field"),
    ([_result("gpu-0")], [_config({"sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {
        "interval": "Forever"}}})],
     "parameters.sharing.timeSlicingConfig.interval: unknown time-slice interval 'Forever'"),
    ([_result("gpu-0")], [_config({"sharing": {"strategy": "TimeSlicing", "mpsConfig": {}}})],
     "parameters.sharing.mpsConfig: cannot use MpsConfig with the 'TimeSlicing' strategy"),
    ([_result("gpu-0")], [_config({"sharing": {"strategy": "MPS", "mpsConfig": {
        "defaultActiveThreadPercentage": 101}}})],
     "mpsConfig.defaultActiveThreadPercentage: 101: an active thread percentage is an integer "
     "from 0 to 100"),
    ([_result("gpu-0")], [_config({"sharing": {"strategy": "MPS", "mpsConfig": {
        "defaultPinnedDeviceMemoryLimit": "512Ki"}}})],
     "mpsConfig.defaultPinnedDeviceMemoryLimit: invalid limit: value set too low"),
    ([_result("gpu-0")], [_config({"sharing": {"strategy": "MPS", "mpsConfig": {
        "defaultPerDevicePinnedMemoryLimit": {"3": "1Gi"}}}})],
     "defaultPerDevicePinnedMemoryLimit: invalid device '3'"),
    ([_result("gpu-0")], [_config({"sharing": {"strategy": "MPS"}}, kind="MigDeviceConfig",
                                  requests=["gpu"])],
     "cannot apply MigDeviceConfig to device gpu-0 of type 'gpu' (request: gpu)"),
    ([_result("gpu-0"), _result("gpu-1", "second")], [_config({"sharing": {"strategy": "MPS"}})],
     "MPS on 2 devices of one claim"),
    ([{**_result("gpu-0"), "driver": "other.example.com"}], (),
     "has no device of gpu.nvidia.com allocated"),
])
def test_a_bad_claim_is_refused_naming_why_and_nothing_is_written(env, results, config, why):
    api, claims, cdi, state = env
    ref = _claim(api, "bad", "u-9", results, config)
    c = claims()
    with pytest.raises(ClaimError) as refused:
        c.prepare(ref)
    assert why in str(refused.value) and "ml/bad" in str(refused.value)
    assert not os.path.exists(cdi) or os.listdir(cdi) == []
    assert c.prepared == {} and os.listdir(state) == []


def test_a_claim_made_again_under_the_same_name_is_not_prepared_for_the_old_uid(env):
    api, claims, _, _ = env
    _claim(api, "train", "u-new", [_result("gpu-0")])
    with pytest.raises(ClaimError) as refused:
        claims().prepare(ClaimRef("ml", "u-old", "train"))
    assert "is u-new, not u-old" in str(refused.value)


def test_an_unreadable_record_is_kept_aside_and_reported(env, caplog):
    api, claims, _, state = env
    with open(os.path.join(state, "dra-claims.msgpack"), "wb") as f:
        f.write(b"\xc1 not msgpack")
    c = claims()
    assert c.prepared == {}
    aside = [n for n in os.listdir(state) if n.startswith("dra-claims.msgpack.bad-")]
    assert len(aside) == 1
    assert open(os.path.join(state, aside[0]), "rb").read() == b"\xc1 not msgpack"
    assert "kept aside" in caplog.text


def test_a_record_of_0575db6_without_pods_loads_and_unprepares(env):
    """Records written before the pods were kept ([namespace, name, devices, spec]) load: the
    claim is listed without pods and unprepared as recorded."""
    import msgpack

    api, claims, cdi, state = env
    ref = _claim(api, "train", "u-1", [_result("gpu-0")])
    claims().prepare(ref)
    path = os.path.join(state, "dra-claims.msgpack")
    with open(path, "rb") as f:
        record = msgpack.unpackb(f.read(), raw=False)
    assert record["u-1"][4] == []  # the claim is reserved for no pod in this API server
    record["u-1"] = record["u-1"][:4]
    with open(path, "wb") as f:
        f.write(msgpack.packb(record, use_bin_type=True))
    old = claims()
    assert old.listing() == [{"namespace": "ml", "name": "train", "uid": "u-1",
                              "devices": ["gpu-0"], "pods": [], "sharing": ["exclusive"]}]
    old.unprepare(ref)
    assert os.listdir(cdi) == [] and claims().prepared == {}


class Actions:
    """What prepare asks of agent.dramode, recorded: time slices set, MPS plans applied, MIG
    devices made and destroyed (agent.dramode._NodeActions does it on the node)."""

    mps_root = "/run/nvidia/mps"

    def __init__(self, down: dict | None = None):
        self.timeslices: list[tuple[str, int]] = []
        self.plans: list[dict] = []
        self.down = down or {}
        self.made: list[list] = []  # [index, gi, ci, uuid] of what is made now

    def timeslice(self, uuid, interval):
        self.timeslices.append((uuid, interval))

    def mps(self, plan):
        self.plans.append(plan)
        return {u: why for u, why in self.down.items() if u in plan}

    def make(self, device):
        made = [device.index, len(self.made) + 1, 0, f"MIG-made-{len(self.made) + 1}"]
        self.made.append(made)
        return device._replace(uuid=made[3], partition=()), made

    def unmake(self, made):
        self.made.remove(made)


def _spec(cdi: str, uid: str) -> dict:
    return json.loads(open(os.path.join(cdi, f"k8s.gpu.nvidia.com-claim_{uid}.json")).read())


def test_time_slicing_sets_the_gpus_time_slice_as_nvidias_driver_does(env):
    """NVIDIA's TimeSlicingManager.SetTimeSlice (cmd/gpu-kubelet-plugin/sharing.go:136-150)
    with TimeSliceInterval.Int (sharing.go): Default 0 ... Long 3; a config naming no
    interval is Default (gpuconfig.go Normalize); on a MIG device nothing is set."""
    api, claims, cdi, _ = env
    actions = Actions()
    c = claims(actions)
    c.prepare(_claim(api, "ts", "u-1", [_result("gpu-1")], [
        _config({"sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {
            "interval": "Long"}}})]))
    c.prepare(_claim(api, "ts-default", "u-2", [_result("gpu-0")], [
        _config({"sharing": {"strategy": "TimeSlicing"}})]))
    c.prepare(_claim(api, "mig", "u-3", [_result("gpu-2-mig-1g10gb-19-0")], [
        _config({"sharing": {"strategy": "TimeSlicing"}}, kind="MigDeviceConfig")]))
    assert actions.timeslices == [("GPU-bbb", 3), ("GPU-aaa", 0)]
    assert actions.plans == []
    assert [x["sharing"] for x in c.listing()] == [["TimeSlicing"], ["TimeSlicing"],
                                                   ["TimeSlicing"]]


def test_mps_runs_the_gpus_daemon_and_gives_the_container_its_pipe_shm_and_limits(env):
    api, claims, cdi, state = env
    actions = Actions()
    c = claims(actions)
    c.prepare(_claim(api, "mps", "u-1", [_result("gpu-1")], [_config({"sharing": {
        "strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 40,
                                         "defaultPinnedDeviceMemoryLimit": "10Gi",
                                         "defaultPerDevicePinnedMemoryLimit": {"0": "12Gi"}}}})]))
    [plan] = actions.plans
    gpu = plan["GPU-bbb"]
    assert (gpu.index, gpu.thread_percentage, gpu.memory_limit_mib) == (1, 40, 12 * 1024)
    edits = _spec(cdi, "u-1")["devices"][0]["containerEdits"]
    assert edits["env"] == ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
                            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40",
                            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=12288M"]
    assert [(m["hostPath"], m["containerPath"]) for m in edits["mounts"]] == [
        ("/run/nvidia/mps/GPU-bbb/pipe", "/tmp/nvidia-mps"), ("/run/nvidia/mps/shm", "/dev/shm")]
    assert claims(actions).mps_plan() == plan  # a restarted agent's: from the record
    c.sync_mps()  # as at a start
    c.unprepare(ClaimRef("ml", "u-1", "mps"))
    assert actions.plans[-1] == {}  # the daemon no claim needs goes


def test_a_claim_is_not_prepared_while_its_mps_daemon_is_down(env):
    api, claims, cdi, state = env
    c = claims(Actions(down={"GPU-aaa": "nvidia-cuda-mps-control -d: exit status 1"}))
    with pytest.raises(ClaimError) as refused:
        c.prepare(_claim(api, "mps", "u-1", [_result("gpu-0")],
                         [_config({"sharing": {"strategy": "MPS"}})]))
    assert "the MPS control daemon of gpu-0 is not running: nvidia-cuda-mps-control" in str(
        refused.value)
    assert c.prepared == {} and not (os.path.exists(cdi) and os.listdir(cdi))
    assert c.actions.plans[-1] == {}  # the daemon it alone needed is not kept


def test_a_prepare_failing_late_leaves_no_mig_device_made_and_no_mps_daemon(env):
    """The CDI directory cannot be written (a file stands in its place): the MIG device made
    for the claim is destroyed, the MPS daemon it alone needed is told to go, nothing is
    recorded."""
    api, claims, cdi, state = env
    actions = Actions()
    c = claims(actions)
    with open(cdi, "w") as f:
        f.write("not a directory")
    devices = {**DEVICES, "gpu-3-mig-1g10gb-19-3": NodeDevice(
        "GPU-ddd", (("/dev/nvidia3", "/drv/dev/nvidia3"),), "mig", 10 * GIB, 3, (19, 3, 1))}
    c.devices = lambda: devices
    with pytest.raises(ClaimError, match="cannot write the claim's CDI spec"):
        c.prepare(_claim(api, "mig", "u-1", [_result("gpu-3-mig-1g10gb-19-3")]))
    assert actions.made == [] and c.prepared == {}
    with pytest.raises(ClaimError, match="cannot write the claim's CDI spec"):
        c.prepare(_claim(api, "mps", "u-2", [_result("gpu-0")],
                         [_config({"sharing": {"strategy": "MPS"}})]))
    assert [list(p) for p in actions.plans] == [["GPU-aaa"], []]
    assert os.listdir(state) == []


def test_a_mig_device_made_at_prepare_is_in_the_spec_and_record_and_goes_at_unprepare(env):
    api, claims, cdi, state = env
    actions = Actions()
    devices = {"gpu-3-mig-1g10gb-19-3": NodeDevice(
        "GPU-ddd", (("/dev/nvidia3", "/drv/dev/nvidia3"),), "mig", 10 * GIB, 3, (19, 3, 1))}
    c = claims(actions)
    c.devices = lambda: devices
    ref = _claim(api, "mig", "u-1", [_result("gpu-3-mig-1g10gb-19-3")])
    c.prepare(ref)
    assert actions.made == [[3, 1, 0, "MIG-made-1"]]
    assert _spec(cdi, "u-1")["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=MIG-made-1"]
    again = claims(actions)  # a restarted agent destroys what the record says was made
    again.devices = lambda: devices
    again.unprepare(ref)
    assert actions.made == [] and again.prepared == {}


def test_shares_of_a_shareable_gpu_get_mps_limits_from_the_capacity_they_consumed(env):
    """KEP-5075: the scheduler writes each allocation of a device allowing several its
    shareID and consumedCapacity (every capacity of the device); gpu-agent turns it into an
    MPS share: its memory, and its cores or else the same fraction of the SMs. A share with
    all the memory is the GPU whole, not shared."""
    api, claims, cdi, _ = env
    actions = Actions()
    c = claims(actions)
    shares = [("a", "u-1", "0b5e3c7a-1111-4a4a-9a9a-000000000001", {"memory": "20Gi",
                                                                      "cores": "0"}),
              ("b", "u-2", "0b5e3c7a-2222-4a4a-9a9a-000000000002", {"memory": "20Gi",
                                                                      "cores": "50"}),
              ("c", "u-3", "0b5e3c7a-3333-4a4a-9a9a-000000000003", {"memory": "80Gi",
                                                                      "cores": "0"})]
    answers = {}
    for name, uid, share, consumed in shares:
        answers[uid] = c.prepare(_claim(api, name, uid, [_result(
            "gpu-0", shareID=share, consumedCapacity=consumed)]))
    [a], [b], [whole] = answers.values()
    assert (a.share_id, a.cdi_ids) == (shares[0][2], (
        "k8s.gpu.nvidia.com/claim=u-1-gpu-0-0b5e3c7a",))
    env_of = {uid: _spec(cdi, uid)["devices"][0]["containerEdits"].get("env")
              for _, uid, _, _ in shares}
    assert env_of["u-1"][1:] == ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
                                 "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M"]
    assert env_of["u-2"][1:] == ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
                                 "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M"]
    assert env_of["u-3"] is None  # all of the memory: the GPU whole, no MPS
    gpu = actions.plans[-1]["GPU-aaa"]
    assert (gpu.replicas, gpu.thread_percentage, gpu.memory_limit_mib) == (2, 50, 20480)


def _partition(memory_gib: int, placement: tuple[int, int, int]) -> NodeDevice:
    return NodeDevice("GPU-ddd", (("/dev/nvidia3", "/drv/dev/nvidia3"),), "mig",
                      memory_gib * GIB, 3, placement)


# Three placements of GPU 3 (profile ID, start, size): 1g.10gb at slice 3, 3g.40gb at 0-3,
# 7g.80gb at 0-7; the first overlaps each of the others
GPU3_PARTITIONS = {"gpu-3-mig-1g10gb-19-3": _partition(10, (19, 3, 1)),
                   "gpu-3-mig-3g40gb-9-0": _partition(40, (9, 0, 4)),
                   "gpu-3-mig-7g80gb-0-0": _partition(80, (0, 0, 8))}


@contextlib.contextmanager
def _logged(caplog, text: str):
    """An Event set once agent.dra.claims logs a line holding `text` (what a waiting prepare
    says: the test waits for that, not for a time)."""
    seen = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if text in record.getMessage():
                seen.set()

    handler, logger = Seen(), logging.getLogger("agent.dra.claims")
    caplog.set_level(logging.INFO, logger=logger.name)
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def test_a_partition_waits_for_the_overlapping_mig_devices_claims_to_be_unprepared(
        env, caplog):
    """A pod deleted at once goes from the API server before kubelet has stopped it, so the
    scheduler may give a 7g.80gb partition while the 1g.10gb device of the gone pod's claim is
    still made: prepare waits for that claim's unprepare (kubelet would otherwise retry only
    at its next sync of the pod, a minute later), and names it if it never comes."""
    api, claims, cdi, _ = env
    actions = Actions()
    c = claims(actions)
    c.devices = lambda: GPU3_PARTITIONS
    small = _claim(api, "small", "u-1", [_result("gpu-3-mig-1g10gb-19-3")])
    c.prepare(small)
    whole = _claim(api, "whole", "u-2", [_result("gpu-3-mig-7g80gb-0-0")])

    c.overlap_wait_s = 0.2
    with pytest.raises(ClaimError, match="claim ml/whole: its MIG device overlaps those of "
                                         "ml/small, still prepared on this node after 0.2 s"):
        c.prepare(whole)
    assert actions.made == [[3, 1, 0, "MIG-made-1"]]

    c.overlap_wait_s = 60
    answers = []
    with _logged(caplog, "waits for ml/small to be unprepared") as waiting:
        t = threading.Thread(target=lambda: answers.append(c.prepare(whole)))
        t.start()
        assert waiting.wait(30)
        assert answers == [] and actions.made == [[3, 1, 0, "MIG-made-1"]]
        c.unprepare(small)
        t.join(30)
    [[answer]] = answers
    assert answer.device == "gpu-3-mig-7g80gb-0-0"
    assert actions.made == [[3, 1, 0, "MIG-made-1"]]  # the 7g one, made after the 1g went
    assert _spec(cdi, "u-2")["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=MIG-made-1"]
    assert list(c.prepared) == ["u-2"]


def test_a_waiting_partition_ends_when_kubelet_unprepares_it_and_waiters_are_bounded(
        env, caplog):
    """Kubelet gives up on a call after 45 s and may unprepare the claim (its pod deleted)
    while the prepare still waits: the prepare ends then, making nothing, or the MIG device
    it made would stand with no claim to unprepare it. And only a few prepares wait at once
    (each holds one of the DRA server's workers, which the unprepares they wait for need)."""
    api, claims, cdi, _ = env
    actions = Actions()
    c = claims(actions)
    c.devices = lambda: GPU3_PARTITIONS
    c.prepare(_claim(api, "small", "u-1", [_result("gpu-3-mig-1g10gb-19-3")]))
    half = _claim(api, "half", "u-2", [_result("gpu-3-mig-3g40gb-9-0")])

    c.overlap_waiters = 0
    with pytest.raises(ClaimError, match=r"claim ml/half: its MIG device overlaps those of "
                                         r"ml/small, still prepared on this node \(0 prepares "
                                         r"wait already\)"):
        c.prepare(half)

    c.overlap_waiters, c.overlap_wait_s = 4, 60
    errors = []

    def prepare():
        try:
            c.prepare(half)
        except ClaimError as exc:
            errors.append(str(exc))

    with _logged(caplog, "claim ml/half waits for ml/small") as waiting:
        t = threading.Thread(target=prepare)
        t.start()
        assert waiting.wait(30)
        c.unprepare(half)  # kubelet: the pod went while its prepare waited
        t.join(30)
    assert errors == ["claim ml/half: unprepared while its prepare waited"]
    assert actions.made == [[3, 1, 0, "MIG-made-1"]] and list(c.prepared) == ["u-1"]
    assert not os.path.exists(os.path.join(cdi, "k8s.gpu.nvidia.com-claim_u-2.json"))
