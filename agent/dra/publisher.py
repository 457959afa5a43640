"""This node's ResourceSlice, kept as its devices are, through the Kubernetes API server.

Owns: `SlicePublisher.publish(devices)`: the node's one slice (named `<node>-gpu.nvidia.com`,
owned by the Node so that it goes when the Node does) created, or replaced with the pool's
generation one higher when its devices differ from what the API server holds; nothing written
when they are the same, so an agent restarted on an unchanged node rewrites nothing, and a
generation never goes back (the scheduler uses only the newest generation of a pool). A
conflict (the slice changed since it was read) is raised and forgets what was read: the next
call reads again. Must not read NVML (agent.dra.slices builds the devices) or retry (the
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

    def publish(self, devices: list[dict]) -> bool:
        """Make the slice hold `devices`; True when it was written. KubeApiError when the API
        server cannot be reached or refuses (409: changed meanwhile; call again)."""
        held = self._held if self._held is not None else self._read()
        if held and held.get("spec", {}).get("devices", []) == devices and \
                held["spec"].get("nodeName") == self.node:
            self._held = held
            return False
        generation = held["spec"]["pool"]["generation"] + 1 if held else 1
        body = {
            "apiVersion": API_VERSION, "kind": "ResourceSlice",
            "metadata": {"name": self.name, "ownerReferences": [self._node_owner()]},
            "spec": slice_spec(self.node, devices, generation),
        }
        try:
            if held:
                body["metadata"]["resourceVersion"] = held["metadata"]["resourceVersion"]
                written = self.client.request("PUT", f"{SLICES}/{self.name}", body)
            else:
                written = self.client.request("POST", SLICES, body)
        except KubeApiError:
            self._held = None  # whatever happened, read the slice again next time
            raise
        self._held = written
        self.generation = generation
        self.writes += 1
        log.info("ResourceSlice %s: %d devices, pool generation %d", self.name, len(devices),
                 generation)
        return True

    def forget(self) -> None:
        """Read the slice again before the next write: kubelet deletes a driver's slices
        some time after the driver goes (its plugin unregistered), so after a registration
        the slice may be gone."""
        self._held = None

    def _read(self) -> dict:
        """The slice the API server holds ({} when there is none). Listed by the node's name,
        not read by its own: the Node authorizer lets a node's identity list the slices of
        its node, and refuses a read by name of one it does not hold yet."""
        listing = self.client.request(
            "GET", f"{SLICES}?fieldSelector=spec.nodeName%3D{self.node}")
        held = next((s for s in listing.get("items") or []
                     if s.get("metadata", {}).get("name") == self.name), {})
        if held:
            self.generation = held["spec"]["pool"]["generation"]
        return held

    def _node_owner(self) -> dict:
        if self._owner is None:
            node = self.client.request("GET", f"/api/v1/nodes/{self.node}")
            self._owner = {"apiVersion": "v1", "kind": "Node", "name": self.node,
                           "uid": node["metadata"]["uid"], "controller": True}
        return self._owner
