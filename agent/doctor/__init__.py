"""`gpu-agent doctor [--json]`: read-only checks of a GPU node, each with what it found and the
exact command or file change that fixes it.

Owns: the command's options (`add_cli`: run's configuration options, so the doctor sees the
agent's configuration, plus --root, --json and --timeout) and `run(args) -> int`, whose exit
code is 0 when every check is ok (or does not apply), 1 with warnings, 2 with failures. The
checks live in this package, one module per group: driver (NVML), toolkit
(nvidia-container-toolkit, the CDI spec), runtime (containerd, CRI-O), kubelet (sockets,
allocatable devices, registration), dra (the DRA driver's sockets, registration and slice),
devnodes (device nodes, /dev/char links), service (the unit, config, state directory,
journal); `runner` runs them, `report` prints them. This module
imports nothing heavy: the `gpu-agent` parser imports it. Must not change anything on the node.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def run(args: argparse.Namespace) -> int:
    """Run every check against the node under args.root; print the report; the exit code."""
    from agent.doctor.context import make_context
    from agent.doctor.model import exit_code
    from agent.doctor.report import format_json, format_text
    from agent.doctor.runner import run_checks

    ctx = make_context(args, os.environ, root=args.root, timeout=args.timeout)
    checks = run_checks(ctx)
    print(format_json(checks, ctx.root) if args.json else format_text(checks, ctx.root))
    return exit_code(checks)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value <= 60:
        raise argparse.ArgumentTypeError("expected seconds between 0 and 60")
    return value


def add_cli(sub: Any) -> None:
    """Register `gpu-agent doctor` on the top-level sub-parsers."""
    from agent.config import add_run_options
    from agent.doctor.context import DEFAULT_TIMEOUT_S, NVML_TIMEOUT_S

    p = sub.add_parser(
        "doctor", allow_abbrev=False,
        help="check the node (driver, toolkit, container runtime, kubelet, /dev/char, the "
             "agent) and say what to fix; exit 0 ok, 1 warnings, 2 failures",
        description="Read-only checks of this GPU node, each ok / warn / fail / skip with "
                    "what was found and the exact command or file change that fixes it. "
                    "Give it the agent's configuration (--config, or the same flags) so it "
                    "checks what the agent runs with; without --config it reads "
                    "/etc/gpu-agent/config.yaml when that exists. Exit code: 0 every check "
                    "ok or skipped, 1 warnings, 2 failures (and 2 for bad usage). "
                    "See docs/troubleshooting.md.")
    add_run_options(p)
    p.add_argument("--root", default="/",
                   help="read the host files the doctor knows (/dev, /etc/containerd, "
                        "/etc/crio, the PATH directories) under this directory; the paths "
                        "in the agent's configuration are used as given (default /)")
    p.add_argument("--json", action="store_true",
                   help="print the JSON report (schema in docs/troubleshooting.md)")
    p.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"bound on each subprocess and kubelet RPC (default "
                        f"{DEFAULT_TIMEOUT_S:g}); NVML gets {NVML_TIMEOUT_S:g} s")
    p.set_defaults(func=run)
