"""Faults and how they end: the record of why a device is withdrawn, the recovery rule of its
class, and the small state file that keeps withdrawn GPUs withdrawn across agent restarts.

Owns: `Fault` (one device's reason to be Unhealthy: XID or event, action class, since when),
the rules (`reset_may_recover`: the GPU answers NVML as itself, no critical event for the quiet
period, a probe passes, and the driver asks for nothing more: no recovery action, no row remap
pending or failed, no pages pending retirement; reboot-class faults end only when the host's
boot ID changes), and
`FaultFile`: STATE_DIR/health.json, written atomically (agent.fileio.write_atomic), read at
start where a reboot since the fault (a new boot ID) clears reset- and reboot-class faults
alike. A corrupt file is kept aside as health.json.corrupt-<time> and reported. Must not call
NVML (the monitor passes probe results in) nor touch devices.
"""

from __future__ import annotations

import json
import logging
import os
import time

from agent.constants import XID_ACTIONS
from agent.fileio import write_atomic
from agent.health.policy import REBOOT, RESET

log = logging.getLogger(__name__)

FILE_NAME = "health.json"
FORMAT_VERSION = 1
KINDS = ("xid", "ecc", "lost", "hung", "register", "wait")


class Fault:
    """Why one advertised device is withdrawn. `kind`: xid, ecc (double-bit ECC event), lost
    (GPU_IS_LOST), hung (an NVML call did not return within the budget), register (event
    registration failed), wait (a wait error naming no GPU).
    The monitor updates a fault in place as new events come."""

    __slots__ = ("device_id", "gpu_uuid", "gpu_index", "kind", "action", "reason", "xid",
                 "since", "boot_id", "last_event")
    _PERSISTED = __slots__[:-1]  # last_event: monotonic time of the latest critical event

    def __init__(self, device_id: str, gpu_uuid: str, gpu_index: int, kind: str, action: str,
                 reason: str, xid: int | None = None, since: float = 0.0, boot_id: str = "",
                 last_event: float = 0.0):
        self.device_id = device_id
        self.gpu_uuid = gpu_uuid
        self.gpu_index = gpu_index
        self.kind = kind
        self.action = action  # RESET or REBOOT
        self.reason = reason
        self.xid = xid
        self.since = since  # wall clock (time.time()) of the first event
        self.boot_id = boot_id  # the boot the fault happened in
        self.last_event = last_event  # monotonic; not persisted

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Fault) and all(
            getattr(self, k) == getattr(other, k) for k in self.__slots__)

    __hash__ = None  # type: ignore[assignment]  # changed in place

    def __repr__(self) -> str:
        return "Fault(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"

    def to_data(self) -> dict:
        return {k: getattr(self, k) for k in self._PERSISTED}

    @classmethod
    def from_data(cls, data: dict) -> Fault:
        if not isinstance(data, dict):
            raise ValueError(f"a fault must be a mapping, got {type(data).__name__}")
        fault = cls(**{k: data[k] for k in ("device_id", "gpu_uuid", "gpu_index", "kind",
                                             "action", "reason", "xid", "since", "boot_id")})
        if fault.action not in (RESET, REBOOT) or fault.kind not in KINDS:
            raise ValueError(f"fault of {fault.device_id}: bad action {fault.action!r} or "
                             f"kind {fault.kind!r}")
        return fault


STRENGTH = {a: i for i, a in enumerate(XID_ACTIONS)}  # ignore < application < reset < reboot


def reset_may_recover(fault: Fault, now: float, quiet_s: float) -> bool:
    """The time part of the reset rule: no critical event for `quiet_s` (monotonic `now`);
    none for a GPU that did not answer (a hang is no critical event: it ends when the GPU
    answers). The caller still needs a passing probe (and, for lost/register faults, a
    registration)."""
    return fault.action == RESET and (fault.kind == "hung" or
                                      now - fault.last_event >= quiet_s)


def _document(faults: list[Fault]) -> dict:
    """The health.json document of `faults`."""
    return {"version": FORMAT_VERSION,
            "faults": sorted((f.to_data() for f in faults), key=lambda d: d["device_id"])}


class FaultFile:
    """STATE_DIR/health.json: the faults to keep across restarts, with the boot they were
    recorded in. `error` holds the last problem reading or writing it ("" when none)."""

    def __init__(self, state_dir: str | None):
        self.path = os.path.join(state_dir, FILE_NAME) if state_dir else None
        self.error = ""
        self._last = None

    def load(self, boot_id: str) -> tuple[list[Fault], list[Fault]]:
        """(faults still in force, faults cleared by a reboot since; with `boot_id` "" (unknown)
        every fault stays in force). A missing file is no fault; a corrupt one is renamed aside, reported in `error`, and counts as none."""
        if self.path is None:
            return [], []
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
            if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION:
                raise ValueError(f"not a version {FORMAT_VERSION} health state document")
            faults = [Fault.from_data(item) for item in doc.get("faults", [])]
        except FileNotFoundError:
            self._last = _document([])  # no file is no fault: none to write until one comes
            return [], []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            aside = f"{self.path}.corrupt-{int(time.time())}"
            try:
                os.replace(self.path, aside)
                kept = f"kept aside as {aside}"
            except OSError as move_exc:
                kept = f"could not be moved aside ({move_exc})"
            self.error = (f"cannot read the health state {self.path}: {exc}; it was {kept}; "
                          f"starting with no recorded faults")
            log.error("%s", self.error)
            return [], []
        self._last = _document(faults)  # what the file says: saving the same writes nothing
        kept_faults, cleared = [], []
        for fault in faults:
            (cleared if boot_id and fault.boot_id != boot_id else kept_faults).append(fault)
        return kept_faults, cleared

    def save(self, faults: list[Fault]) -> None:
        """Write the faults (atomically); only when they differ from what the file holds (as
        last read or written). After a failed write the monitor calls this again until one
        succeeds."""
        if self.path is None:
            return
        doc = _document(faults)
        if doc == self._last:
            return
        try:
            write_atomic(self.path, (json.dumps(doc, indent=1) + "\n").encode())
        except OSError as exc:
            message = f"cannot write the health state {self.path}: {exc}"
            if message != self.error:
                log.error("%s; withdrawn GPUs would come back after an agent restart", message)
            self.error = message
            return
        if self.error.startswith("cannot write"):
            log.info("health state %s is written again", self.path)
        self._last = doc
        self.error = ""
