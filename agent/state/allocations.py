"""The allocation state as the daemon holds it: the journal and its reconciler, and their
status lines.

Owns: `AllocationState` (builds the journal in the state directory and the reconciler, starts,
reconfigures on SIGHUP and stops them, sums up their status and what needs an operator's
attention) and `format_state` (`gpu-agent status` lines for status.json's "state"). Must not
import grpc (the podresources client comes in through `connect`) or NVML code.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from agent.constants import DEFAULT_ENDED_POD_GRACE_S
from agent.errors import AgentError
from agent.host import boot_id
from agent.state.journal import JOURNAL_FILE, Journal
from agent.state.reconcile import Holders, holders_recorded
from agent.state.reconciler import Reconciler

log = logging.getLogger(__name__)


class AllocationState:
    """The journal and its reconciler, as the daemon holds them."""

    def __init__(self, state_dir: str, *, keyed_by: str, socket_path: str, period: float,
                 sync_interval: float, connect: Callable[[str], Any],
                 devices: Callable[[], Mapping[str, Sequence[Any]] | None],
                 environ: Mapping[str, str] | None = None,
                 ended_grace: float = DEFAULT_ENDED_POD_GRACE_S,
                 on_change: Callable[[], None] = lambda: None):
        try:
            boot = boot_id(environ)
        except AgentError as exc:
            log.warning("%s: records from another boot cannot be told apart", exc)
            boot = ""
        self.journal = Journal(os.path.join(state_dir, JOURNAL_FILE), boot=boot,
                               keyed_by=keyed_by, sync_interval=sync_interval)
        self.reconciler = Reconciler(self.journal, socket_path, connect=connect,
                                     devices=devices, period=period, ended_grace=ended_grace)
        # what `version` and `problem` show changed: after each reconciliation pass (which
        # follows Allocates within DEBOUNCE_S) and when the journal starts or stops failing
        self.reconciler.on_change = self.journal.on_problem = on_change

    @property
    def version(self) -> int:
        return self.journal.version + self.reconciler.version

    def start(self) -> None:
        """Load the journal (a bad one is set aside) and start reconciling."""
        self.journal.load()
        self.reconciler.start()

    def poke(self) -> None:
        self.reconciler.poke()

    def reconfigure(self, *, keyed_by: str, socket_path: str, period: float,
                    sync_interval: float,
                    ended_grace: float = DEFAULT_ENDED_POD_GRACE_S) -> None:
        if keyed_by != self.journal.keyed_by:
            log.info("checkpointDeviceIDStrategy is now %s (was %s)", keyed_by,
                     self.journal.keyed_by)
            self.journal.set_keyed_by(keyed_by)
        self.journal.sync_interval = sync_interval
        self.reconciler.configure(socket_path, period, ended_grace)

    def close(self) -> None:
        self.reconciler.stop()
        self.journal.close()

    def status(self) -> dict:
        return {**self.journal.status(), "podResources": self.reconciler.status()}

    def holders(self) -> Holders:
        """Who holds each device, as the journal's attributed records say (memory only)."""
        return holders_recorded(self.journal.records())

    @property
    def problem(self) -> str:
        """A one-line note for the daemon's summary when the state needs attention."""
        st = self.journal
        if st.blocked:
            return "journal: " + st.blocked
        if st.failing:
            return f"journal not writable, Allocate refused: {st.failing}"
        if st.set_aside:
            return f"bad journal set aside: {st.set_aside[-1].path or st.path}"
        return ""


def format_state(doc: Mapping[str, Any]) -> list[str]:
    """`gpu-agent status` lines for status.json's "state"."""
    lines = [f"allocations: {doc.get('allocations', 0)} recorded ({doc.get('attributed', 0)} "
             f"attributed to pods, {doc.get('pending', 0)} waiting) in {doc.get('journal')}"
             f" (GPUs keyed by {doc.get('keyedBy')}; {doc.get('entries', 0)} entries, "
             f"{doc.get('bytes', 0)} bytes, synced every {doc.get('syncInterval', 0):g} s)"]
    if doc.get("failing"):
        lines.append(f"  journal failing, Allocate answers UNAVAILABLE: {doc['failing']}")
    elif doc.get("lastError"):
        lines.append(f"  last journal error: {doc['lastError']}")
    torn = doc.get("tornTail")
    if torn:
        lines.append(f"  torn tail cut at start: {torn['bytes']} bytes at byte {torn['at']} "
                     f"({torn['reason']})")
    if doc.get("migratedFrom"):
        lines.append(f"  migrated from {doc['migratedFrom']}")
    for a in doc.get("setAside", []):
        lines.append(f"  bad journal set aside ({a['kind']}): {a['path'] or 'not moved'}: "
                     f"{a['reason']}")
    for path in doc.get("setAsideEarlier", []):
        lines.append(f"  set aside earlier: {path}")
    p = doc.get("podResources") or {}
    if p.get("error"):
        lines.append(f"  podresources: {p['error']}")
    elif p.get("socket"):
        alloc = p.get("allocatable")
        extra = (", allocatable " + ", ".join(f"{k}: {v}" for k, v in alloc.items())
                 if alloc else "")
        lines.append(f"  podresources: answering on {p['socket']} ({p.get('reconciles', 0)} "
                     f"reconciliations{extra})")
    return lines
