"""`gpu-agent sim ...`: the simulated node's command line.

Owns: the `sim` command group. Each sub-command is declared by the module that implements it,
through an `add_cli(subparsers)` function; this module only gathers them.
"""

from __future__ import annotations

import argparse


def _cmd_lib_path(args: argparse.Namespace) -> int:
    from agent.sim import lib_path

    print(lib_path())
    return 0


def add_sim_commands(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("sim", help="simulated GPU node and kubelet, for tests and demos")
    simsub = sim.add_subparsers(dest="sim_command", metavar="SIM_COMMAND")
    simsub.required = True

    p = simsub.add_parser("lib-path", help="print the path of the simulated libnvidia-ml.so.1")
    p.set_defaults(func=_cmd_lib_path)

    from agent.sim import control, driver_tree, kubelet, mig, profile

    for module in (profile, control, mig, kubelet, driver_tree):
        module.add_cli(simsub)
