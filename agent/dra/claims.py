"""The claims prepared on this node for the DRA driver: read from the API server, checked,
handed to the container runtime as a CDI spec, and recorded before kubelet is answered.

Owns: `Claims.prepare(claim)` and `Claims.unprepare(claim)`, agent.dra.plugin's contract.

- prepare: a claim already recorded is answered as recorded (kubelet repeats the call after
  its own restart); otherwise the ResourceClaim is read (its UID must be the one kubelet
  names), the results of its allocation for this driver and this node's pool are taken, each
  device checked against the devices this node publishes (one it does not: refused, naming
  it), an opaque config for this driver refused (none is taken yet: the kind is named), the
  claim's CDI spec written (`<cdi dir>/k8s.gpu.nvidia.com-claim_<uid>.json`: kind
  `k8s.gpu.nvidia.com/claim`, a device `<uid>-<device name>` per device with its device nodes,
  the control nodes and NVIDIA_VISIBLE_DEVICES at the spec's level: NVIDIA's names, cdi.go:45-46,
  200, 300), the claim recorded, and the answer given: `k8s.gpu.nvidia.com/claim=<uid>-<device>`
  per device (device_state.go:827-835). A refused claim writes nothing.
- unprepare: the spec removed, then the record; a claim not recorded is already unprepared.
- The record: `dra-claims.msgpack` in the state directory, replaced atomically (fsynced) on
  each change: {uid: [namespace, name, [[requests, pool, device, cdi ids], ...], spec path,
  pods]}, pods being the names of the pods the claim was reserved for when it was prepared
  (for status and metrics; a record of 0575db6 has no pods and loads). One that cannot be
  read is moved aside (`.bad-<unix time>`) and reported, never overwritten in place.

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

from agent.dra.plugin import ClaimRef, Prepared
from agent.dra.slices import DRIVER
from agent.errors import AgentError, KubeApiError, StateError
from agent.fileio import write_atomic

log = logging.getLogger(__name__)

CDI_KIND = f"k8s.{DRIVER}/claim"
CDI_VERSION = "0.5.0"
STATE_FILE = "dra-claims.msgpack"
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


class ClaimError(AgentError):
    """A claim that cannot be prepared as asked (kubelet shows it in the pod's events)."""


class NodeDevice(NamedTuple):
    """A device this node publishes: its UUID and the device nodes a container needs, each
    (path in the container, path on the host: under the device root)."""

    uuid: str
    nodes: tuple[tuple[str, str], ...]


def spec_path(cdi_dir: str, uid: str) -> str:
    return os.path.join(cdi_dir, f"{CDI_KIND.replace('/', '-')}_{uid}.json")


def cdi_name(uid: str, device: str) -> str:
    return f"{uid}-{device}"


class Claims:
    """Prepares claims of node `node` with `client` (agent.kubeapi.client.ApiClient);
    `devices()`: the devices the node publishes now, by name."""

    def __init__(self, client: Any, node: str, devices: Callable[[], Mapping[str, NodeDevice]],
                 state_dir: str, cdi_dir: str = "/var/run/cdi", dev_root: str = "/"):
        self.client = client
        self.node = node
        self.devices = devices
        self.cdi_dir = cdi_dir
        self.dev_root = dev_root
        self.path = os.path.join(state_dir, STATE_FILE)
        self._lock = threading.Lock()
        self.prepared: dict[str, list] = self._load()

    # -- prepare ----------------------------------------------------------------------------

    def prepare(self, claim: ClaimRef) -> list[Prepared]:
        with self._lock:
            held = self.prepared.get(claim.uid)
            if held is not None:
                return [Prepared(tuple(r), p, d, tuple(c)) for r, p, d, c in held[2]]
            results, pods = self._results(claim)
            spec = spec_path(self.cdi_dir, claim.uid)
            answer = [Prepared((r["request"],), r["pool"], r["device"],
                               (f"{CDI_KIND}={cdi_name(claim.uid, r['device'])}",))
                      for r in results]
            self._write_spec(claim.uid, spec, results)
            try:
                self._save({**self.prepared, claim.uid: [
                    claim.namespace, claim.name,
                    [[list(p.requests), p.pool, p.device, list(p.cdi_ids)] for p in answer],
                    spec, pods]})
            except StateError:
                _remove(spec)  # not recorded: not prepared either
                raise
            log.info("claim %s/%s (%s) prepared: %s", claim.namespace, claim.name, claim.uid,
                     ", ".join(p.device for p in answer))
            return answer

    def _results(self, claim: ClaimRef) -> tuple[list[dict], list[str]]:
        """The claim's allocation results for this driver on this node, checked, and the
        names of the pods it is reserved for."""
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
        for config in devices.get("config") or []:
            opaque = config.get("opaque") or {}
            if opaque.get("driver") == DRIVER:
                params = opaque.get("parameters") or {}
                raise ClaimError(
                    f"claim {claim.namespace}/{claim.name}: opaque config "
                    f"{params.get('apiVersion', '?')} {params.get('kind', '?')} for {DRIVER} "
                    f"is not supported by gpu-agent yet")
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
        return ours, pods

    def _write_spec(self, uid: str, path: str, results: list[dict]) -> None:
        known = self.devices()
        spec = {
            "cdiVersion": CDI_VERSION,
            "kind": CDI_KIND,
            "devices": [{"name": cdi_name(uid, r["device"]), "containerEdits": {
                "deviceNodes": [_node(c, h) for c, h in known[r["device"]].nodes]}}
                for r in results],
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

    def listing(self) -> list[dict]:
        """The prepared claims as status and the metrics show them, sorted."""
        with self._lock:
            held = list(self.prepared.items())
        return sorted(({"namespace": v[0], "name": v[1], "uid": uid,
                        "devices": [d[2] for d in v[2]], "pods": v[4] if len(v) > 4 else []}
                       for uid, v in held), key=lambda c: (c["namespace"], c["name"]))

    # -- unprepare ----------------------------------------------------------------------------

    def unprepare(self, claim: ClaimRef) -> None:
        with self._lock:
            held = self.prepared.get(claim.uid)
            if held is None:
                return  # never prepared here, or unprepared already
            try:
                _remove(held[3])
            except OSError as exc:
                raise ClaimError(f"cannot remove the claim's CDI spec {held[3]}: {exc}") \
                    from None
            self._save({k: v for k, v in self.prepared.items() if k != claim.uid})
            log.info("claim %s/%s (%s) unprepared", claim.namespace, claim.name, claim.uid)

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
                    isinstance(v, list) and len(v) in (4, 5) for v in prepared.values()):
                raise ValueError("not a map of claim UID to [namespace, name, devices, spec, "
                                 "pods]")
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            aside = f"{self.path}.bad-{int(time.time())}"
            os.replace(self.path, aside)
            log.error("the prepared claims in %s cannot be read (%s): kept aside as %s; "
                      "claims prepared before are prepared again when kubelet asks",
                      self.path, exc, aside)
            return {}
        return prepared


def _node(path: str, host: str) -> dict:
    return {"path": path} if path == host else {"path": path, "hostPath": host}


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
