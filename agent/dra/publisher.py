"""This node's ResourceSlice, kept as its devices are, through the Kubernetes API server.

Owns: `SlicePublisher.publish(devices, more)`: the node's slice (named `<node>-gpu.nvidia.com`,
owned by the Node so that it goes when the Node does), and the slices of GPUs partitioned on
demand beside it (`<node>-gpu.nvidia.com-<suffix>`: their shared counters, their devices),
created, or replaced all with the pool's generation one higher when one differs from what the
API server holds (the scheduler takes a pool only when all its slices are of one generation);
nothing written when they are the same, so an agent restarted on an unchanged node rewrites
nothing, and a generation never goes back (the scheduler uses only the newest generation of a
pool). A conflict (the slice changed since it was read) is raised and forgets what was read: the
next call reads again. Must not read NVML (agent.dra.slices builds the devices) or retry (the
caller decides when).
"""

from __future__ import annotations

import logging
from typing import Any

from agent.dra.slices import API_VERSION, DRIVER, slice_spec
from agent.errors import KubeApiError

log = logging.getLogger(__name__)

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def slice_name(node: str) -> str:
    return f"{node}-{DRIVER}"


class SlicePublisher:
    """Publishes node `node`'s devices with `client` (agent.kubeapi.client.ApiClient)."""

    def __init__(self, client: Any, node: str):
        self.client = client
        self.node = node
        self.name = slice_name(node)
        self._held: dict | None = None  # the slice as last read or written; None: read it
        self._owner: dict | None = None
        self.generation = 0  # of the slice the API server holds, as far as known
        self.writes = 0

    def publish(self, devices: list[dict], more: dict[str, dict] | None = None) -> bool:
        """Make the slices hold `devices` and `more` (name suffix -> {"devices": [...]} or
        {"counters": [...]}, each a slice `<node>-gpu.nvidia.com-<suffix>` of the same pool
        and generation; one not asked for any more is deleted); True when one was written.
        KubeApiError when the API server cannot be reached or refuses (409: changed
        meanwhile; call again)."""
        want = {self.name: {"devices": devices},
                **{f"{self.name}-{k}": v for k, v in (more or {}).items()}}
        held = self._held if self._held is not None else self._read()
        if set(held) == set(want) and all(_holds(held[n], content, self.node, len(want))
                                          for n, content in want.items()):
            self._held = held
            return False
        generation = max((h["spec"]["pool"]["generation"] for h in held.values()),
                         default=0) + 1
        written: dict[str, dict] = {}
        try:
            for name, content in want.items():
                body = {
                    "apiVersion": API_VERSION, "kind": "ResourceSlice",
                    "metadata": {"name": name, "ownerReferences": [self._node_owner()]},
                    "spec": slice_spec(self.node, content.get("devices"), generation,
                                       len(want), content.get("counters")),
                }
                if name in held:
                    body["metadata"]["resourceVersion"] = held[name]["metadata"][
                        "resourceVersion"]
                    written[name] = self.client.request("PUT", f"{SLICES}/{name}", body)
                else:
                    written[name] = self.client.request("POST", SLICES, body)
            for name in sorted(set(held) - set(want)):
                self.client.request("DELETE", f"{SLICES}/{name}")
        except KubeApiError:
            self._held = None  # whatever happened, read the slices again next time
            raise
        self._held = written
        self.generation = generation
        self.writes += 1
        log.info("ResourceSlice %s: %d devices, pool generation %d%s", self.name,
                 sum(len(c.get("devices") or ()) for c in want.values()), generation,
                 f", {len(want)} slices" if len(want) > 1 else "")
        return True

    def forget(self) -> None:
        """Read the slice again before the next write: kubelet deletes a driver's slices
        some time after the driver goes (its plugin unregistered), so after a registration
        the slice may be gone."""
        self._held = None

    def _read(self) -> dict[str, dict]:
        """The slices of ours the API server holds, by name. Listed by the node's name, not
        read by their own: the Node authorizer lets a node's identity list the slices of its
        node, and refuses a read by name of one it does not hold yet."""
        listing = self.client.request(
            "GET", f"{SLICES}?fieldSelector=spec.nodeName%3D{self.node}")
        held = {s["metadata"]["name"]: s for s in listing.get("items") or []
                if s.get("spec", {}).get("driver") == DRIVER and (
                    s["metadata"]["name"] == self.name or
                    s["metadata"]["name"].startswith(f"{self.name}-"))}
        if held:
            self.generation = max(h["spec"]["pool"]["generation"] for h in held.values())
        return held

    def _node_owner(self) -> dict:
        if self._owner is None:
            node = self.client.request("GET", f"/api/v1/nodes/{self.node}")
            self._owner = {"apiVersion": "v1", "kind": "Node", "name": self.node,
                           "uid": node["metadata"]["uid"], "controller": True}
        return self._owner


def _holds(held: dict, content: dict, node: str, count: int) -> bool:
    spec = held.get("spec", {})
    if "counters" in content and spec.get("sharedCounters") != content["counters"]:
        return False
    return (spec.get("devices", []) == content.get("devices", []) and spec.get("nodeName") == node
            and spec.get("pool", {}).get("resourceSliceCount") == count)
