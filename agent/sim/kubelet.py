"""The simulated kubelet: device-plugin registration, ListAndWatch, allocation and podresources.

Owns: the `gpu-agent sim kubelet` command. Must not import grpc at module import time (the CLI
builds its parser by importing this module).
"""

from __future__ import annotations

import argparse


def _cmd_kubelet(args: argparse.Namespace) -> int:
    raise NotImplementedError("the simulated kubelet is not written yet")


def add_cli(simsub: argparse._SubParsersAction) -> None:
    p = simsub.add_parser("kubelet", help="run a simulated kubelet in the foreground")
    p.add_argument("--dir", required=True, help="device-plugin directory (kubelet.sock lives here)")
    p.add_argument("--podresources-socket", default=None,
                   help="podresources socket (default DIR/pod-resources/kubelet.sock)")
    p.set_defaults(func=_cmd_kubelet)
