"""The DRA driver's devices' health as kubelet watches it (KEP-4680, DRAResourceHealth).

Owns: the health of each published device (`HealthFeed.set`: pool, device name -> healthy and
why not), and NodeWatchResources in v1 and v1alpha1 (kubelet 1.37 picks the first of those the
registration lists; 1.34's, with the ResourceHealthStatus gate on, calls v1alpha1): each stream
gets every device at once, then again on each change, and again after REFRESH_S without one
(kubelet times a device out, as Unknown, when it is not sent again within
health_check_timeout_seconds, STALE_S; 1.34's v1alpha1 has no such field and a fixed 30 s,
so v1alpha1 streams are sent again every REFRESH_V1ALPHA1_S). kubelet shows it in the pod's
status.containerStatuses[].allocatedResourcesStatus. A stream ends when kubelet cancels it or
the plugin stops. Must not decide health (agent.dramode hands over what the monitor says).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from agent._proto.drahealth.v1 import api_pb2 as v1
from agent._proto.drahealth.v1 import api_pb2_grpc as v1_grpc
from agent._proto.drahealth.v1.constants import DRA_RESOURCE_HEALTH_SERVICE as V1_SERVICE
from agent._proto.drahealth.v1alpha1 import api_pb2 as v1alpha1
from agent._proto.drahealth.v1alpha1 import api_pb2_grpc as v1alpha1_grpc
from agent._proto.drahealth.v1alpha1.constants import (
    DRA_RESOURCE_HEALTH_SERVICE as V1ALPHA1_SERVICE,
)

REFRESH_S = 60.0  # an idle stream is sent the same health again this often
STALE_S = 180  # health_check_timeout_seconds: 3 refreshes missed, kubelet says Unknown
REFRESH_V1ALPHA1_S = 20.0  # kubelet 1.34: a fixed 30 s timeout (cm/dra/healthinfo.go:31-33)
MESSAGE_MAX = 1024  # kubelet truncates longer messages
SERVICES = (V1_SERVICE, V1ALPHA1_SERVICE)  # in a registration's supported_versions, newest first


class HealthFeed:
    """The devices' health, and the streams that watch it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._health: dict[tuple[str, str], str] = {}  # (pool, device) -> "" or why unhealthy
        self._version = 0
        self._closed = False
        self.streams = 0  # open now

    def set(self, health: dict[tuple[str, str], str]) -> None:
        """(pool, device name) -> "" when healthy, else why not."""
        with self._cond:
            if health == self._health:
                return
            self._health = dict(health)
            self._version += 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def watch(self, api: Any, context: Any, refresh: float = REFRESH_S):
        """The responses of one NodeWatchResources stream in API `api`."""
        ended = threading.Event()

        def cancelled() -> None:
            ended.set()
            with self._cond:
                self._cond.notify_all()

        context.add_callback(cancelled)
        seen = -1
        with self._cond:
            self.streams += 1
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda last=seen: self._closed or ended.is_set() or
                                        self._version != last, timeout=refresh)
                    if self._closed or ended.is_set():
                        return
                    seen, health = self._version, sorted(self._health.items())
                now = int(time.time())
                yield api.NodeWatchResourcesResponse(devices=[api.DeviceHealth(
                    device=api.DeviceIdentifier(pool_name=pool, device_name=name),
                    health=api.UNHEALTHY if why else api.HEALTHY, last_updated_time=now,
                    health_check_timeout_seconds=STALE_S, message=why[:MESSAGE_MAX])
                    for (pool, name), why in health])
        finally:
            with self._cond:
                self.streams -= 1


class _Servicer:
    def __init__(self, feed: HealthFeed, api: Any, refresh: float):
        self.feed, self.api, self.refresh = feed, api, refresh

    def NodeWatchResources(self, request, context):
        return self.feed.watch(self.api, context, self.refresh)


def add_to_server(feed: HealthFeed, server: Any) -> None:
    v1_grpc.add_DRAResourceHealthServicer_to_server(_Servicer(feed, v1, REFRESH_S), server)
    v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(
        _Servicer(feed, v1alpha1, REFRESH_V1ALPHA1_S), server)
