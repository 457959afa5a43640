"""The doctor's report: text for people, JSON for scripts.

Owns: both formats. The JSON document (schema version SCHEMA_VERSION; docs/troubleshooting.md
describes it, tests/test_doctor.py pins it) is:

    {"version": 1, "agentVersion": "...", "root": "/", "status": "ok|warn|fail",
     "exitCode": 0|1|2, "counts": {"ok": n, "warn": n, "fail": n, "skip": n},
     "checks": [{"id": "group.name", "group": "...", "title": "...",
                 "status": "ok|warn|fail|skip", "found": "...", "fix": "..." or null}]}

Fields are only ever added within a version; a change of meaning is a new version. Must not
run checks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from agent import __version__
from agent.doctor.model import STATUSES, Check, exit_code, overall

SCHEMA_VERSION = 1
_LABEL = {"ok": "ok", "warn": "WARN", "fail": "FAIL", "skip": "skip"}


def to_json(checks: Sequence[Check], root: str) -> dict:
    return {
        "version": SCHEMA_VERSION,
        "agentVersion": __version__,
        "root": root,
        "status": overall(checks),
        "exitCode": exit_code(checks),
        "counts": {s: sum(1 for c in checks if c.status == s) for s in STATUSES},
        "checks": [c.to_json() for c in checks],
    }


def format_json(checks: Sequence[Check], root: str) -> str:
    return json.dumps(to_json(checks, root), indent=2)


def format_text(checks: Sequence[Check], root: str) -> str:
    """One line per check (status, id, what was found); the fix under each that has one; a
    summary line with the exit code."""
    width = max((len(c.id) for c in checks), default=0)
    lines = [f"gpu-agent doctor {__version__}" + (f" (root {root})" if root != "/" else "")]
    group = None
    for c in checks:
        if c.group != group:
            group = c.group
            lines.append(f"{group}:")
        lines.append(f"  {_LABEL[c.status]:<4}  {c.id:<{width}}  {c.found}")
        if c.fix and c.status in ("warn", "fail"):
            pad = " " * (width + 8)
            for i, fix in enumerate(c.fix.splitlines()):
                lines.append(f"{pad}{'fix: ' if i == 0 else '     '}{fix}")
    counts = {s: sum(1 for c in checks if c.status == s) for s in STATUSES}
    lines.append(", ".join(f"{counts[s]} {s}" for s in STATUSES)
                 + f": exit {exit_code(checks)}")
    return "\n".join(lines)
