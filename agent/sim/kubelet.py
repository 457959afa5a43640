"""The simulated kubelet: what tests, benchmarks and the demo run instead of a real kubelet.

It behaves like kubelet's device manager (>= 1.25) towards a device plugin: it serves
`Registration` on DIR/kubelet.sock, checks the version and the resource name, dials the plugin
back before answering, keeps one ListAndWatch stream per resource (never restarted: when it ends
the devices turn unhealthy until the plugin registers again), allocates devices for pods through
GetPreferredAllocation / Allocate / PreStartContainer, serves podresources v1, and on "restart"
deletes every socket in DIR. Its own control API (proto/simkubelet/v1/control.proto, on
DIR/sim-control/kubelet-control.sock) lets tests see what it saw (events, snapshots, every
change of a resource's capacity/allocatable per kubelet instance) and act as the cluster would.

Owns: the `gpu-agent sim kubelet|kubelet-state|admit|delete-pod|kubelet-restart` commands, the
socket layout, the public names below and the errors. Must not import grpc at import time: the
`gpu-agent` parser imports this module, so the heavy parts live in private modules loaded on use:

- `_kubelet_manager`: the device manager (registrations, streams, allocation, events)
- `_kubelet_server`: `SimKubelet`, the gRPC servers (Registration, podresources, control)
- `_kubelet_client`: `SimKubeletClient` and the state it returns

Public names: SimKubelet, SimKubeletClient, KubeletState (and its parts), AllocatableChange,
ZeroWindow, zero_windows, registrations_per_instance, FailedDial, the errors, the paths.

Choices, where kubelet versions or the brief differ:
- Register dials the plugin back as kubelet does (plugin/v1beta1/client.go dial(): blocking,
  `dial_timeout` 10 s, an attempt that failed tried again after gRPC's reconnect backoff of
  about 1 s, then 1.6 s), so a plugin that registers while its socket is missing makes its
  Register wait about a second; each such dial is kept (SimKubelet.failed_dials) and noted in
  the REGISTERED event's message.
- GetPreferredAllocation is called whenever the plugin offers it, also when there are exactly
  as many candidates as needed: with no topology hint that is what devicesToAllocate does.
- Register errors come back as gRPC status UNKNOWN (kubelet returns plain Go errors); the
  message names the reason.
- A second registration of a resource (another plugin, or the same one from another socket)
  is handled as the real kubelet of `kubelet_version` handles it, as the end-to-end tests saw
  on kubelet 1.34 and 1.37 (tests/e2e/test_migration.py): the first registration's stream
  runs on and its device lists still count, Allocate goes to the newest. "1.36" (the default,
  and every version before 1.37): when the replaced stream ends, runClient finds the client by
  resource name, which is now the newer one, and disconnects it (plugin/v1beta1/handler.go):
  the resource is unhealthy until a plugin registers again. "1.37": one endpoint per socket
  path; an ended stream removes its own, and the resource turns unhealthy only when its last
  one ends; a second registration from a socket path already connected is refused.
- After a restart podresources lists no pods for `relist_after_restart` seconds (default 0.5),
  as a real kubelet lists none until it has read them from the API server; its device
  assignments are kept meanwhile (pods survive restart() in memory, as in kubelet's
  checkpoint).
- Not simulated: the topology manager (no NUMA hints), init containers and device reuse, the
  5-minute grace before an ended resource's capacity drops to 0, node-status lag, the on-disk
  checkpoint, cpu/memory/DRA in podresources, and the plugin-watcher (pluginregistration)
  path.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from agent.errors import SimError

log = logging.getLogger(__name__)

KUBELET_SOCKET = "kubelet.sock"
# the kubelet device managers the simulator can behave as (see "Choices" above)
KUBELET_VERSIONS = ("1.36", "1.37")
DEFAULT_KUBELET_VERSION = "1.36"
# podresources lists no pods this long after a restart (the real kubelet 1.34 and 1.37 of the
# end-to-end tests: about 0.4 s, until it has read its pods from the API server again)
DEFAULT_RELIST_AFTER_RESTART_S = 0.5
CONTROL_SUBDIR = "sim-control"
CONTROL_SOCKET = "kubelet-control.sock"
PODRESOURCES_SUBDIR = "pod-resources"
# kubelet dials a registering plugin with this timeout (grpc.WithBlock) before it answers
# (pkg/kubelet/cm/devicemanager/plugin/v1beta1/client.go, dial()).
DEFAULT_DIAL_TIMEOUT = 10.0


def kubelet_socket_path(directory: str | os.PathLike) -> str:
    """DIR/kubelet.sock: where the simulated kubelet serves Registration."""
    return os.path.join(os.fspath(directory), KUBELET_SOCKET)


def control_socket_path(directory: str | os.PathLike) -> str:
    """DIR/sim-control/kubelet-control.sock: the control API (a subdirectory survives restarts)."""
    return os.path.join(os.fspath(directory), CONTROL_SUBDIR, CONTROL_SOCKET)


def default_podresources_socket(directory: str | os.PathLike) -> str:
    """DIR/pod-resources/kubelet.sock: podresources v1 unless told otherwise."""
    return os.path.join(os.fspath(directory), PODRESOURCES_SUBDIR, KUBELET_SOCKET)


class SimKubeletError(SimError):
    """The simulated kubelet refused a request; the message is its reason (kubelet's words)."""

    grpc_code = "UNKNOWN"


class PodRejected(SimKubeletError):
    """A pod could not be admitted (not enough healthy devices, a plugin RPC failed, ...)."""

    grpc_code = "FAILED_PRECONDITION"


class PodNotFound(SimKubeletError):
    """No pod with that namespace and name."""

    grpc_code = "NOT_FOUND"


class PodExists(SimKubeletError):
    """A pod with that namespace and name is already admitted."""

    grpc_code = "ALREADY_EXISTS"


class BadRequest(SimKubeletError):
    """The request itself is malformed (empty pod name, negative count, duplicate container)."""

    grpc_code = "INVALID_ARGUMENT"


class RegistrationRejected(SimKubeletError):
    """A Register call was refused (kubelet answers these with gRPC status UNKNOWN)."""


_LAZY = {
    "SimKubelet": "agent.sim._kubelet_server",
    "SimKubeletClient": "agent.sim._kubelet_client",
    "KubeletState": "agent.sim._kubelet_client",
    "ResourceState": "agent.sim._kubelet_client",
    "DeviceState": "agent.sim._kubelet_client",
    "PodState": "agent.sim._kubelet_client",
    "ContainerState": "agent.sim._kubelet_client",
    "Allocation": "agent.sim._kubelet_client",
    "AllocatableChange": "agent.sim._kubelet_client",
    "ZeroWindow": "agent.sim._kubelet_client",
    "zero_windows": "agent.sim._kubelet_client",
    "registrations_per_instance": "agent.sim._kubelet_client",
    "FailedDial": "agent.sim._kubelet_manager",
    "extended_resource_problem": "agent.sim._kubelet_manager",
}


def __getattr__(name: str) -> Any:
    """Load the grpc-based parts on first use (PEP 562), keeping `import agent.sim.kubelet` light."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------------------------------
# Command line


def _cmd_kubelet(args: argparse.Namespace) -> int:
    import signal
    import threading

    from agent.sim._kubelet_server import SimKubelet

    sim = SimKubelet(args.dir, podresources_socket=args.podresources_socket,
                     dial_timeout=args.dial_timeout, kubelet_version=args.kubelet_version,
                     relist_after_restart=args.relist_after_restart)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("simulated kubelet: %s received, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        sim.start()
    except OSError as err:
        sim.stop()
        raise SimError(f"cannot start the simulated kubelet in {args.dir}: {err}") from err
    try:
        print(f"simulated kubelet serving: registration {sim.kubelet_socket}, "
              f"podresources {sim.podresources_socket}, control {sim.control_socket}", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        sim.stop()
    return 0


def _client(args: argparse.Namespace):
    from agent.sim._kubelet_client import SimKubeletClient

    return SimKubeletClient(args.dir)


def _cmd_state(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(client.state().describe())
    return 0


def _parse_request(text: str) -> tuple[str, str, int]:
    """CONTAINER:RESOURCE=COUNT or RESOURCE=COUNT (container "main")."""
    left, sep, count = text.rpartition("=")
    container, _, resource = left.rpartition(":")
    if not sep or not resource:
        raise BadRequest(f"--request {text!r}: expected [CONTAINER:]RESOURCE=COUNT")
    try:
        return container or "main", resource, int(count)
    except ValueError:
        raise BadRequest(f"--request {text!r}: COUNT must be an integer") from None


def _cmd_admit(args: argparse.Namespace) -> int:
    containers: dict[str, dict[str, int]] = {}
    for text in args.request or []:
        container, resource, count = _parse_request(text)
        containers.setdefault(container, {})[resource] = count
    with _client(args) as client:
        pod = client.admit_pod(args.name, containers or {"main": {}}, namespace=args.namespace)
    print(pod.describe())
    return 0


def _cmd_delete_pod(args: argparse.Namespace) -> int:
    with _client(args) as client:
        pod = client.delete_pod(args.name, namespace=args.namespace)
    print(f"deleted {pod.namespace}/{pod.name}")
    return 0


def _cmd_restart(args: argparse.Namespace) -> int:
    with _client(args) as client:
        removed = client.restart()
    print(f"restarted; removed sockets: {', '.join(removed) or '(none)'}")
    return 0


def add_cli(simsub: argparse._SubParsersAction) -> None:
    """Declare the simulated kubelet's commands under `gpu-agent sim`."""
    def with_dir(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--dir", required=True,
                       help="device-plugin directory of the simulated kubelet (kubelet.sock lives here)")
        return p

    p = with_dir(simsub.add_parser(
        "kubelet", help="run a simulated kubelet in the foreground until SIGTERM/SIGINT"))
    p.add_argument("--podresources-socket", default=None,
                   help="podresources v1 socket (default DIR/pod-resources/kubelet.sock)")
    p.add_argument("--dial-timeout", type=float, default=DEFAULT_DIAL_TIMEOUT,
                   help="seconds Register waits to reach the plugin's socket (kubelet: 10)")
    p.add_argument("--relist-after-restart", type=float,
                   default=DEFAULT_RELIST_AFTER_RESTART_S, metavar="SECONDS",
                   help="podresources lists no pods this long after a restart, as a real "
                        f"kubelet (default {DEFAULT_RELIST_AFTER_RESTART_S:g})")
    p.add_argument("--kubelet-version", choices=KUBELET_VERSIONS,
                   default=DEFAULT_KUBELET_VERSION,
                   help="handle a second registration of a resource as this kubelet does "
                        f"(docs/simulator.md; default {DEFAULT_KUBELET_VERSION})")
    p.set_defaults(func=_cmd_kubelet)

    p = with_dir(simsub.add_parser("kubelet-state", help="show what the simulated kubelet knows"))
    p.set_defaults(func=_cmd_state)

    p = with_dir(simsub.add_parser("admit", help="admit a pod on the simulated kubelet"))
    p.add_argument("--name", required=True, help="pod name")
    p.add_argument("--namespace", default="default", help="pod namespace (default: default)")
    p.add_argument("--request", action="append", metavar="[CONTAINER:]RESOURCE=COUNT",
                   help="device request, repeatable (container defaults to main)")
    p.set_defaults(func=_cmd_admit)

    p = with_dir(simsub.add_parser("delete-pod", help="delete a pod and free its devices"))
    p.add_argument("--name", required=True, help="pod name")
    p.add_argument("--namespace", default="default", help="pod namespace (default: default)")
    p.set_defaults(func=_cmd_delete_pod)

    p = with_dir(simsub.add_parser(
        "kubelet-restart", help="restart the simulated kubelet (deletes the sockets in DIR)"))
    p.set_defaults(func=_cmd_restart)
