"""The claims prepared on this node for the DRA driver: read from the API server, checked,
handed to the container runtime as a CDI spec, and recorded before kubelet is answered.

Owns: `Claims.prepare(claim)` and `Claims.unprepare(claim)`, agent.dra.plugin's contract.

- prepare: a claim already recorded is answered as recorded (kubelet repeats the call after
  its own restart); otherwise the ResourceClaim is read (its UID must be the one kubelet
  names), the results of its allocation for this driver and this node's pool are taken, each
  device checked against the devices this node publishes (one it does not: refused, naming
  it), how each device is shared decided (agent.dra.sharing: NVIDIA's opaque GpuConfig and
  MigDeviceConfig, consumable-capacity shares) and applied (a full GPU's time slice set, the
  MPS daemons running, a MIG device made: `actions`), the claim's CDI spec written
  (`<cdi dir>/k8s.gpu.nvidia.com-claim_<uid>.json`: kind `k8s.gpu.nvidia.com/claim`, a device
  `<uid>-<device name>` per device with its device nodes, and for an MPS share its daemon's
  pipe directory, /dev/shm and its limits; the control nodes and NVIDIA_VISIBLE_DEVICES at the
  spec's level: NVIDIA's names, cdi.go:45-46, 200, 300), the claim recorded, and the answer
  given: `k8s.gpu.nvidia.com/claim=<uid>-<device>` per device (device_state.go:827-835), with
  its shareID. A refused claim leaves nothing: no spec, no record, no MIG device made, no MPS
  daemon it alone needed (a time slice set stays set, as with NVIDIA's driver). A partition
  that overlaps a MIG device still prepared for another claim (its pod deleted, kubelet not
  yet done with it) waits up to OVERLAP_WAIT_S for that claim's unprepare (OVERLAP_WAITERS
  prepares at most; an unprepare of the waiting claim ends its wait, with nothing made).
- unprepare: the spec removed, the MIG devices made for it destroyed, then the record, and
  the MPS daemons no claim needs any more told to quit; a claim not recorded is already
  unprepared.
- The record: `dra-claims.msgpack` in the state directory, replaced atomically (fsynced) on
  each change: {uid: [namespace, name, [[requests, pool, device, cdi ids], ...], spec path,
  pods, shares, made]}, pods being the names of the pods the claim was reserved for when it was
  prepared (for status and metrics), shares each device's Share (the MPS daemons the claims
  need follow from them: `mps_plan`), made what `unmake` takes for each MIG device made at
  prepare; records of 0575db6 (no pods) and 434e476 (no shares, nothing made) load. One that
  cannot be read is moved aside (`.bad-<unix time>`) and reported, never overwritten in place.

Must not call NVML (`devices` says what the node has) or decide scheduling.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import msgpack

from agent.dra import sharing
from agent.dra.plugin import ClaimRef, Prepared
from agent.dra.sharing import MPS, Share
from agent.dra.slices import DRIVER
from agent.errors import AgentError, ClaimError, KubeApiError, StateError
from agent.fileio import write_atomic
from agent.rm.sharing import mps_pipe_dir, mps_shm_dir

log = logging.getLogger(__name__)

CDI_KIND = f"k8s.{DRIVER}/claim"
CDI_VERSION = "0.5.0"
STATE_FILE = "dra-claims.msgpack"
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
MPS_PIPE = "/tmp/nvidia-mps"  # NVIDIA's DRA driver's CUDA_MPS_PIPE_DIRECTORY (sharing.go:385)
MPS_MOUNT_OPTIONS = ["rw", "nosuid", "nodev", "bind"]  # sharing.go:386-398
# How long a prepare waits for the claims whose MIG devices overlap its partition to be
# unprepared, under kubelet's 45 s for the call (dra_plugin.go defaultClientCallTimeout)
OVERLAP_WAIT_S = 30.0
# How many prepares may wait so at once: each holds one of agent.dra.plugin's 8 workers, and
# the unprepares they wait for (and the health stream) need workers too
OVERLAP_WAITERS = 4


class NodeDevice(NamedTuple):
    """A device this node publishes: its UUID and the device nodes a container needs, each
    (path in the container, path on the host: under the device root), its type (the slice's
    `type`: gpu or mig), its memory in bytes, and its GPU's index."""

    uuid: str  # of a partition: its GPU's, until it is made
    nodes: tuple[tuple[str, str], ...]
    kind: str = "gpu"
    memory: int = 0
    index: int = -1
    partition: tuple[int, int, int] = ()  # made at prepare: (GI profile ID, start, size)


class NodeActions:
    """What preparing a claim does to the node beyond files, done by agent.dramode:
    `timeslice(gpu uuid, interval)` (nvidia-smi, as NVIDIA's driver), `mps(plan)` (make the
    MPS daemons those of the plan, agent.dra.sharing.mps_plan, and say which are down: UUID ->
    why), where the daemons' pipe directories are (`mps_root`), and `make` / `unmake` of a
    MIG device for a partition. This one refuses each (an empty MPS plan is no MPS)."""

    mps_root = ""

    def timeslice(self, uuid: str, interval: int) -> None:
        raise ClaimError("time-slicing settings are not available here")

    def mps(self, plan: dict) -> dict[str, str]:
        if plan:
            raise ClaimError("MPS is not available here")
        return {}

    def make(self, device: NodeDevice) -> tuple[NodeDevice, list]:
        """Partition `device` made: it as made (its UUID, its capability nodes added) and what
        `unmake` takes to remove it."""
        raise ClaimError("MIG devices cannot be made here")

    def unmake(self, made: list) -> None:
        raise ClaimError("MIG devices cannot be removed here")


def spec_path(cdi_dir: str, uid: str) -> str:
    return os.path.join(cdi_dir, f"{CDI_KIND.replace('/', '-')}_{uid}.json")


def cdi_name(uid: str, device: str, share_id: str = "") -> str:
    """NVIDIA's `<claim uid>-<device>` (cdi.go:200); a share of a shareable GPU adds its
    shareID's first 8 characters (one claim may hold two shares of one device)."""
    return f"{uid}-{device}" + (f"-{share_id[:8]}" if share_id else "")


class Claims:
    """Prepares claims of node `node` with `client` (agent.kubeapi.client.ApiClient);
    `devices()`: the devices the node publishes now, by name."""

    def __init__(self, client: Any, node: str, devices: Callable[[], Mapping[str, NodeDevice]],
                 state_dir: str, cdi_dir: str = "/var/run/cdi", dev_root: str = "/",
                 actions: NodeActions | None = None):
        self.client = client
        self.actions = actions or NodeActions()
        self.node = node
        self.devices = devices
        self.cdi_dir = cdi_dir
        self.dev_root = dev_root
        self.path = os.path.join(state_dir, STATE_FILE)
        self._lock = threading.Lock()
        self._unprepared = threading.Condition(self._lock)  # notified after each unprepare
        self.overlap_wait_s = OVERLAP_WAIT_S
        self.overlap_waiters = OVERLAP_WAITERS
        self._waiting: dict[str, bool] = {}  # claim UID -> unprepared while it waits
        self.prepared: dict[str, list] = self._load()

    # -- prepare ----------------------------------------------------------------------------

    def prepare(self, claim: ClaimRef) -> list[Prepared]:
        with self._lock:
            held = self.prepared.get(claim.uid)
            if held is None:
                results, pods, configs = self._results(claim)
                self._await_overlaps(claim, results)
                held = self.prepared.get(claim.uid)  # a repeated call prepared it meanwhile
            if held is not None:
                return [Prepared(tuple(r), p, d, tuple(c), share.share_id)
                        for (r, p, d, c), share in zip(held[2], _shares(held))]
            known = self.devices()
            where = f"claim {claim.namespace}/{claim.name}"
            shares = sharing.shares(results, configs, known, where)
            for r, s in zip(results, shares):
                if known[r["device"]].partition and s.strategy == MPS:
                    raise ClaimError(f"{where}: MPS on {r['device']}, a MIG device made at "
                                     f"prepare, is not supported (nor by NVIDIA's DynamicMIG)")
            devices, made = self._make(results, known)
            try:
                return self._prepare(claim, results, pods, shares, devices, made)
            except Exception:  # not prepared: nothing left made or running for it
                self._undo(made, any(s.strategy == MPS for s in shares))
                raise

    def _await_overlaps(self, claim: ClaimRef, results: list[dict]) -> None:
        """Wait (the lock released) until no claim prepared here holds a MIG device made at
        prepare that overlaps a partition `claim` asks for. The scheduler allocated the
        partition, so those claims are deallocated and kubelet unprepares them once their
        pods are gone (a pod deleted at once goes from the API server before kubelet has
        stopped it); failing instead would leave the claim's pod to kubelet's next sync, a
        minute later. ClaimError, naming them, after `overlap_wait_s`, at once when
        `overlap_waiters` prepares wait already, and when kubelet unprepares `claim` itself
        meanwhile (it gave up on the call: a device made now would never be unprepared)."""
        where = f"claim {claim.namespace}/{claim.name}"
        holders = self._overlapping(claim.uid, results, self.devices())
        if not holders:
            return
        if len(self._waiting) >= self.overlap_waiters or claim.uid in self._waiting:
            raise ClaimError(f"{where}: its MIG device overlaps those of {', '.join(holders)}, "
                             f"still prepared on this node ({len(self._waiting)} prepares "
                             f"wait already)")
        log.info("%s waits for %s to be unprepared: their MIG devices overlap its own", where,
                 ", ".join(holders))
        deadline = time.monotonic() + self.overlap_wait_s
        self._waiting[claim.uid] = False
        try:
            while holders:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ClaimError(f"{where}: its MIG device overlaps those of "
                                     f"{', '.join(holders)}, still prepared on this node "
                                     f"after {self.overlap_wait_s:g} s")
                self._unprepared.wait(left)
                if self._waiting[claim.uid]:  # kubelet gave up on it: nothing is made
                    raise ClaimError(f"{where}: unprepared while its prepare waited")
                holders = self._overlapping(claim.uid, results, self.devices())
        finally:
            del self._waiting[claim.uid]

    def _overlapping(self, uid: str, results: list[dict], known: Mapping[str, NodeDevice]
                     ) -> list[str]:
        """The claims prepared here (not `uid`) holding a MIG device made at prepare that
        shares a memory slice with a partition of `results`, as namespace/name."""
        wanted = [known[r["device"]] for r in results
                  if r["device"] in known and known[r["device"]].partition]
        if not wanted:
            return []
        out = []
        for other, held in self.prepared.items():
            mine = [known[d[2]] for d, m in zip(held[2], held[6] if len(held) > 6 else ())
                    if m and d[2] in known and known[d[2]].partition]
            if other != uid and any(_overlap(a, b) for a in wanted for b in mine):
                out.append(f"{held[0]}/{held[1]}")
        return sorted(out)

    def _make(self, results: list[dict], known: Mapping[str, NodeDevice]
              ) -> tuple[dict[str, NodeDevice], list[list]]:
        """The claim's devices, its partitions made (what unmake takes, per result)."""
        devices, made = dict(known), []
        try:
            for r in results:
                if known[r["device"]].partition:
                    devices[r["device"]], m = self.actions.make(known[r["device"]])
                    made.append(m)
                else:
                    made.append([])
        except Exception:
            self._undo(made, False)
            raise
        return devices, made

    def _undo(self, made: list[list], mps: bool) -> None:
        """After a failed prepare: the MIG devices it made destroyed, the MPS daemons back to
        what the prepared claims need; a failure here is logged (the prepare's own error is
        what kubelet is told)."""
        try:
            for m in made:
                if m:
                    self.actions.unmake(m)
            if mps:
                self.sync_mps()
        except AgentError as exc:
            log.error("undoing a failed prepare: %s", exc)

    def _prepare(self, claim: ClaimRef, results: list[dict], pods: list[str],
                 shares: list[Share], known: Mapping[str, NodeDevice], made: list[list]
                 ) -> list[Prepared]:
        spec = spec_path(self.cdi_dir, claim.uid)
        answer = [Prepared((r["request"],), r["pool"], r["device"],
                           (f"{CDI_KIND}={cdi_name(claim.uid, r['device'], s.share_id)}",),
                           s.share_id)
                  for r, s in zip(results, shares)]
        record = [claim.namespace, claim.name,
                  [[list(p.requests), p.pool, p.device, list(p.cdi_ids)] for p in answer],
                  spec, pods, [s.record() for s in shares], made]
        self._share(results, shares, known, {**self.prepared, claim.uid: record})
        self._write_spec(claim.uid, spec, results, shares, known)
        try:
            self._save({**self.prepared, claim.uid: record})
        except StateError:
            _remove(spec)  # not recorded: not prepared either
            raise
        log.info("claim %s/%s (%s) prepared: %s", claim.namespace, claim.name, claim.uid,
                 ", ".join(p.device + (f" ({s.strategy})" if s.strategy else "")
                           for p, s in zip(answer, shares)))
        return answer

    def _share(self, results: list[dict], shares: list[Share], known: Mapping[str, NodeDevice],
               prepared: dict[str, list]) -> None:
        """Apply the claim's shares before kubelet is told: a time slice set on each full GPU
        shared by TimeSlicing, and the MPS daemons of `prepared` (with the claim) running."""
        for r, s in zip(results, shares):
            if s.interval:
                self.actions.timeslice(known[r["device"]].uuid, sharing.INTERVALS[s.interval])
        if not any(s.strategy == MPS for s in shares):
            return
        down = self.actions.mps(self.mps_plan(prepared))
        for r, s in zip(results, shares):
            why = down.get(known[r["device"]].uuid) if s.strategy == MPS else None
            if why:
                raise ClaimError(f"the MPS control daemon of {r['device']} is not running: "
                                 f"{why}")

    def mps_plan(self, prepared: dict[str, list] | None = None) -> dict:
        """The MPS daemons the prepared claims need (agent.dra.sharing.mps_plan)."""
        known = self.devices()
        held = self.prepared if prepared is None else prepared
        return sharing.mps_plan((known[d[2]], share) for v in held.values()
                                for d, share in zip(v[2], _shares(v)) if d[2] in known)

    def sync_mps(self) -> None:
        """Make the MPS daemons those the recorded claims need (at start: adopt them; after
        an unprepare or a failed prepare: quit those no claim needs)."""
        self.actions.mps(self.mps_plan())

    def _results(self, claim: ClaimRef) -> tuple[list[dict], list[str], list]:
        """The claim's allocation results for this driver on this node, checked, the names of
        the pods it is reserved for, and its configs for this driver
        (agent.dra.sharing.read_configs)."""
        path = (f"/apis/resource.k8s.io/v1/namespaces/{claim.namespace}/resourceclaims/"
                f"{claim.name}")
        try:
            doc = self.client.request("GET", path)
        except KubeApiError as exc:
            raise ClaimError(f"claim {claim.namespace}/{claim.name}: {exc}") from None
        uid = doc.get("metadata", {}).get("uid")
        if uid != claim.uid:
            raise ClaimError(f"claim {claim.namespace}/{claim.name} is {uid}, not {claim.uid} "
                             f"(deleted and made again)")
        allocation = (doc.get("status") or {}).get("allocation") or {}
        devices = allocation.get("devices") or {}
        configs = sharing.read_configs(devices.get("config") or [],
                                       f"claim {claim.namespace}/{claim.name}")
        ours = [r for r in devices.get("results") or [] if r.get("driver") == DRIVER]
        if not ours:
            raise ClaimError(f"claim {claim.namespace}/{claim.name} has no device of {DRIVER} "
                             f"allocated")
        known = self.devices()
        for r in ours:
            if r.get("pool") != self.node or r.get("device") not in known:
                raise ClaimError(f"claim {claim.namespace}/{claim.name} asks for device "
                                 f"{r.get('device')} of pool {r.get('pool')}, which node "
                                 f"{self.node} does not have")
        pods = [r.get("name", "") for r in (doc.get("status") or {}).get("reservedFor") or []
                if r.get("resource") == "pods"]
        return ours, pods, configs

    def _write_spec(self, uid: str, path: str, results: list[dict], shares: list[Share],
                    known: Mapping[str, NodeDevice]) -> None:
        spec = {
            "cdiVersion": CDI_VERSION,
            "kind": CDI_KIND,
            "devices": [{"name": cdi_name(uid, r["device"], s.share_id), "containerEdits": {
                "deviceNodes": [_node(c, h) for c, h in known[r["device"]].nodes],
                **self._mps_edits(known[r["device"]], s)}}
                for r, s in zip(results, shares)],
            "containerEdits": {
                "env": ["NVIDIA_VISIBLE_DEVICES=" +
                        ",".join(known[r["device"]].uuid for r in results)],
                "deviceNodes": [_node(n, h) for n in CONTROL_NODES
                                if os.path.exists(h := os.path.join(self.dev_root,
                                                                    n.lstrip("/")))],
            },
        }
        try:
            os.makedirs(self.cdi_dir, exist_ok=True)
            write_atomic(path, json.dumps(spec, indent=2).encode(), mode=0o644)
        except OSError as exc:
            raise ClaimError(f"cannot write the claim's CDI spec {path}: {exc}") from None

    def _mps_edits(self, device: NodeDevice, share: Share) -> dict:
        """An MPS share's container: its daemon's pipe directory and /dev/shm (as NVIDIA's
        driver mounts them, sharing.go:381-400) and its limits in its environment (a client
        may lower the daemon's defaults, not raise them; the container sees its device as
        device 0)."""
        if share.strategy != MPS:
            return {}
        root = self.actions.mps_root
        threads = 100 if share.threads is None else share.threads
        memory = device.memory >> 20 if share.memory_mib is None else share.memory_mib
        return {
            "env": [f"CUDA_MPS_PIPE_DIRECTORY={MPS_PIPE}",
                    f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={threads}",
                    f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={memory}M"],
            "mounts": [{"hostPath": mps_pipe_dir(root, device.uuid), "containerPath": MPS_PIPE,
                        "options": MPS_MOUNT_OPTIONS},
                       {"hostPath": mps_shm_dir(root), "containerPath": "/dev/shm",
                        "options": MPS_MOUNT_OPTIONS}],
        }

    def listing(self) -> list[dict]:
        """The prepared claims as status and the metrics show them, sorted."""
        with self._lock:
            held = list(self.prepared.items())
        return sorted(({"namespace": v[0], "name": v[1], "uid": uid,
                        "devices": [d[2] for d in v[2]], "pods": v[4] if len(v) > 4 else [],
                        "sharing": [s.strategy or "exclusive" for s in _shares(v)]}
                       for uid, v in held), key=lambda c: (c["namespace"], c["name"]))

    # -- unprepare ----------------------------------------------------------------------------

    def unprepare(self, claim: ClaimRef) -> None:
        with self._lock:
            held = self.prepared.get(claim.uid)
            if held is None:  # never prepared here, or unprepared already
                if claim.uid in self._waiting:  # its prepare waits: it ends, making nothing
                    self._waiting[claim.uid] = True
                    self._unprepared.notify_all()
                return
            try:
                _remove(held[3])
            except OSError as exc:
                raise ClaimError(f"cannot remove the claim's CDI spec {held[3]}: {exc}") \
                    from None
            for m in held[6] if len(held) > 6 else ():
                if m:  # failing: kubelet calls again; one already gone is skipped
                    self.actions.unmake(m)
            self._save({k: v for k, v in self.prepared.items() if k != claim.uid})
            self._unprepared.notify_all()
            log.info("claim %s/%s (%s) unprepared", claim.namespace, claim.name, claim.uid)
            if any(share.strategy == MPS for share in _shares(held)):
                self.sync_mps()  # a daemon no claim needs any more quits

    # -- the record ---------------------------------------------------------------------------

    def _save(self, prepared: dict[str, list]) -> None:
        try:
            write_atomic(self.path, msgpack.packb(prepared, use_bin_type=True))
        except OSError as exc:
            raise StateError(f"cannot record the prepared claims in {self.path}: {exc}") \
                from None
        self.prepared = prepared

    def _load(self) -> dict[str, list]:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return {}
        try:
            prepared = msgpack.unpackb(raw, raw=False)
            if not isinstance(prepared, dict) or not all(
                    isinstance(v, list) and 4 <= len(v) <= 7 for v in prepared.values()):
                raise ValueError("not a map of claim UID to [namespace, name, devices, spec, "
                                 "pods, shares, made]")
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            aside = f"{self.path}.bad-{int(time.time())}"
            os.replace(self.path, aside)
            log.error("the prepared claims in %s cannot be read (%s): kept aside as %s; "
                      "claims prepared before are prepared again when kubelet asks",
                      self.path, exc, aside)
            return {}
        return prepared


def _shares(record: list) -> list[Share]:
    """The Share of each device of a record (one of 0575db6 or 434e476 has none: exclusive)."""
    if len(record) > 5:
        return [Share(*share) for share in record[5]]
    return [Share() for _ in record[2]]


def _overlap(a: NodeDevice, b: NodeDevice) -> bool:
    """Partitions `a` and `b` share a memory slice of one GPU."""
    (_, start_a, size_a), (_, start_b, size_b) = a.partition, b.partition
    return a.index == b.index and start_a < start_b + size_b and start_b < start_a + size_a


def _node(path: str, host: str) -> dict:
    return {"path": path} if path == host else {"path": path, "hostPath": host}


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
