"""What a doctor check gives back, and how the results make the exit code.

Owns: the statuses (ok, warn, fail, skip: the check does not apply here), `Finding` (what a
check function returns: its status, what it found, and the exact command or file change that
fixes it), `Check` (a finding with the check's id, group and title, as reported), and
`exit_code`. Must not run checks or print anything (agent.doctor.runner and .report do).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Callable

OK = "ok"
WARN = "warn"
FAIL = "fail"
SKIP = "skip"  # does not apply on this node (no CRI-O, no systemctl, strategy without CDI)
STATUSES = (OK, WARN, FAIL, SKIP)
_RANK = {SKIP: 0, OK: 0, WARN: 1, FAIL: 2}

# Exit codes: the worst status found (skip counts as ok).
EXIT_OK = 0
EXIT_WARN = 1
EXIT_FAIL = 2


@dataclass(frozen=True)
class Finding:
    """What one check found: `fix` is the exact command or file change, None when nothing
    needs doing."""

    status: str
    found: str
    fix: str | None = None


def ok(found: str) -> Finding:
    return Finding(OK, found)


def warn(found: str, fix: str | None) -> Finding:
    return Finding(WARN, found, fix)


def fail(found: str, fix: str | None) -> Finding:
    return Finding(FAIL, found, fix)


def skip(found: str) -> Finding:
    return Finding(SKIP, found)


def worst(findings: Iterable[Finding]) -> Finding:
    """Several findings as one: the worst status, the texts joined, the fixes one a line."""
    items = list(findings)
    status = max((f.status for f in items), key=lambda s: _RANK[s], default=OK)
    if status == OK and items and all(f.status == SKIP for f in items):
        status = SKIP
    fixes: list[str] = []
    for f in items:
        if f.fix and f.fix not in fixes:
            fixes.append(f.fix)
    return Finding(status, "; ".join(f.found for f in items if f.found),
                   "\n".join(fixes) or None)


@dataclass(frozen=True)
class Spec:
    """One check: a stable id (`group.name`), a title, and the function that runs it."""

    id: str
    title: str
    run: Callable  # (agent.doctor.context.Context) -> Finding

    @property
    def group(self) -> str:
        return self.id.split(".", 1)[0]


@dataclass(frozen=True)
class Check:
    """One check's result as reported."""

    id: str
    group: str
    title: str
    status: str
    found: str
    fix: str | None

    @classmethod
    def of(cls, spec: Spec, finding: Finding) -> Check:
        return cls(spec.id, spec.group, spec.title, finding.status, finding.found, finding.fix)

    def to_json(self) -> dict:
        return {"id": self.id, "group": self.group, "title": self.title, "status": self.status,
                "found": self.found, "fix": self.fix}


def overall(checks: Sequence[Check]) -> str:
    """The worst status of `checks` (ok when every check is ok or skipped)."""
    rank = max((_RANK[c.status] for c in checks), default=0)
    return {0: OK, 1: WARN, 2: FAIL}[rank]


def exit_code(checks: Sequence[Check]) -> int:
    """0 when every check is ok or skipped, 1 with a warning, 2 with a failure."""
    return {OK: EXIT_OK, WARN: EXIT_WARN, FAIL: EXIT_FAIL}[overall(checks)]
