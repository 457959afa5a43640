"""The reconciliation rules (agent.state.reconcile) on plain data: attribution by exact device
set (NUMA-split listings merged), pods that ended, pending allocations and their grace, another
boot's records, device reuse (newest Allocate wins), GPUs matched by UUID or by index, no
pod-based drop while podresources does not answer, and adoption of listed containers no record
matches.
"""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.state.checkpoint import GpuRef, PodRef, Record, Response
from agent.state.reconcile import PodDevices, reconcile

RES = "nvidia.com/gpu"
NOW = 10_000.0


class Dev(NamedTuple):
    """An advertised full-GPU device (the fields of agent.rm.devices.Device reconcile reads)."""

    id: str
    gpu_uuid: str
    gpu_index: int


def gpus(*pairs: tuple[str, int]) -> dict:
    return {RES: [Dev(uuid, uuid, index) for uuid, index in pairs]}


GPUS = gpus(*((f"GPU-{i}", i) for i in range(8)))


def rec(rid: str, *indexes: int, t: float = NOW - 10, boot: str = "B", pod: PodRef | None = None,
        resource: str = RES) -> Record:
    return Record(id=rid, resource=resource, devices=tuple(f"GPU-{i}" for i in indexes),
                  gpus=tuple(GpuRef(f"GPU-{i}", i) for i in indexes), response=Response(),
                  time=t, boot=boot, pod=pod)


def listed(ns: str, name: str, container: str, *indexes: int, resource: str = RES) -> PodDevices:
    return PodDevices(ns, name, container, resource, tuple(f"GPU-{i}" for i in indexes))


def run(records, listing, devices=GPUS, keyed_by="uuid", boot="B", **kw):
    return reconcile(records, listing, devices=devices, keyed_by=keyed_by, boot=boot, now=NOW,
                     **kw)


def by_id(outcome):
    return {r.id: r for r in outcome.kept}


def test_a_listed_container_claims_the_record_with_its_exact_devices():
    out = run([rec("a", 0, 1), rec("b", 2)],
              [listed("ml", "train", "main", 0), listed("ml", "train", "main", 1),  # NUMA split
               listed("ml", "infer", "srv", 2)])
    kept = by_id(out)
    assert kept["a"].pod == PodRef("ml", "train", "main") and kept["a"].confirmed == NOW
    assert kept["b"].pod == PodRef("ml", "infer", "srv")
    assert {r.id for r in out.attributed} == {"a", "b"}
    assert out.dropped == () and out.pending == 0 and out.listed


def test_the_record_of_a_pod_that_ended_is_dropped():
    pod = PodRef("ml", "train", "main")
    out = run([rec("a", 0, pod=pod), rec("b", 1, pod=PodRef("ml", "keep", "c"))],
              [listed("ml", "keep", "c", 1)])
    assert [(r.id, why) for r, why in out.dropped] == [("a", "pod ml/train has ended")]
    assert set(by_id(out)) == {"b"} and out.attributed == ()


def test_a_pod_that_holds_other_devices_now_loses_the_old_record():
    pod = PodRef("ml", "train", "main")
    out = run([rec("a", 0, pod=pod)], [listed("ml", "train", "main", 5)])
    assert [why for _, why in out.dropped] == [f"pod {pod} no longer holds these devices"]


def test_an_unlisted_allocation_waits_for_its_pod_then_gives_up():
    out = run([rec("fresh", 0, t=NOW - 5), rec("old", 1, t=NOW - 301)], [], grace=300)
    assert set(by_id(out)) == {"fresh"} and out.pending == 1
    assert [(r.id, why) for r, why in out.dropped] == [
        ("old", "no pod claimed it within 300 s of the Allocate")]


def test_another_boots_records_stay_only_where_podresources_confirms_them():
    out = run([rec("confirmed", 0, boot="A"), rec("unlisted", 1, boot="A", t=NOW - 1),
               rec("attributed-gone", 2, boot="A", pod=PodRef("x", "y", "z"))],
              [listed("ml", "train", "main", 0)], boot="B")
    assert set(by_id(out)) == {"confirmed"}
    reasons = dict((r.id, why) for r, why in out.dropped)
    assert reasons["unlisted"] == "allocated in another boot (A) and not listed by podresources"
    assert reasons["attributed-gone"] == "pod x/y has ended"


def test_without_a_podresources_answer_nothing_is_dropped_for_pod_reasons():
    records = [rec("a", 0, boot="A"), rec("b", 1, pod=PodRef("x", "y", "z"), t=0.0)]
    out = run(records, None)
    assert out.kept == tuple(records) and out.dropped == () and not out.listed


def test_devices_allocated_twice_belong_to_the_newest_allocate():
    out = run([rec("old", 0, 1, t=NOW - 100), rec("new", 0, 1, t=NOW - 2)],
              [listed("ml", "b", "main", 0, 1)])
    assert by_id(out)["new"].pod == PodRef("ml", "b", "main")
    assert [(r.id, why) for r, why in out.dropped] == [
        ("old", "its devices are now held by ml/b container main")]


def test_a_reused_device_does_not_reattribute_an_ended_pods_record():
    out = run([rec("a", 3, t=NOW - 100, pod=PodRef("ml", "a", "main"))],
              [listed("ml", "b", "main", 3)])
    assert [why for _, why in out.dropped] == ["pod ml/a has ended"]
    assert [r.pod for r in out.kept] == [PodRef("ml", "b", "main")] and out.kept == out.adopted


def test_resources_are_matched_separately():
    out = run([rec("a", 0, resource="nvidia.com/a100")], [listed("ml", "p", "c", 0)])
    assert out.pending == 1 and by_id(out)["a"].pod is None


def test_uuid_key_drops_records_whose_gpu_uuid_is_gone_and_follows_a_moved_index():
    moved = gpus(("GPU-0", 4), ("GPU-X", 1))
    out = run([rec("a", 0), rec("b", 1)], None, devices=moved, keyed_by="uuid")
    assert by_id(out)["a"].gpus == (GpuRef("GPU-0", 4),)
    assert [(r.id, why) for r, why in out.dropped] == [
        ("b", "GPU GPU-1 (index 1) is no longer on this host (checkpointDeviceIDStrategy uuid)")]
    assert [note for _, note in out.rekeyed] == ["GPU GPU-0: index 0 is now 4"]


def test_index_key_keeps_records_across_a_uuid_change():
    changed = gpus(*((f"GPU-new-{i}", i) for i in range(4)))
    pod = PodRef("ml", "train", "main")
    out = run([rec("a", 0, 1, pod=pod), rec("b", 6)], [listed("ml", "train", "main", 0, 1)],
              devices=changed, keyed_by="index")
    kept = by_id(out)
    # kubelet still names the devices by the IDs it was given; the GPUs behind them are new
    assert kept["a"].devices == ("GPU-0", "GPU-1") and kept["a"].pod == pod
    assert kept["a"].gpus == (GpuRef("GPU-new-0", 0), GpuRef("GPU-new-1", 1))
    assert [why for _, why in out.dropped] == ["GPU index 6 (GPU-6) is no longer on this host"]


def test_unknown_gpus_are_not_a_reason_to_drop():
    out = run([rec("a", 7)], None, devices=None)
    assert len(out.kept) == 1 and out.dropped == ()


pods = st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from(["c1", "c2"]),
                          st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True)),
                max_size=6)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True),
                          st.integers(0, 400), st.sampled_from(["A", "B"])), max_size=8), pods)
def test_property_reconciling_again_changes_nothing(allocs, listing_spec):
    """A second pass over the first one's result keeps and attributes the same records; a
    listed container is claimed by at most one record, and only with exactly its devices."""
    records = [rec(f"r{i}", *ids, t=NOW - age, boot=boot)
               for i, (ids, age, boot) in enumerate(allocs)]
    listing = [listed("ns", name, c, *ids) for name, c, ids in listing_spec]
    first = run(records, listing)
    second = run(first.kept, listing)
    assert second.kept == first.kept and second.dropped == () and second.attributed == ()
    claims = [r.pod for r in first.kept if r.pod is not None]
    assert len(claims) == len(set(claims))
    devices = {}
    for e in listing:
        devices.setdefault(e.pod, set()).update(e.device_ids)
    for r in first.kept:
        if r.pod is not None:
            assert set(r.devices) == devices[r.pod]
    assert len(first.kept) - len(first.adopted) + len(first.dropped) == len(records)
    # every listed container has exactly one record now (its own, or an adopted one)
    assert set(claims) == set(devices)


def test_a_listed_container_without_a_record_is_adopted_with_its_gpus():
    out = run([], [listed("ml", "train", "main", 4), listed("ml", "train", "main", 5),
                   listed("ml", "other", "c", 1, resource="example.com/nic"),
                   listed("ml", "old", "c", 9)])
    [adopted] = out.adopted
    assert adopted.pod == PodRef("ml", "train", "main") and adopted.response is None
    assert adopted.devices == ("GPU-4", "GPU-5")
    assert adopted.gpus == (GpuRef("GPU-4", 4), GpuRef("GPU-5", 5))
    assert adopted.time == NOW and adopted.boot == "B" and out.kept == (adopted,)
    # the next pass matches it like any record: same ID, nothing new
    again = run(out.kept, [listed("ml", "train", "main", 4, 5)])
    assert again.kept == out.kept and again.adopted == () and again.attributed == ()
    # no adoption while the advertised devices are not known
    assert run([], [listed("ml", "train", "main", 4)], devices=None).kept == ()
