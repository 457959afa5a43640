"""`gpu-agent state show [--json]`: the allocations recorded in the journal.

Owns: the command and its output (one entry per allocation: pod, namespace, container,
resource, devices, GPUs, since). Reads the journal (or, before the agent migrated it, the old
checkpoint) only: it never moves, repairs or writes anything (the running agent owns the file). Must not import grpc or NVML code.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from agent.errors import CheckpointError, StateError
from agent.state.checkpoint import Checkpoint, Record
from agent.state.journal import JOURNAL_FILE, read_journal, set_aside_files


def _since(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def record_json(r: Record) -> dict:
    return {
        "pod": r.pod.name if r.pod else None,
        "namespace": r.pod.namespace if r.pod else None,
        "container": r.pod.container if r.pod else None,
        "resource": r.resource,
        "devices": list(r.devices),
        "gpus": [{"uuid": g.uuid, "index": g.index} for g in r.gpus],
        "since": r.time,
        "sinceText": _since(r.time),
        "confirmed": r.confirmed,
        "boot": r.boot,
        "id": r.id,
        "adopted": r.response is None,
        "response": None if r.response is None else {
            "envs": dict(r.response.envs),
            "mounts": [m._asdict() for m in r.response.mounts],
            "devices": [d._asdict() for d in r.response.devices],
            "annotations": dict(r.response.annotations),
            "cdiDevices": list(r.response.cdi_devices),
        },
    }


def show_json(path: str, cp: Checkpoint | None) -> dict:
    return {
        "journal": path,
        "exists": cp is not None,
        "written": cp.written if cp else None,
        "boot": cp.boot if cp else None,
        "keyedBy": cp.keyed_by if cp else None,
        "allocations": [record_json(r) for r in (cp.records if cp else ())],
        "setAside": set_aside_files(path),
    }


def show_text(path: str, cp: Checkpoint | None) -> str:
    if cp is None:
        lines = [f"no journal at {path}: no allocations recorded"]
    else:
        lines = [f"journal {path}: {len(cp.records)} allocations, begun "
                 f"{_since(cp.written)} in boot {cp.boot or 'unknown'}, GPUs keyed by "
                 f"{cp.keyed_by}"]
        for r in cp.records:
            who = (f"pod {r.pod.namespace}/{r.pod.name} container {r.pod.container}" if r.pod
                   else "no pod yet (podresources has not listed it)")
            how = " (adopted from podresources)" if r.response is None else ""
            lines.append(f"{who}: {r.resource} since {_since(r.time)}{how}")
            lines.append(f"  devices: {', '.join(r.devices)}")
            lines.append("  GPUs: " + ", ".join(f"{g.index} ({g.uuid})" for g in r.gpus))
    for aside in set_aside_files(path):
        lines.append(f"set aside (bad file kept for inspection): {aside}")
    return "\n".join(lines)


def _cmd_show(args: argparse.Namespace) -> int:
    from agent.config import load_config

    path = os.path.join(load_config(args, os.environ).state_dir, JOURNAL_FILE)
    try:
        cp = read_journal(path)
    except CheckpointError as exc:
        raise StateError(f"journal {path}: {exc} (the agent sets a bad journal aside when "
                         f"it starts)") from None
    if args.json:
        print(json.dumps(show_json(path, cp), indent=2))
    else:
        print(show_text(path, cp))
    return 0


def add_cli(sub: Any) -> None:
    """Register `gpu-agent state show` on the top-level sub-parsers."""
    from agent.config import add_state_command

    p = sub.add_parser("state", help="show the allocations the agent recorded",
                       description="The allocation journal in the state directory.")
    ssub = p.add_subparsers(dest="state_command", metavar="STATE_COMMAND")
    ssub.required = True
    add_state_command(
        ssub, "show", _cmd_show,
        help="list the recorded allocations: pod, namespace, container, resource, devices, "
             "GPUs, since",
        description="List the allocations in STATE_DIR/allocations.journal (reads only).")
