"""kubelet's podresources v1 API: the client.

Owns: `PodResourcesClient` (List and GetAllocatableResources over kubelet's pod-resources
socket, default agent.constants.DEFAULT_POD_RESOURCES_SOCKET), its errors (PodResourcesError
with a kind: missing, unimplemented, unavailable, ...) and its timeouts. agent.state.reconciler
uses it (the daemon hands it in) to match the allocation journal to pods. Must not call NVML,
hold state of its own beyond the channel, or decide which records stand.
"""

from __future__ import annotations

import os
from typing import Any

import grpc

from agent.errors import PodResourcesError
from agent.state.reconcile import PodDevices

RPC_TIMEOUT_S = 5.0
MAX_MESSAGE = 16 << 20  # kubelet's own podresources clients allow 16 MiB
_OPTIONS = [("grpc.enable_http_proxy", 0), ("grpc.max_receive_message_length", MAX_MESSAGE)]


_SINCE = {"List": "Kubernetes 1.20", "GetAllocatableResources": "Kubernetes 1.23"}


class PodResourcesClient:
    """A podresources v1 client on `socket_path` (the channel is opened on first use and
    follows kubelet restarts by itself)."""

    def __init__(self, socket_path: str, timeout: float = RPC_TIMEOUT_S):
        self.socket_path = socket_path
        self.timeout = timeout
        self._channel: grpc.Channel | None = None
        self._stub: Any = None  # a PodResourcesListerStub once used

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None

    def _call(self, method: str, request_type: str) -> Any:
        # The generated modules load when kubelet is first asked, after registration: they
        # are not on the start path.
        from agent._proto.podresources.v1 import api_pb2 as pr
        from agent._proto.podresources.v1 import api_pb2_grpc as pr_grpc

        if not os.path.exists(self.socket_path):
            raise PodResourcesError("missing", f"kubelet's podresources socket "
                                               f"{self.socket_path} does not exist")
        if self._stub is None:
            self._channel = grpc.insecure_channel(f"unix:{self.socket_path}", options=_OPTIONS)
            self._stub = pr_grpc.PodResourcesListerStub(self._channel)
        try:
            return getattr(self._stub, method)(getattr(pr, request_type)(), timeout=self.timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise PodResourcesError(
                    "unimplemented", f"kubelet at {self.socket_path} does not serve "
                                     f"podresources v1 {method} (it needs {_SINCE[method]} or "
                                     f"later): {exc.details()}") from None
            kind = "unavailable" if code in (grpc.StatusCode.UNAVAILABLE,
                                             grpc.StatusCode.DEADLINE_EXCEEDED) else "error"
            raise PodResourcesError(kind, f"podresources {method} on {self.socket_path} "
                                          f"failed: {code.name}: {exc.details()}") from None

    def list(self) -> list[PodDevices]:
        """Every container's devices per resource (kubelet's NUMA split merged later)."""
        response = self._call("List", "ListPodResourcesRequest")
        return [PodDevices(pod.namespace, pod.name, c.name, d.resource_name, tuple(d.device_ids))
                for pod in response.pod_resources for c in pod.containers for d in c.devices]

    def allocatable(self) -> dict[str, tuple[str, ...]]:
        """The device IDs kubelet can allocate, per resource (sorted)."""
        response = self._call("GetAllocatableResources", "AllocatableResourcesRequest")
        out: dict[str, set[str]] = {}
        for d in response.devices:
            out.setdefault(d.resource_name, set()).update(d.device_ids)
        return {name: tuple(sorted(ids)) for name, ids in sorted(out.items())}
