"""The endpoint's listener and what a scrape gathers: the devices' holders, the telemetry.

Owns: the listening socket on agent.metricsAddress (its thread sleeps in accept() between
scrapes; the HTTP server and prometheus_client come with the first connection), which container
holds each device (kubelet's podresources asked at scrape time; the allocation journal's
attributions while kubelet does not answer), the GPUs' telemetry read through
agent.nvml.telemetry on agent.nvml.guard's workers within a time budget (a GPU that has not
answered by then is left out and counted, and not asked again while that call still hangs;
one whose call outlives the guard's own budget is withdrawn by it), and the status
`gpu-agent status` shows. Must not change any part of the daemon it reads, call NVML but
through agent.nvml.telemetry, or take a lock Allocate waits on.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

from agent.constants import TELEMETRY_BUDGET_S
from agent.errors import NvmlNotAnswering, PodResourcesError
from agent.nvml.guard import GUARD
from agent.nvml.telemetry import TelemetryReader
from agent.state.reconcile import Holders, holders_listed

log = logging.getLogger(__name__)


class Exporter:
    """The endpoint for daemon `d` (agent.daemon.Daemon: cfg, resources, registrar, health,
    state, reloads). `start()` listens; `stop()` closes; `status()` is for status.json."""

    def __init__(self, d: Any, address: str, budget_s: float = TELEMETRY_BUDGET_S,
                 on_scrape: Any = None):
        self.d = d
        self.on_scrape = on_scrape or (lambda: None)  # the daemon's wake: status shows it
        self.address = address
        self.budget_s = budget_s
        self.port: int | None = None
        self.error = ""
        self.scrapes = 0
        self.last_scrape: float | None = None
        self.last_duration: float | None = None
        self.reader = TelemetryReader()
        self._nvml_attempts = 0  # the NVML session the reader's handles belong to
        self.failures: dict[tuple[int, str, str], int] = {}  # (gpu, uuid, cause) -> count
        self._inflight: dict[str, futures.Future] = {}
        self._podresources: Any = None
        self._server: Any = None
        self._lock = threading.Lock()  # one scrape at a time

    def start(self) -> bool:
        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")
        try:
            try:
                self._server = _Server(host or "::", int(port), self)
            except OSError:
                if host:
                    raise
                self._server = _Server("0.0.0.0", int(port), self)  # no IPv6 here
        except OSError as exc:
            self.error = f"cannot listen on {self.address}: {exc.strerror or exc}"
            log.error("metrics endpoint: %s (agent.metricsAddress / --metrics-address); "
                      "serving the GPUs without it", self.error)
            return False
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve, name="metrics-http", daemon=True).start()
        log.info("metrics endpoint listening on %s (port %d): /metrics", self.address, self.port)
        return True

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._podresources is not None:
            self._podresources.close()
            self._podresources = None

    def status(self) -> dict:
        return {"address": self.address, "port": self.port, "listening": self._server is not None,
                "error": self.error, "scrapes": self.scrapes, "lastScrape": self.last_scrape,
                "lastScrapeSeconds": self.last_duration}

    # -- a scrape ------------------------------------------------------------------------------

    def collect(self) -> Iterator[Any]:
        """prometheus_client's collector protocol: every family, gathered now."""
        from agent.metrics import families

        with self._lock:
            started = time.monotonic()
            try:
                yield from families.collect(self)
            finally:
                self.scrapes += 1
                self.last_scrape = time.time()
                self.last_duration = time.monotonic() - started
                self.on_scrape()

    def holders(self) -> Holders:
        """(resource, device ID) -> the containers holding it: podresources now, else the
        journal's attributed records."""
        cfg = self.d.cfg
        listing = None
        if cfg.pod_resources_socket:
            from agent.kubelet.podresources import PodResourcesClient

            if self._podresources is None or \
                    self._podresources.socket_path != cfg.pod_resources_socket:
                self._podresources = PodResourcesClient(cfg.pod_resources_socket,
                                                        timeout=self.budget_s)
            try:
                listing = self._podresources.list()
            except PodResourcesError as exc:
                log.debug("metrics: podresources: %s; using the journal's attributions", exc)
        if listing is not None:
            return holders_listed(listing)
        return self.d.state.holders() if self.d.state is not None else {}

    def read(self, gpus: dict[str, int]) -> dict[str, Any]:
        """uuid -> reading for the GPUs that answered within the budget."""
        if not gpus or not self.d.nvml.up:
            return {}
        if self.d.nvml.attempts != self._nvml_attempts:  # NVML initialised again: new handles
            self.reader, self._nvml_attempts = TelemetryReader(), self.d.nvml.attempts
        asked = []
        for uuid in gpus:
            busy = self._inflight.get(uuid)
            if busy is not None and not busy.done():
                self._count(gpus[uuid], uuid, "busy")
            else:
                asked.append(uuid)
        outcomes = GUARD.run_each("telemetry", [(gpus[uuid], self.reader.read, (uuid,))
                                                for uuid in asked], self.budget_s)
        readings = {}
        for uuid, future in zip(asked, outcomes):
            if not future.done():
                self._inflight[uuid] = future
                self._count(gpus[uuid], uuid, "timeout")
                log.warning("metrics: GPU %d %s: NVML did not answer within %g s; left out",
                            gpus[uuid], uuid, self.budget_s)
                continue
            self._inflight.pop(uuid, None)
            error = future.exception()
            if isinstance(error, NvmlNotAnswering):  # a call on it (from anywhere) outlived
                self._count(gpus[uuid], uuid, "busy")  # the NVML budget
                continue
            if error is not None:  # a bug: this GPU is left out of the scrape
                self._count(gpus[uuid], uuid, "error")
                log.error("metrics: reading GPU %d %s failed", gpus[uuid], uuid, exc_info=error)
                continue
            reading = future.result()
            if reading.errors:
                self._count(gpus[uuid], uuid, "error")
                log.debug("metrics: GPU %d %s: %s", gpus[uuid], uuid,
                          "; ".join(map(str, reading.errors)))
            readings[uuid] = reading
        return readings

    def _count(self, index: int, uuid: str, cause: str) -> None:
        key = (index, uuid, cause)
        self.failures[key] = self.failures.get(key, 0) + 1


class _Server:
    """A listening socket whose thread sleeps in accept() between scrapes (socketserver's
    serve_forever() would wake twice a second to look for a stop: `stop()` shuts the socket
    down instead, which wakes it). The HTTP server and prometheus_client's handler are
    imported at the first connection: an agent nobody scrapes does not carry them (3 MB)."""

    def __init__(self, host: str, port: int, collector: Any):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(16)
        except OSError:
            self.socket.close()
            raise
        self.server_address = self.socket.getsockname()
        self.collector = collector
        self._stopping = False
        self._http: Any = None

    def serve(self) -> None:
        while not self._stopping:
            try:
                conn, addr = self.socket.accept()
            except OSError:
                continue  # shut down (the loop ends), or a connection that went away
            if self._http is None:
                self._http = _http_server(self.socket, self.collector)
            self._http.process_request(conn, addr)  # a thread per scrape

    def stop(self) -> None:
        self._stopping = True
        try:
            self.socket.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self.socket.close()


def _http_server(sock: socket.socket, collector: Any) -> Any:
    """A threading HTTP server around the already listening `sock`, answering with
    prometheus_client's handler: its content negotiation and compression, the text written by
    agent.metrics.render where that gives prometheus_client's bytes faster."""
    import gzip
    import socketserver
    from http.server import HTTPServer
    from urllib.parse import parse_qs, urlparse

    from prometheus_client import CollectorRegistry, ProcessCollector
    from prometheus_client.exposition import MetricsHandler, choose_encoder, gzip_accepted

    from agent.metrics.render import Renderer

    class Server(socketserver.ThreadingMixIn, HTTPServer):
        daemon_threads = True

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    # the agent's own process (resident memory, CPU seconds, open and maximum file
    # descriptors, start time), from /proc as prometheus_client reads it, named as every
    # Prometheus client library names them
    ProcessCollector(registry=registry)
    renderer = Renderer()

    class Handler(MetricsHandler.factory(registry)):  # type: ignore[misc]
        def do_GET(self) -> None:
            if "name[]" in parse_qs(urlparse(self.path).query):
                super().do_GET()  # a filtered registry: prometheus_client's own path
                return
            encoder, content_type = choose_encoder(self.headers.get("Accept"))
            output = renderer.encoder(encoder)(registry)
            headers = [("Content-Type", content_type)]
            if gzip_accepted(self.headers.get("Accept-Encoding")):
                # level 1: a tenth larger than prometheus_client's level 9, in under half
                # its CPU (docs/observability.md); it is the scrape's CPU Allocate shares
                output = gzip.compress(output, compresslevel=1)
                headers.append(("Content-Encoding", "gzip"))
            self.send_response(200)
            for header in headers:
                self.send_header(*header)
            self.end_headers()
            self.wfile.write(output)

    server = Server(sock.getsockname(), Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.server_name, server.server_port = "gpu-agent", sock.getsockname()[1]
    return server
