"""The agent in DRA mode (`agent.mode: dra`): the DRA driver gpu.nvidia.com on this node.

Owns: reading what the node publishes (discovery's GPUs, their MIG devices, and what
agent.nvml.identity adds) into agent.dra.slices' devices and the claims' view of them; the API
client (agent.kubeconfig) and the node's name (agent.nodeName); publishing the ResourceSlice
after each read (start, reload, NVML back) and each change of the devices' health (by the
`dra-slices` thread, at once), retried every RETRY_S while the API server refuses or does not
answer (the thread sleeps otherwise), and held until kubelet has registered the plugin once
(a pod the scheduler placed on a slice kubelet cannot prepare yet would wait for kubelet's next
sync of it, a minute or more); and the kubelet plugin (agent.dra.plugin, in
agent.kubeletDir's plugins_registry and plugins directories) answering from agent.dra.claims,
whose CDI specs go to the last of agent.cdiSpecDirs; and each device the health monitor
withdraws tainted in the slice (agent.dra.slices.with_taints) until it is back, and reported
unhealthy to kubelet (agent.dra.health) meanwhile. Must not register device-plugin resources
(agent.daemon starts no registrar in this mode) nor decide health (the monitor does).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any, Callable

from agent.dra import slices
from agent.dra.claims import Claims, NodeActions, NodeDevice
from agent.dra.plugin import DraPlugin
from agent.dra.publisher import SlicePublisher
from agent.errors import AgentError, ClaimError
from agent.host import ensure_cap_node
from agent.nvml import driver, identity, mig, partitions

log = logging.getLogger(__name__)

RETRY_S = 10.0
# the slice waits for kubelet's registration of the plugin; a warning says so after this long
REGISTRATION_WARN_S = 60.0


class DraMode:
    """The DRA driver of the daemon's Config `cfg`."""

    def __init__(self, cfg: Any, on_change: Callable[[], None] = lambda: None,
                 mps: Callable[[dict], dict[str, str]] | None = None):
        from agent.kubeapi.client import connect
        from agent.kubeapi.faults import node_name

        if not cfg.kubeconfig:
            raise AgentError("agent.mode dra needs the Kubernetes API: agent.kubeconfig is "
                             "empty")
        self.node = node_name(cfg.node_name)
        self.client = connect(cfg.kubeconfig)
        self.publisher = SlicePublisher(self.client, self.node)
        self.devices: list[dict] = []  # as published: with the taints
        self._untainted: list[dict] = []  # as read
        # the slices beside the node's (GPUs partitioned on demand): suffix -> content, as
        # published and as read
        self.more: dict[str, dict] = {}
        self._more_untainted: dict[str, dict] = {}
        self.gpus: list = []
        self._server: tuple[int, int] | None = None  # the API server's Kubernetes version
        self.taints: dict[str, tuple[str, str, str]] = {}  # name -> (reason, since, effect)
        # device UUID -> (reason, needs a reboot), as the monitor says
        self._withdrawn: dict[str, tuple[str, bool]] = {}
        self.reboot_effect = cfg.dra_reboot_taint
        self.node_devices: dict[str, NodeDevice] = {}
        self.claims = Claims(self.client, self.node, lambda: self.node_devices, cfg.state_dir,
                             cdi_dir=cfg.cdi_spec_dirs[-1], dev_root=cfg.dev_root or
                             cfg.driver_root, actions=_NodeActions(cfg, mps, lambda: self.gpus))
        self.on_change = on_change
        self.plugin = DraPlugin(self.claims, kubelet_dir=cfg.kubelet_dir,
                                on_change=self._plugin_changed)
        self._registrations = 0  # kubelet's registrations of the plugin acted on
        self.held = False  # a publication waits for kubelet's first registration
        self.error = ""
        self._lock = threading.Lock()  # the devices and one publication at a time
        self._due = threading.Event()  # a publication is wanted (a change, or a failure)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def apply(self, gpus: list, cfg: Any) -> None:
        """Read the devices of `gpus` and publish them (here, unless kubelet has not
        registered the plugin yet: then at its registration); start the kubelet plugin
        (once)."""
        shareable = self._served(_named(gpus, cfg.dra_shared_gpus, "agent.draSharedGpus"),
                                 "agent.draSharedGpus", "consumable capacity",
                                 "DRAConsumableCapacity", "whole")
        dynamic = self._served(_named(gpus, cfg.dra_dynamic_mig, "agent.draDynamicMig"),
                               "agent.draDynamicMig", "partitionable devices",
                               "DRAPartitionableDevices", "with the MIG devices they have")
        untainted, more, node_devices = _read(gpus, cfg.dev_root or cfg.driver_root,
                                              shareable, dynamic)
        with self._lock:
            self.gpus = list(gpus)
            self._untainted, self._more_untainted = untainted, more
            self.node_devices = node_devices
            self.reboot_effect = cfg.dra_reboot_taint  # a reload may change it
            self._taint()
        if self._thread is None:
            self.claims.sync_mps()  # the daemons of claims prepared before a restart
            self.plugin.start()
            self._thread = threading.Thread(target=self._run, name="dra-slices", daemon=True)
            self._thread.start()
        if not self._publish():
            self._due.set()

    def _served(self, uuids: set[str], key: str, feature: str, gate: str, instead: str
                ) -> set[str]:
        """`uuids` when the API server takes `feature` (beta and on from Kubernetes 1.36),
        else none, said in the log: an older one drops its fields and the scheduler would
        hand out what the node cannot give. Not known (the API server does not answer
        /version): as configured."""
        if not uuids:
            return uuids
        if self._server is None:
            try:
                v = self.client.request("GET", "/version")
                self._server = (int(v["major"]), int(re.match(r"\d+", v["minor"]).group()))
            except (AgentError, KeyError, TypeError, ValueError, AttributeError) as exc:
                log.warning("%s: the API server's version is not known (%s): publishing as "
                            "configured", key, exc)
                return uuids
        if self._server >= (1, 36):
            return uuids
        log.error("%s: the API server is Kubernetes %d.%d; %s: 1.36 or later (%s, beta "
                  "there); its GPUs are published %s", key, *self._server, feature, gate,
                  instead)
        return set()

    def _plugin_changed(self) -> None:
        """A registration status or a call: on each new registration (a kubelet restart
        registers the plugin again without unregistering it first) the slice is read and
        published again (kubelet may have deleted it while the plugin was unregistered), the
        first one included, which ends the hold (agent.dra.plugin counts a registration before
        it calls this, so a publication that held before the count is followed by this one)."""
        count = self.plugin.registrations
        if count != self._registrations:
            self._registrations = count
            with self._lock:
                self.publisher.forget()
            self._due.set()
        self.on_change()

    def set_health(self, health: Mapping[str, tuple[bool, str]],
                   reboot_needed: Collection[str] = ()) -> None:
        """The devices' health as the daemon advertises it (device ID -> (healthy, reason);
        IDs are UUIDs, replicas "UUID::n"; `reboot_needed`: the IDs whose fault only a
        reboot ends): a withdrawn device is tainted in the slice (agent.draRebootTaint's
        effect for the reboot class, NoSchedule otherwise), a device back is not. Returns at
        once: the `dra-slices` thread publishes the change (this is called from the health
        monitor's thread as a GPU flips)."""
        withdrawn: dict[str, tuple[str, bool]] = {}
        for device_id, (healthy, reason) in health.items():
            if not healthy:
                withdrawn.setdefault(device_id.split("::")[0],
                                     (reason, device_id in reboot_needed))
        with self._lock:
            if withdrawn == self._withdrawn:
                return
            self._withdrawn = withdrawn
            changed = self._taint()
        if changed:
            self._due.set()

    def _taint(self) -> bool:
        """The published devices from the read ones and the withdrawals (under the lock);
        True if they changed."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        taints = {}
        for name, d in self.node_devices.items():
            if d.uuid in self._withdrawn:
                reason, reboot = self._withdrawn[d.uuid]
                since = self.taints[name][1] if name in self.taints else now
                taints[name] = (reason, since, self.reboot_effect if reboot else "NoSchedule")
        for name in taints.keys() - self.taints.keys():
            log.warning("DRA device %s tainted %s:%s: %s", name, slices.UNHEALTHY,
                        taints[name][2], taints[name][0])
        for name in self.taints.keys() - taints.keys():
            log.info("DRA device %s: taint %s removed (healthy again)", name, slices.UNHEALTHY)
        devices = slices.with_taints(self._untainted, taints)
        more = {k: {"devices": slices.with_taints(v["devices"], taints)} if "devices" in v else v
                for k, v in self._more_untainted.items()}
        self.plugin.health.set({(self.node, name): taints[name][0] if name in taints else ""
                                for name in self.node_devices})
        changed = (devices, more) != (self.devices, self.more)
        self.taints, self.devices, self.more = taints, devices, more
        return changed

    def _publish(self) -> bool:
        with self._lock:
            if not self.plugin.registrations:
                if not self.held:
                    log.info("ResourceSlice of %s: published once kubelet registers the DRA "
                             "plugin (%s)", self.node, self.plugin.registration_socket)
                self.held = True  # _plugin_changed publishes at the registration
                return True
            self.held = False
            try:
                self.publisher.publish(self.devices, self.more)
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
        """Asleep until a publication is wanted; after a failure, a try every RETRY_S until
        one succeeds. A warning if kubelet has not registered the plugin REGISTRATION_WARN_S
        after the start."""
        warn_at: float | None = time.monotonic() + REGISTRATION_WARN_S
        while True:
            if warn_at is not None and not self._due.wait(max(0.0, warn_at - time.monotonic())):
                warn_at = None
                if not self.plugin.registrations:
                    log.warning("kubelet has not registered the DRA plugin in %g s: the "
                                "ResourceSlice of %s waits for it. Is kubelet running, and "
                                "is %s under its --root-dir?", REGISTRATION_WARN_S, self.node,
                                self.plugin.registration_socket)
                continue
            self._due.wait()
            self._due.clear()
            if self._stopped.is_set():
                return
            while not self._publish():
                if self._stopped.wait(RETRY_S):
                    return

    def status(self) -> dict:
        claims = self.claims.listing()
        devices = len(self.devices) + sum(len(v.get("devices", ())) for v in self.more.values())
        return {"driver": slices.DRIVER, "node": self.node, "devices": devices,
                "tainted": {n: f"{r} ({effect})" for n, (r, _, effect) in
                            sorted(self.taints.items())},
                "sliceGeneration": self.publisher.generation, "error": self.error,
                "held": self.held,
                "registered": self.plugin.registered,
                "registrations": self.plugin.registrations,
                "preparedClaims": sorted(f"{c['namespace']}/{c['name']}" for c in claims),
                "claims": claims}

    def stop(self) -> None:
        self._stopped.set()
        self._due.set()
        self.plugin.stop()
        self.client.close()


class _NodeActions(NodeActions):
    """What preparing a claim does to this node: nvidia-smi under the driver root sets a time
    slice (as NVIDIA's driver: nvlib.go setComputeMode, setTimeSlice); `mps` is the daemon's
    (its MPS daemons, agent.mps.daemons, run those of device-plugin mode's sharing.mps and
    those of the claims); a partition's MIG device made and destroyed through NVML
    (agent.nvml.partitions), its capability nodes made where missing (agent.host)."""

    def __init__(self, cfg: Any, mps: Callable[[dict], dict[str, str]] | None,
                 gpus: Callable[[], list]):
        self.mps_root = cfg.mps_root_dir
        self.nvidia_smi = os.path.join(cfg.driver_root, "usr/bin/nvidia-smi")
        self.dev_root = cfg.dev_root or cfg.driver_root
        self._mps = mps
        self._gpus = gpus

    def _gpu(self, index: int) -> Any:
        for g in self._gpus():
            if g.index == index:
                return g
        raise ClaimError(f"GPU {index} is not on this node any more")

    def make(self, device: NodeDevice) -> tuple[NodeDevice, list]:
        """The MIG device of a partition (agent.nvml.partitions.create), its capability nodes
        made where missing (as nvidia-modprobe makes them)."""
        profile_id, start, size = device.partition
        gpu = self._gpu(device.index)
        try:
            made = partitions.create(gpu, profile_id, start, size)
        except AgentError as exc:
            raise ClaimError(f"cannot make the MIG device of GPU {device.index} at memory "
                             f"slice {start}: {exc}") from None
        try:
            for cap in made.caps:
                ensure_cap_node(self.dev_root, cap)
        except AgentError as exc:
            partitions.destroy(gpu, made.gi, made.ci, made.uuid)
            raise ClaimError(f"MIG device {made.uuid} of GPU {device.index}: {exc}") from None
        nodes = device.nodes + tuple((c, os.path.join(self.dev_root, c.lstrip("/")))
                                     for c in made.caps)
        return (device._replace(uuid=made.uuid, nodes=nodes, partition=()),
                [device.index, made.gi, made.ci, made.uuid])

    def unmake(self, made: list) -> None:
        index, gi, ci, uuid = made
        try:
            partitions.destroy(self._gpu(index), gi, ci, uuid)
        except AgentError as exc:
            raise ClaimError(f"cannot destroy MIG device {made[3]} of GPU {index}: {exc}") \
                from None

    def timeslice(self, uuid: str, interval: int) -> None:
        import subprocess

        for args in (["-i", uuid, "-c", "DEFAULT"],
                     ["compute-policy", "-i", uuid, "--set-timeslice", str(interval)]):
            try:
                out = subprocess.run([self.nvidia_smi, *args], capture_output=True, text=True,
                                     timeout=30, check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise ClaimError(f"cannot set the time slice of {uuid}: {exc}") from None
            if out.returncode != 0:
                raise ClaimError(f"cannot set the time slice of {uuid}: nvidia-smi "
                                 f"{' '.join(args)}: exit status {out.returncode}: "
                                 f"{(out.stderr or out.stdout).strip()[-300:]}")
        log.info("GPU %s: compute mode DEFAULT, time slice %d (nvidia-smi)", uuid, interval)

    def mps(self, plan: dict) -> dict[str, str]:
        if self._mps is None:
            return super().mps(plan)
        return self._mps(plan)


def _named(gpus: list, named: Collection[str], key: str) -> set[str]:
    """The UUIDs of the GPUs `named` names (index, UUID or all); a name that is no GPU of this
    node is logged."""
    out = {g.uuid for g in gpus if "all" in named or g.uuid in named or str(g.index) in named}
    known = {"all"} | {g.uuid for g in gpus} | {str(g.index) for g in gpus}
    for name in sorted(set(named) - known):
        log.warning("%s: %s is no GPU of this node", key, name)
    return out


def _read(gpus: list, dev_root: str, shareable: Collection[str] = (),
          dynamic: Collection[str] = ()
          ) -> tuple[list[dict], dict[str, dict], dict[str, NodeDevice]]:
    """(the devices to publish, the slices beside them, what the claims see of the devices)
    of `gpus` (NvmlError when NVML cannot say); `shareable`: the UUIDs of the GPUs shared by
    consumable capacity; `dynamic`: of those partitioned on demand (MIG-enabled ones: their
    MIG devices are the claims', not published as they stand)."""
    info = driver.driver_info()
    shared = {g.uuid: slices.gpu_attributes(g, identity.gpu_identity(g), info,
                                            slices.pcie_root(g.short_bus_id)) for g in gpus}
    partitioned = [g for g in gpus if g.mig_enabled and g.uuid in dynamic]
    for g in gpus:
        if g.uuid in dynamic and not g.mig_enabled:
            log.warning("agent.draDynamicMig: GPU %d is not in MIG mode: published whole",
                        g.index)
    migs = [(m, identity.mig_placement(m)) for m in mig.read_mig_devices(
        [g for g in gpus if g not in partitioned])]
    devices = slices.node_devices(gpus, migs, shared, shareable)

    def nodes(*paths: str) -> tuple[tuple[str, str], ...]:
        return tuple((p, os.path.join(dev_root, p.lstrip("/"))) for p in paths)

    seen: dict[str, NodeDevice] = {}
    for g in gpus:
        if not g.mig_enabled:
            seen[slices.gpu_device(g, {})["name"]] = NodeDevice(
                g.uuid, nodes(f"/dev/nvidia{g.minor}"), "gpu", g.memory_total, g.index)
    for m, p in migs:
        seen[slices.mig_device(m, p, {})["name"]] = NodeDevice(
            m.uuid, nodes(f"/dev/nvidia{m.parent.minor}", *m.caps), "mig", p.memory_mb << 20,
            m.parent.index)
    more: dict[str, dict] = {}
    counters = []
    for g in sorted(partitioned, key=lambda g: g.index):
        possible, memory_slices = partitions.possible(g)
        compute = max((p.slices for p in possible), default=0)
        counters.append(slices.counter_set(g, memory_slices, compute))
        parts = [slices.partition_device(g, p.profile, p.placement, p.slices, shared[g.uuid])
                 for p in possible]
        more[f"gpu-{g.minor}"] = {"devices": sorted(parts, key=lambda d: d["name"])}
        for p, d in zip(possible, parts):
            seen[d["name"]] = NodeDevice(
                g.uuid, nodes(f"/dev/nvidia{g.minor}"), "mig", p.placement.memory_mb << 20,
                g.index, (p.placement.profile_id, p.placement.start, p.placement.size))
    if counters:
        more["counters"] = {"counters": counters}
    return devices, more, seen
