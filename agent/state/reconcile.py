"""Reconciliation: which recorded allocations still stand, and which pod each one serves.

Owns: the rules, as a pure function of plain data (`reconcile`): the records, what kubelet's
podresources List reported (`PodDevices`, or None when it could not be asked), the GPUs on the
host now (or None before discovery), the checkpoint key strategy, this boot's ID and the time.
It returns an `Outcome`: the records kept (attributed, re-keyed, adopted), those dropped with
the reason, and what changed. Also who holds each device, from a listing or from the records
(`holders_listed`, `holders_recorded`: the metrics, the status and the fault events read it).
Must not talk to kubelet, NVML or files; agent.kubelet.podresources asks kubelet and
agent.state.journal applies the outcome.

The rules (docs/state.md says them for operators):
1. GPUs (when the advertised devices are known): under key `uuid` a record's GPU is found by
   UUID (its index is updated if it moved); under `index` by index (its UUID is updated if it
   changed, e.g. after a VM's cold migration). A record with a GPU not found is dropped.
2. Pods (when podresources answered): kubelet lists each container's device IDs per resource.
   Records are matched newest first on resource and the exact set of device IDs; each listed
   container claims at most one record. A matched record gets the pod and `confirmed`.
3. A record attributed before and not matched now is dropped once it has gone unmatched for
   `ended_grace` seconds (`agent.endedPodGrace`; the listings since then agree): its pod ended (or no
   longer holds those devices). A restarted kubelet lists its running pods only once it has read
   them from the API server again (a real kubelet 1.34 and 1.37: about 0.4 s here, longer with a
   slow API server); one listing without them is no proof. An unattributed record is dropped when it comes from another boot, when
   its devices are now held by another container, or when it stayed unattributed longer than
   `grace` seconds; otherwise it is kept as pending (kubelet lists a container's devices only
   after Allocate has returned).
4. Without a podresources answer no record is dropped for pod reasons: not even those of
   another boot, which wait for the first answer.
5. A listed container no record matches, holding only devices the agent advertises now, is
   adopted: a record with its pod, the GPUs behind its devices and no response (the agent
   never saw it: the checkpoint was set aside, or the pod predates gpu-agent).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from agent.gcpause import paused
from agent.state.checkpoint import GpuRef, PodRef, Record, by_age, from_fields

# An Allocate that no pod claims within this long was not followed by a running container
# (kubelet failed the admission after Allocate, or something other than kubelet called us).
UNATTRIBUTED_GRACE_S = 300.0


class PodDevices(NamedTuple):
    """One container's devices of one resource, as podresources List reports them (kubelet
    may split them into several ContainerDevices by NUMA node; those are merged here). A
    tuple: a listing names every GPU container of the node."""

    namespace: str
    name: str
    container: str
    resource: str
    device_ids: tuple[str, ...]

    @property
    def pod(self) -> PodRef:
        return PodRef(self.namespace, self.name, self.container)


# (resource, device ID) -> the containers holding it: (namespace, pod, container) each
Holders = dict[tuple[str, str], list[tuple[str, str, str]]]


def holders_listed(listing: Iterable[PodDevices]) -> Holders:
    """Who holds each device, as a podresources listing says now."""
    out: Holders = {}
    for p in listing:
        for device_id in p.device_ids:
            out.setdefault((p.resource, device_id), []).append((p.namespace, p.name,
                                                                p.container))
    return out


def holders_recorded(records: Iterable[Record]) -> Holders:
    """Who holds each device, as the records attributed to pods say (no kubelet call)."""
    out: Holders = {}
    for r in records:
        if r.pod is not None:
            for device_id in r.devices:
                out.setdefault((r.resource, device_id), []).append(tuple(r.pod))
    return out


@dataclass(frozen=True)
class Outcome:
    """What one reconciliation decided."""

    kept: tuple[Record, ...]
    dropped: tuple[tuple[Record, str], ...]  # (record as it was, why)
    attributed: tuple[Record, ...]  # kept records that got a pod (or another pod) this time
    adopted: tuple[Record, ...]  # new records for listed containers no record matched
    rekeyed: tuple[tuple[Record, str], ...]  # kept records whose GPU UUID/index was updated
    pending: int  # kept records no pod has claimed yet
    listed: bool  # podresources answered
    # kept attributed records their pod's listing lacked: record ID -> since when (rule 3)
    missing: Mapping[str, float] = field(default_factory=dict)


def merge_listing(entries: Iterable[PodDevices]) -> list[PodDevices]:
    """Entries of the same container and resource merged (device IDs in first-seen order)."""
    merged: dict[tuple, PodDevices] = {}
    for e in entries:
        key = e[:4]  # namespace, name, container, resource
        seen = merged.get(key)
        if seen is None:
            merged[key] = e  # most containers come in one piece: kept as it is
        else:
            ids = list(seen.device_ids)
            ids.extend(d for d in e.device_ids if d not in ids)
            merged[key] = PodDevices(*key, tuple(ids))
    return list(merged.values())


def _resolve_gpus(gpus: tuple[GpuRef, ...], by_uuid: dict, by_index: dict, keyed_by: str
                  ) -> tuple[tuple[GpuRef, ...] | None, str]:
    """(the GPUs resolved, a note of what changed) or (None, why the record is dropped)."""
    table = by_index if keyed_by == "index" else by_uuid
    if all(table.get(g.index if keyed_by == "index" else g.uuid) == g for g in gpus):
        return gpus, ""  # the usual case: every GPU where it was
    out, notes = [], []
    for g in gpus:
        if keyed_by == "index":
            now = by_index.get(g.index)
            if now is None:
                return None, f"GPU index {g.index} ({g.uuid}) is no longer on this host"
            if now.uuid != g.uuid:
                notes.append(f"GPU {g.index}: UUID {g.uuid} is now {now.uuid}")
        else:
            now = by_uuid.get(g.uuid)
            if now is None:
                return None, (f"GPU {g.uuid} (index {g.index}) is no longer on this host "
                              f"(checkpointDeviceIDStrategy uuid)")
            if now.index != g.index:
                notes.append(f"GPU {g.uuid}: index {g.index} is now {now.index}")
        out.append(GpuRef(now.uuid, now.index))
    return (tuple(out), "; ".join(notes)) if notes else (gpus, "")


def adopted_id(e: PodDevices) -> str:
    """A stable record ID for an adopted container (the same on every reconciliation)."""
    import hashlib  # here: it loads OpenSSL (3.8 MB), and only an adoption needs it

    key = "\0".join((e.resource, e.namespace, e.name, e.container, *sorted(e.device_ids)))
    return "pr-" + hashlib.sha256(key.encode()).hexdigest()[:29]


def reconcile(records: Sequence[Record], listing: Sequence[PodDevices] | None, *,
              devices: Mapping[str, Sequence[Any]] | None, keyed_by: str, boot: str,
              now: float, grace: float = UNATTRIBUTED_GRACE_S,
              protected: AbstractSet[str] = frozenset(), ended_grace: float = 0.0,
              missing: Mapping[str, float] | None = None) -> Outcome:
    """Apply the rules of this module to `records`. `devices`: the devices advertised now by
    resource (objects with `.id`, `.gpu_uuid` and `.gpu_index`, agent.rm.devices.Device),
    or None when not known yet; `listing`: podresources' answer, or None when it could not
    be had. Records in `protected` (appended after the listing was asked for) are kept as they
    are, and a listed container with one of their device sets is not adopted: a listing older
    than a record cannot tell its container from the devices' previous holder. `missing` is
    the previous outcome's (since when each attributed record went unlisted); such a record is
    dropped once that is `ended_grace` seconds ago (0: at the first listing without it)."""
    with paused():  # records made by the thousand (agent.gcpause)
        return _reconcile(records, listing, devices, keyed_by, boot, now, grace, protected,
                          ended_grace, missing or {})


def _reconcile(records: Sequence[Record], listing: Sequence[PodDevices] | None,
               devices: Mapping[str, Sequence[Any]] | None, keyed_by: str, boot: str,
               now: float, grace: float, protected: AbstractSet[str], ended_grace: float,
               missing: Mapping[str, float]) -> Outcome:
    dropped: list[tuple[Record, str]] = []
    rekeyed: list[tuple[Record, str]] = []
    current: list[Record] = []
    if devices is not None:
        gpus = {GpuRef(d.gpu_uuid, int(d.gpu_index)) for ds in devices.values() for d in ds}
        by_uuid = {g.uuid: g for g in gpus}
        by_index = {g.index: g for g in gpus}
        # records share a few GPU tuples (one per GPU set handed out): each resolved once
        resolved_sets: dict[tuple[GpuRef, ...], tuple[tuple[GpuRef, ...] | None, str]] = {}
        for r in records:
            known = resolved_sets.get(r.gpus)
            if known is None:
                known = resolved_sets[r.gpus] = _resolve_gpus(r.gpus, by_uuid, by_index,
                                                              keyed_by)
            resolved, note = known
            if resolved is None:
                dropped.append((r, note))
                continue
            if note:
                r = r._replace(gpus=resolved)
                rekeyed.append((r, note))
            current.append(r)
    else:
        current = list(records)

    if listing is None:
        pending = sum(1 for r in current if r.pod is None)
        return Outcome(tuple(current), tuple(dropped), (), (), tuple(rekeyed), pending, False,
                       dict(missing))

    merged = merge_listing(listing)
    # resource -> device set -> the unclaimed containers listing exactly it, each with its
    # place in the listing (a dict: ordered, O(1) membership and removal when claimed)
    by_set: dict[str, dict[frozenset, dict[PodRef, int]]] = {}
    owner: dict[str, dict[str, PodRef]] = {}  # resource -> device ID -> its container
    frozen: dict[tuple[str, ...], frozenset] = {}  # a few device lists, each made a set once

    def as_set(ids: tuple[str, ...]) -> frozenset:
        got = frozen.get(ids)
        if got is None:
            got = frozen[ids] = frozenset(ids)
        return got

    for i, e in enumerate(merged):
        pod = from_fields(PodRef, e[:3])  # namespace, name, container
        sets = by_set.get(e.resource)
        if sets is None:
            sets = by_set[e.resource] = {}
            owner[e.resource] = {}
        fs = as_set(e.device_ids)
        pods = sets.get(fs)
        if pods is None:
            pods = sets[fs] = {}
        pods[pod] = i
        owned = owner[e.resource]
        for d in e.device_ids:
            owned[d] = pod
    no_sets: dict = {}
    kept: list[Record] = []
    attributed: list[Record] = []
    unlisted: dict[str, float] = {}
    pending = 0
    live_pods: set[tuple[str, str]] | None = None
    # newest first: when a device set was allocated twice, the latest Allocate is the one the
    # running container got
    # (ties are judged in reverse and kept in the order they came: a second pass over the
    # kept records finds them in the same order)
    for r in reversed(sorted(current, key=by_age)):
        if r.id in protected:  # newer than the listing: the next pass judges it
            kept.append(r)
            pending += r.pod is None
            continue
        candidates = by_set.get(r.resource, no_sets).get(as_set(r.devices), no_sets)
        match = None
        if r.pod is not None:
            if candidates and candidates.pop(r.pod, None) is not None:
                match = r.pod
        elif candidates:
            match = next(iter(candidates))
            del candidates[match]
        if match is not None:
            if r.pod is match:
                kept.append(from_fields(Record, (*r[:8], now)))
            else:
                updated = from_fields(Record, (*r[:7], match, now))
                kept.append(updated)
                attributed.append(updated)
            continue
        if r.pod is not None:
            since = missing.get(r.id, now)
            if now - since < ended_grace:  # one listing without it is no proof (rule 3)
                unlisted[r.id] = since
                kept.append(r)
                continue
            if live_pods is None:  # only a record whose pod is gone needs them
                live_pods = {e[:2] for e in merged}  # (namespace, name)
            if r.pod[:2] in live_pods:
                why = f"pod {r.pod} no longer holds these devices"
            else:
                why = f"pod {r.pod.namespace}/{r.pod.name} has ended"
            dropped.append((r, why))
            continue
        owned = owner.get(r.resource, no_sets)
        holder = next((owned[d] for d in r.devices if d in owned), None)
        if r.boot != boot:
            dropped.append((r, f"allocated in another boot ({r.boot or 'unknown'}) and not "
                               f"listed by podresources"))
        elif holder is not None:
            dropped.append((r, f"its devices are now held by {holder}"))
        elif now - r.time > grace:
            dropped.append((r, f"no pod claimed it within {grace:g} s of the Allocate"))
        else:
            kept.append(r)
            pending += 1
    adopted = []
    # a listed container with the device set of a record newer than the listing may be that
    # record's (or the devices' previous holder): neither is decided on this listing
    fresh_sets = {(r.resource, frozenset(r.devices)) for r in current if r.id in protected} \
        if protected else set()
    unclaimed = sorted(i for sets in by_set.values() for pods in sets.values()
                       for i in pods.values())
    for e in (merged[i] for i in unclaimed) if devices is not None else ():
        if (e.resource, frozenset(e.device_ids)) in fresh_sets:
            continue
        known = {d.id: d for d in devices.get(e.resource, ())}
        if not e.device_ids or any(d not in known for d in e.device_ids):
            continue  # another plugin's resource, or devices we do not advertise (any more)
        adopted.append(Record(
            id=adopted_id(e), resource=e.resource, devices=e.device_ids,
            gpus=tuple(GpuRef(known[d].gpu_uuid, int(known[d].gpu_index)) for d in e.device_ids),
            response=None, time=now, boot=boot, pod=e.pod, confirmed=now))
    kept.reverse()  # oldest first, as they came
    if adopted:
        kept += adopted
        kept.sort(key=by_age)  # two runs already in order: close to linear
    if rekeyed:
        kept_ids = {r.id for r in kept}
        rekeyed = [(r, note) for r, note in rekeyed if r.id in kept_ids]
    return Outcome(tuple(kept), tuple(dropped), tuple(attributed), tuple(adopted),
                   tuple(rekeyed), pending, True, unlisted)
