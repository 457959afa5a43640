"""Claims prepared for the DRA driver (agent.dra.claims) against the fast tests' API server:
the claim's CDI spec and answer named as NVIDIA's driver names them (kubernetes-sigs/
dra-driver-nvidia-gpu v0.4.1 cmd/gpu-kubelet-plugin cdi.go:45-46, 200, 300;
device_state.go:827-835), recorded before the answer so that a restarted agent answers a
repeated call the same and unprepares exactly what it made; bad claims refused, naming why,
with nothing written."""

from __future__ import annotations

import json
import os

import pytest

from agent.dra.claims import ClaimError, Claims, NodeDevice
from agent.dra.plugin import ClaimRef
from agent.kubeapi.client import connect
from tests.kube_api import KubeApi

NODE = "n1"
DEVICES = {"gpu-0": NodeDevice("GPU-aaa", (("/dev/nvidia0", "/drv/dev/nvidia0"),)),
           "gpu-1": NodeDevice("GPU-bbb", (("/dev/nvidia1", "/drv/dev/nvidia1"),))}


def _claim(api: KubeApi, name: str, uid: str, results, config=()):
    api.claims[("ml", name)] = {
        "metadata": {"name": name, "namespace": "ml", "uid": uid},
        "status": {"allocation": {"devices": {"results": list(results),
                                              "config": list(config)}}}}
    return ClaimRef("ml", uid, name)


def _result(device: str, request: str = "gpu", pool: str = NODE) -> dict:
    return {"request": request, "driver": "gpu.nvidia.com", "pool": pool, "device": device}


@pytest.fixture
def env(tmp_path):
    api = KubeApi(NODE)
    client = connect(api.kubeconfig(str(tmp_path / "kubeconfig")))
    state, cdi = str(tmp_path / "state"), str(tmp_path / "cdi")
    os.makedirs(state)

    def claims():
        return Claims(client, NODE, lambda: DEVICES, state, cdi)

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
    ([_result("gpu-0")], [{"opaque": {"driver": "gpu.nvidia.com", "parameters": {
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}}}],
     "opaque config resource.nvidia.com/v1beta1 GpuConfig for gpu.nvidia.com is not "
     "supported"),
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
                              "devices": ["gpu-0"], "pods": []}]
    old.unprepare(ref)
    assert os.listdir(cdi) == [] and claims().prepared == {}
