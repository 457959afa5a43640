"""Noticing MIG reconfigurations while the agent runs, and MIG devices that go while in use.

Owns: `MigWatch`, the periodic read of the MIG layout under migStrategy single or mixed (NVML
has no event for instances created or destroyed, nor for a mode change applied): due every
`agent.migCheckInterval` while a GPU is MIG-capable (a node without one has no layout to
change: its agent reads nothing and sleeps), it says whether the layout differs from the one
last advertised;
and `gone_in_use`, the MIG devices a reconfiguration took away while the allocation journal
says a container holds them. Must not advertise anything itself (the daemon re-advertises
through the same path as a SIGHUP) nor import grpc.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from agent.errors import NvmlError
from agent.nvml import mig

log = logging.getLogger(__name__)


class MigWatch:
    def __init__(self) -> None:
        self.interval = 0.0
        self.due: float | None = None  # monotonic time of the next read; None: not watching
        self.seen: tuple = ()

    def reset(self, cfg: Any, gpus: Sequence[Any], now: float) -> None:
        """After an advertisement: remember its layout, watch from now on (under
        single/mixed with a non-zero interval, when a GPU is MIG-capable: `mig_pending` is
        None on one that is not)."""
        on = cfg.mig_strategy != "none" and cfg.mig_check_interval > 0 and \
            any(g.mig_pending is not None for g in gpus)
        self.interval = cfg.mig_check_interval if on else 0.0
        self.due = now + self.interval if on else None
        if on:
            self.seen = self._read(gpus, self.seen) or self.seen

    def changed(self, gpus: Sequence[Any], now: float) -> bool:
        """When due: read the layout; whether it differs from the one advertised."""
        if self.due is None or now < self.due:
            return False
        self.due = now + self.interval
        current = self._read(gpus, self.seen)
        if current is None or current == self.seen:
            return False
        log.info("MIG layout changed: %s", _describe(self.seen, current))
        return True

    @staticmethod
    def _read(gpus: Sequence[Any], seen: tuple) -> tuple | None:
        try:
            return mig.layout(gpus, known=seen)  # a GPU that hangs keeps what was seen
        except NvmlError as exc:  # a lost GPU, a driver hiccup: the next read tells
            log.debug("MIG layout unreadable: %s", exc)
            return None


def _describe(before: tuple, after: tuple) -> str:
    old = {g: (cur, pend, set(u)) for g, cur, pend, u in before}
    parts = []
    for g, cur, pend, uuids in after:
        o_cur, o_pend, o_uuids = old.get(g, (cur, pend, set()))
        if (cur, pend) != (o_cur, o_pend):
            parts.append(f"GPU {g} MIG mode {o_cur}/{o_pend} -> {cur}/{pend} (current/pending)")
        made, gone = set(uuids) - o_uuids, o_uuids - set(uuids)
        if made or gone:
            parts.append(f"GPU {g}: {len(made)} MIG devices created, {len(gone)} destroyed")
    return "; ".join(parts) or "no difference in what was read"


def gone_in_use(before: Iterable[Any], after: Iterable[Any], records: Iterable[Any]) -> list[str]:
    """One line per MIG device advertised `before` (agent.rm.devices.Device) and not `after`
    that a journal record (agent.state.checkpoint.Record) still holds."""
    now = {d.id for d in after}
    gone = {d.id: d for d in before if d.gi is not None and d.id not in now}
    out = []
    for r in records:
        for device_id in r.devices:
            d = gone.get(device_id)
            if d is not None:
                holder = f"pod {r.pod}" if r.pod else "a container not yet matched to a pod"
                out.append(f"MIG device {d.id} ({d.index}, GPU {d.gpu_index}) was destroyed "
                           f"while {holder} holds it")
    return out
