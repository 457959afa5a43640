"""The agent in DRA mode (`agent.mode: dra`): the DRA driver gpu.nvidia.com on this node.

Owns: reading what the node publishes (discovery's GPUs, their MIG devices, and what
agent.nvml.identity adds) into agent.dra.slices' devices and the claims' view of them; the
API client (agent.kubeconfig) and the node's name (agent.nodeName); publishing the
ResourceSlice after each read (start, reload, NVML back), retried every RETRY_S while the API
server refuses or does not answer (a thread that sleeps otherwise); and the kubelet plugin
(agent.dra.plugin, in agent.kubeletDir's plugins_registry and plugins directories) answering from agent.dra.claims, whose CDI specs go to the last of
agent.cdiSpecDirs. Must not register device-plugin resources (agent.daemon starts no
registrar in this mode) nor decide health.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from agent.dra import slices
from agent.dra.claims import Claims, NodeDevice
from agent.dra.plugin import DraPlugin
from agent.dra.publisher import SlicePublisher
from agent.errors import AgentError
from agent.nvml import driver, identity, mig

log = logging.getLogger(__name__)

RETRY_S = 10.0


class DraMode:
    """The DRA driver of the daemon's Config `cfg`."""

    def __init__(self, cfg: Any, on_change: Callable[[], None] = lambda: None):
        from agent.kubeapi.client import connect
        from agent.kubeapi.faults import node_name

        if not cfg.kubeconfig:
            raise AgentError("agent.mode dra needs the Kubernetes API: agent.kubeconfig is "
                             "empty")
        self.node = node_name(cfg.node_name)
        self.client = connect(cfg.kubeconfig)
        self.publisher = SlicePublisher(self.client, self.node)
        self.devices: list[dict] = []
        self.node_devices: dict[str, NodeDevice] = {}
        self.claims = Claims(self.client, self.node, lambda: self.node_devices, cfg.state_dir,
                             cdi_dir=cfg.cdi_spec_dirs[-1], dev_root=cfg.dev_root or
                             cfg.driver_root)
        self.plugin = DraPlugin(self.claims, kubelet_dir=cfg.kubelet_dir, on_change=on_change)
        self.error = ""
        self._lock = threading.Lock()  # one publication at a time (apply, the retry thread)
        self._failed = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def apply(self, gpus: list, cfg: Any) -> None:
        """Read the devices of `gpus` and publish them; start the kubelet plugin (once)."""
        self.devices, self.node_devices = _read(gpus, cfg.dev_root or cfg.driver_root)
        if self._thread is None:
            self.plugin.start()
            self._thread = threading.Thread(target=self._run, name="dra-slices", daemon=True)
            self._thread.start()
        if not self._publish():
            self._failed.set()

    def _publish(self) -> bool:
        with self._lock:
            try:
                self.publisher.publish(self.devices)
            except AgentError as exc:
                if str(exc) != self.error:
                    log.warning("ResourceSlice of %s not published: %s; trying again every "
                                "%g s", self.node, exc, RETRY_S)
                self.error = str(exc)
                return False
            if self.error:
                log.info("ResourceSlice of %s published", self.node)
            self.error = ""
            return True

    def _run(self) -> None:
        """Asleep until a publication fails; then a try every RETRY_S until one succeeds."""
        while True:
            self._failed.wait()
            self._failed.clear()
            while self.error:
                if self._stopped.wait(RETRY_S):
                    return
                self._publish()
            if self._stopped.is_set():
                return

    def status(self) -> dict:
        return {"driver": slices.DRIVER, "node": self.node, "devices": len(self.devices),
                "sliceGeneration": self.publisher.generation, "error": self.error,
                "registered": self.plugin.registered,
                "preparedClaims": sorted(f"{v[0]}/{v[1]}" for v in self.claims.prepared.values())}

    def stop(self) -> None:
        self._stopped.set()
        self._failed.set()
        self.plugin.stop()
        self.client.close()


def _read(gpus: list, dev_root: str) -> tuple[list[dict], dict[str, NodeDevice]]:
    """(the devices to publish, what the claims see of them) of `gpus` (NvmlError when NVML
    cannot say)."""
    info = driver.driver_info()
    shared = {g.uuid: slices.gpu_attributes(g, identity.gpu_identity(g), info,
                                            slices.pcie_root(g.short_bus_id)) for g in gpus}
    migs = [(m, identity.mig_placement(m)) for m in mig.read_mig_devices(gpus)]
    devices = slices.node_devices(gpus, migs, shared)

    def nodes(*paths: str) -> tuple[tuple[str, str], ...]:
        return tuple((p, os.path.join(dev_root, p.lstrip("/"))) for p in paths)

    seen: dict[str, NodeDevice] = {}
    for g in gpus:
        if not g.mig_enabled:
            seen[slices.gpu_device(g, {})["name"]] = NodeDevice(
                g.uuid, nodes(f"/dev/nvidia{g.minor}"))
    for m, p in migs:
        seen[slices.mig_device(m, p, {})["name"]] = NodeDevice(
            m.uuid, nodes(f"/dev/nvidia{m.parent.minor}", *m.caps))
    return devices, seen
