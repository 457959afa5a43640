"""The `gpu-agent` command: parse arguments, set up logging, dispatch; the one catch-all.

Owns: the command tree and exit codes (0 ok, 1 failure, 2 bad input such as config or usage,
130 interrupted). Must not hold logic of its own: each command lives in the module that owns
what it does, and is imported only when that command runs.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

from agent import __version__
from agent.errors import AgentError

log = logging.getLogger("agent")


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from agent import _fast
    from agent.config import load_config
    from agent.status import exit_code, format_status, read_status

    state_dir = load_config(args, os.environ).state_dir
    doc = read_status(state_dir)
    if args.json:
        print(json.dumps({"version": __version__, "hotPaths": _fast.IMPLEMENTATION,
                          "stateDir": state_dir, "agent": doc}, indent=2))
        return 0
    print(f"gpu-agent {__version__}")
    print(f"hot paths: {_fast.IMPLEMENTATION} "
          f"(events: {_fast.events_impl.__name__}, topology: {_fast.topology_impl.__name__})")
    print(f"python: {sys.version.split()[0]}")
    if doc is None:
        print(f"agent: no status in {state_dir} (never started there)")
    else:
        print(format_status(doc))
    return exit_code(doc)  # 0 running, all in; 1 running, a device out; 3 not running


def _cmd_run(args: argparse.Namespace) -> int:
    from agent.daemon import run

    return run(args, os.environ)


def _cmd_demo(args: argparse.Namespace) -> int:
    from agent.demo import run_demo

    return run_demo(profile=args.profile, keep=args.keep)


def _command(argv: list[str]) -> str | None:
    """The command word of `argv`: the first word that is neither an option nor the value of
    the one global option that takes one (--log-level)."""
    for i, word in enumerate(argv):
        if not word.startswith("-") and not (i and argv[i - 1] == "--log-level"):
            return word
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command tree; with `only="run"`, the global options and `run` alone (the
    service's start path: the other commands' parsers import what `run` does not need)."""
    parser = argparse.ArgumentParser(
        prog="gpu-agent",
        description="Kubernetes GPU device plugin that runs as a host service.",
    )
    parser.add_argument("--version", action="version", version=f"gpu-agent {__version__}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("GPU_AGENT_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (env GPU_AGENT_LOG_LEVEL; default info)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    from agent.config import add_run_options, add_state_command

    p = sub.add_parser(
        "run", allow_abbrev=False,
        help="run the device plugin daemon (register with kubelet, serve until SIGTERM)",
        description="Run the device plugin: discover the GPUs through NVML, serve one "
                    "device-plugin socket per resource beside kubelet.sock and register with "
                    "kubelet; SIGHUP reloads the configuration, SIGTERM/SIGINT stop. "
                    "See docs/operations.md.")
    add_run_options(p)
    p.set_defaults(func=_cmd_run)
    if only == "run":
        return parser

    add_state_command(
        sub, "status", _cmd_status,
        help="show the build and, when an agent runs, its state (from STATE_DIR/status.json)",
        description="Show the build (version, hot-path implementation) and what the agent "
                    "using this state directory last reported. Exits as systemctl status "
                    "does: 0 running with every device in service, 1 running with a device "
                    "withdrawn (or NVML down), 3 not running (--json: always 0).")

    p = sub.add_parser(
        "demo",
        help="walk through a simulated GPU node, a simulated kubelet and the agent",
    )
    p.add_argument("--profile", default="dgx1-v100", help="simulated node profile (default dgx1-v100)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory for inspection")
    p.set_defaults(func=_cmd_demo)

    from agent.sim.cli import add_sim_commands

    add_sim_commands(sub)

    from agent.config import add_cli as add_config_cli

    add_config_cli(sub)

    from agent.state.cli import add_cli as add_state_cli

    add_state_cli(sub)

    from agent.doctor import add_cli as add_doctor_cli  # the checks load when doctor runs

    add_doctor_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = _command(argv)
    if command == "run":
        from agent.deferred import defer_unused_modules

        defer_unused_modules()  # before anything imports grpc
        from agent import arenas

        arenas.limit()  # before any thread starts
        gc.disable()  # the start keeps what it makes: agent.daemon resumes (agent.gcpause)
    parser = build_parser(only="run" if command == "run" else None)
    args = parser.parse_args(argv)
    from agent import logs

    # the agent's lines carry the time, unless the journal, which adds its own, takes them
    logs.setup(getattr(logging, args.log_level.upper()),
               timestamps=args.command == "run" and not logs.journal_stderr())
    try:
        return int(args.func(args) or 0)
    except AgentError as exc:
        print(f"gpu-agent: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception:  # the one catch-all: anything unexpected is a bug, shown with its trace
        log.exception("gpu-agent %s failed unexpectedly", args.command)
        return 1


if __name__ == "__main__":
    sys.exit(main())
