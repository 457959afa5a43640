"""The set of resources the agent advertises, built from the discovered GPUs and the config.

Owns: which settings `gpu-agent run` implements (IMEX is refused with the key named; sharing
is applied by agent.rm.sharing), the Allocate response options a config gives, the link model of
the GPUs (read from NVML once per GPU set), and `Resources.apply`: one `ResourceManager` per
resource name, kept across reloads. A resource that stays keeps its manager object (its
server, streams and device health stay with it) and only takes the new settings; resources
added or removed are reported so the registrar adds and removes only those servers. Must not
import grpc nor serve anything.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agent.config import Config
from agent.errors import NvmlError, StateError
from agent.nvml import discovery, mig
from agent.rm.allocate import ResponseOptions
from agent.rm.devices import devices_by_resource
from agent.rm.manager import ResourceManager
from agent.rm.migwatch import MigWatch, gone_in_use
from agent.rm.sharing import MpsGpu, check_mps, mps_plan, replicate
from agent.rm.topology import TopologyModel

log = logging.getLogger(__name__)


def _listing(devices: Sequence[Any]) -> str:
    """The devices of a resource for the log: each GPU or MIG device once, with its count of
    replicas when it is shared."""
    counts: dict[str, list] = {}
    for d in devices:
        counts.setdefault(d.replica_of or d.id, [d, 0])[1] += 1
    return ", ".join(
        (f"GPU {d.gpu_index} {d.gpu_uuid}" if d.gi is None else f"MIG {d.index} {base}")
        + (f" x{n}" if d.replica_of else "") for base, (d, n) in counts.items())


def response_options(cfg: Config) -> ResponseOptions:
    return ResponseOptions(list_strategies=cfg.device_list_strategy,
                           id_strategy=cfg.device_id_strategy,
                           pass_device_specs=cfg.pass_device_specs,
                           cdi_annotation_prefix=cfg.cdi_annotation_prefix,
                           dev_root=cfg.dev_root,
                           mps_root=cfg.mps_root_dir if cfg.sharing.mps is not None else "")


# An Allocate that arrives before the allocation journal is loaded waits this long for it.
JOURNAL_WAIT_S = 10.0


class Resources:
    """The managers by resource name; each Allocate is recorded by the journal given to
    `set_journal` (agent.state) before it is answered."""

    def __init__(self) -> None:
        self._journal: Callable | None = None  # the journal's record_allocation, once loaded
        self._records: Callable[[], Sequence] = tuple  # the journal's records, once loaded
        self._journal_set = threading.Event()
        self.mig_watch = MigWatch()
        self.gone_in_use: list[str] = []  # MIG devices destroyed while a container holds them
        self.managers: dict[str, ResourceManager] = {}
        self.gpus: list[discovery.Gpu] = []
        self.topology: TopologyModel | None = None
        self.mps: dict[str, MpsGpu] = {}  # the GPUs sharing.mps shares (agent.mps runs them)

    def set_journal(self, journal: Any) -> None:
        """Record with `journal` (agent.state.journal.Journal, loaded) from now on: every
        manager's journal hook is its record_allocation."""
        self._journal, self._records = journal.record_allocation, journal.records
        self._journal_set.set()
        for manager in self.managers.values():
            manager.journal = self._journal

    def _record(self, resource: str, allocations: list) -> object:
        """The managers' journal hook until the journal is loaded (after the first
        registration: it is not on the start path): an Allocate that comes before waits for
        it, then is recorded."""
        if not self._journal_set.wait(JOURNAL_WAIT_S):
            raise StateError(f"the allocation journal is not loaded after {JOURNAL_WAIT_S:g} s")
        return self._journal(resource, allocations)

    @property
    def devices(self) -> list:
        return [d for m in self.managers.values() for d in m.devices]

    @staticmethod
    def device_map(gpus: Sequence[discovery.Gpu], cfg: Config) -> dict[str, list]:
        """The devices of each resource `cfg` advertises on `gpus` (MIG devices read from
        NVML when the strategy is not none), time-sliced replicas included; MigLayoutError
        for a layout it refuses."""
        migs = mig.read_mig_devices(gpus) if cfg.mig_strategy != "none" else []
        mps = cfg.sharing.mps
        device_map = replicate(devices_by_resource(gpus, cfg.resources.gpus,
                                                   strategy=cfg.mig_strategy, migs=migs,
                                                   mig_patterns=cfg.resources.mig),
                               cfg.sharing.time_slicing or mps,
                               "sharing.mps" if mps else "sharing.timeSlicing")
        if mps is not None:
            check_mps(device_map, gpus, mps, cfg.config_file or "")
        return device_map

    def apply(self, gpus: Sequence[discovery.Gpu], cfg: Config) -> tuple[list[str], list[str]]:
        """Advertise `gpus` as `cfg` says; (added, removed) resource names. The managers dict
        is replaced as a whole, so readers on other threads see the old or the new one.
        MigLayoutError (nothing changed) for a MIG layout the strategy refuses."""
        device_map = self.device_map(gpus, cfg)
        before = self.devices
        self.gpus = list(gpus)
        options, topology = response_options(cfg), self._topology()
        shared = cfg.sharing.time_slicing or cfg.sharing.mps
        one = bool(shared and shared.fail_requests_greater_than_one)  # a replica a container
        self.mps = mps_plan(device_map, one) if cfg.sharing.mps is not None else {}
        policies = {"allocation_policy": cfg.allocation_policy,
                    "replica_policy": cfg.replica_allocation_policy,
                    "one_replica": one, "one_gpu": cfg.sharing.mps is not None}
        managers = {}
        for name, devices in device_map.items():
            manager = self.managers.get(name)
            if manager is None:
                manager = ResourceManager(name, devices, options,
                                          journal=self._journal or self._record,
                                          topology=topology, **policies)
            else:
                manager.reconfigure(devices, options, topology=topology, **policies)
            managers[name] = manager
        added = [n for n in managers if n not in self.managers]
        removed = [n for n in self.managers if n not in managers]
        self.managers = managers
        for name in added:
            m = managers[name]
            log.info("resource %s: %d devices (%s)", name, len(m.devices), _listing(m.devices))
        for name in removed:
            log.info("resource %s: no longer advertised", name)
        self.gone_in_use = gone_in_use(before, self.devices, self._records())
        for line in self.gone_in_use:
            log.error("%s: its processes lost the GPU; delete the pod", line)
        self.mig_watch.reset(cfg, self.gpus, time.monotonic())
        return added, removed

    def _topology(self) -> TopologyModel:
        """The link model of the GPUs, read from NVML once per GPU set (at start, and when a
        reload finds other GPUs); pairs NVML cannot describe count as SYS (agent.nvml)."""
        gpus = sorted(self.gpus, key=lambda g: g.index)
        if self.topology is not None and \
                [g.uuid for g in self.topology.gpus] == [g.uuid for g in gpus]:
            return self.topology
        try:
            links = discovery.read_links(gpus)
        except NvmlError as exc:
            log.warning("GPU links unreadable (%s): every pair counts as SYS", exc)
            links = {}
        self.topology = TopologyModel.from_links(gpus, links)
        log.info("GPU topology: %s", self.topology.summary())
        return self.topology

    def check_cdi(self, cfg: Config) -> Any:
        """With a cdi-* device-list strategy, check (at start and on every reload) that the
        toolkit's CDI spec defines every name Allocate hands out. A missing name is logged as
        an error with what to run, but is not fatal: the toolkit's nvidia-cdi-refresh may write
        the spec moments later, and only containers given those devices are affected. A
        `cdi.CdiCheck`, or None without a cdi-* strategy."""
        from agent.rm import cdi  # after registration: not on the start path

        found = cdi.check(self.devices, response_options(cfg), cfg.cdi_spec_dirs)
        if found is not None:
            level = log.error if not found.ok else log.warning if found.index.problems \
                else log.info
            level("%s", found.message())
        return found

    def advertised(self) -> dict | None:
        """The devices advertised now by resource; None before the first discovery (read from
        the reconcile thread: `managers` is replaced as a whole, never changed)."""
        managers = self.managers
        return {name: m.devices for name, m in managers.items()} if managers else None

    def health(self) -> dict[str, tuple[bool, str]]:
        """device id -> (healthy, reason) as advertised now."""
        return {h.device.id: (h.healthy, h.reason)
                for m in self.managers.values() for h in m.snapshot().devices}

    def set_health(self, changes: Mapping[str, tuple[bool, str]]) -> None:
        """From the health monitor's threads: one batch of device health to the managers."""
        for manager in list(self.managers.values()):
            mine = {i: state for i, state in changes.items() if i in manager.by_id}
            if mine:
                manager.set_health_many(mine)

    def close(self) -> None:
        for m in self.managers.values():
            m.close()
