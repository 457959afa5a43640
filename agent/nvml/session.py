"""Bringing NVML up for one run of the agent: open the library, initialise, discover the GPUs.

Owns: the attempt (library path from the driver root or an explicit path, nvmlInit, discovery
with each GPU logged once), what a failure says to the operator (what to check, which flag or
env var sets the path), the retry schedule used while failOnInitError is false (1 s,
doubling, at most 30 s), the NVML call budget (agent.nvml.guard, agent.nvmlCallTimeout), and
`rediscover_due`: a GPU discovery left out because it did not answer answers now. Must not
decide what happens on failure: the daemon exits or waits.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from agent.errors import InitError, NvmlError, NvmlLibraryError
from agent.nvml import discovery, library
from agent.nvml.guard import GUARD

log = logging.getLogger(__name__)

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0


class NvmlSession:
    """NVML for this process: `open(cfg)` returns the GPUs or raises InitError with the whole
    message; `up`, `path`, `error`, `attempts` and `retry_at` are what status shows."""

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self.up = False
        self.rediscover_due = False
        self._indexes: frozenset[int] = frozenset()  # the GPUs discovery found
        self._on_change = on_change
        GUARD.on_answered = self._answering
        self.path = ""
        self.error = ""
        self.attempts = 0
        self.retry_at: float | None = None
        self._backoff = RETRY_FIRST_S

    def open(self, cfg) -> list[discovery.Gpu]:
        self.attempts += 1
        GUARD.budget_s = cfg.nvml_call_timeout
        try:
            self.path = library.resolve_library_path(cfg.driver_root, cfg.nvml_library_explicit)
            library.init(self.path)
        except (NvmlError, NvmlLibraryError) as exc:
            raise InitError(
                f"cannot initialise NVML with {self.path or cfg.nvml_library}: {exc}. Check "
                f"that the NVIDIA driver is loaded (nvidia-smi; lsmod | grep nvidia) and that "
                f"the NVML library is the driver's: --nvml-library / GPU_AGENT_NVML_LIBRARY "
                f"({cfg.nvml_library}), --driver-root / NVIDIA_DRIVER_ROOT "
                f"({cfg.driver_root})") from exc
        try:
            gpus = discovery.discover()
        except NvmlError as exc:
            library.shutdown()
            raise InitError(f"GPU discovery through NVML ({self.path}) failed: {exc}") from exc
        self.up, self.error, self.retry_at = True, "", None
        self._indexes = frozenset(g.index for g in gpus)
        log.info("NVML initialised from %s%s; %d GPUs", self.path,
                 "" if self.attempts == 1 else f" after {self.attempts} attempts", len(gpus))
        log_gpus(gpus)
        return gpus

    def failed(self, message: str) -> float:
        """Record a failed attempt; the delay before the next one."""
        delay = self._backoff
        self._backoff = min(self._backoff * 2, RETRY_MAX_S)
        self.retry_at = time.monotonic() + delay
        (log.error if message != self.error else log.info)(
            "%s; failOnInitError is false: advertising nothing, retrying NVML in %g s "
            "(attempt %d)", message, delay, self.attempts)
        self.error = message
        return delay

    def reconfigured(self, old, new) -> None:
        """A reload changed the config: the NVML call budget applies at once; a process holds
        one NVML library, so say when the library path or the driver root changed and what
        stays in force until a restart."""
        GUARD.budget_s = new.nvml_call_timeout
        for name in ("nvml_library", "driver_root"):
            if getattr(old, name) != getattr(new, name) and self.up:
                log.warning("%s changed from %s to %s: NVML stays loaded from %s until the "
                            "agent restarts", name, getattr(old, name), getattr(new, name),
                            self.path)

    def rediscover(self, known: list[discovery.Gpu]) -> list[discovery.Gpu]:
        """The GPUs now (a reload), or `known` when discovery fails; a GPU that does not
        answer keeps its record in `known`."""
        self.rediscover_due = False
        try:
            gpus = discovery.discover(known=known)
        except NvmlError as exc:
            log.error("GPU discovery on reload failed: %s; keeping the %d GPUs found before",
                      exc, len(known))
            return known
        if [g.uuid for g in gpus] != [g.uuid for g in known]:
            log_gpus(gpus)
        self._indexes = frozenset(g.index for g in gpus)
        return gpus

    def _answering(self, gpu: object, what: str) -> None:
        """agent.nvml.guard's listener: GPU `gpu` answers again; if discovery left it out,
        it is due to be discovered (the daemon's loop does it)."""
        if self.up and gpu not in self._indexes:
            self.rediscover_due = True
            self._on_change()

    def close(self) -> None:
        if self.up:
            try:
                library.shutdown()
            except NvmlError as exc:
                log.warning("NVML shutdown: %s", exc)
            self.up = False


def log_gpus(gpus: list[discovery.Gpu]) -> None:
    for g in gpus:
        numa = "-" if g.numa_node is None else g.numa_node
        log.info("GPU %d %s (%s, PCI %s, NUMA %s, %d MiB, compute %d.%d%s) discovered",
                 g.index, g.uuid, g.name, g.pci_bus_id, numa, g.memory_total >> 20,
                 *g.compute_capability,
                 ", MIG enabled: advertised whole with migStrategy none" if g.mig_enabled else "")
    for g in gpus:
        if g.mig_pending_note:
            log.warning("%s", g.mig_pending_note)
    if not gpus:
        log.warning("no GPUs found: advertising nothing")
