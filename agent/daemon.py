"""`gpu-agent run`: the daemon's lifecycle, from start to a clean stop.

Owns: the order of things (config → allocation journal → NVML → discovery → resource
managers → plugin servers → registration), the one main loop that reacts to signals (SIGHUP
reload, SIGTERM/SIGINT stop), to inotify events in kubelet's socket directory (kubelet.sock
re-created or our socket gone: restart the servers and register again) and to timers (NVML
init retry with backoff when failOnInitError is false, registration retries, the systemd
watchdog), the systemd notifications (through agent.systemd), and the status summary (a
STATUS= line and STATE_DIR/status.json, which `gpu-agent status` reads).

Threads: the main thread runs the loop and is the only one that changes the daemon's state;
gRPC serves from its own pool (agent.kubelet.plugin), and each Register call runs in a short
thread of its own that hands its result back through a pipe, so a slow kubelet never holds up
a signal. Must not talk gRPC itself (agent.kubelet does) nor build devices or responses
(agent.rm does); NVML is reached only through agent.nvml.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import selectors
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent import __version__
from agent.config import Config, load_config
from agent.errors import AgentError, ConfigError, NvmlError, NvmlLibraryError
from agent.health.monitor import HealthMonitor, monitor_from_config
from agent.health.monitor import format_status as format_health
from agent.kubelet.plugin import PluginServer, RegistrationError
from agent.kubelet.podresources import AllocationState, format_state
from agent.kubelet.watch import CREATED, DELETED, DIR_GONE, SocketDirWatch
from agent.nvml import discovery, library
from agent.rm import cdi
from agent.rm.allocate import ResponseOptions
from agent.rm.devices import devices_by_resource
from agent.rm.manager import ResourceManager
from agent.rm.topology import TopologyModel
from agent.systemd import Notifier

log = logging.getLogger(__name__)

STATUS_FILE = "status.json"
# NVML init retries (failOnInitError false): 1 s, doubling, at most this.
NVML_RETRY_FIRST_S = 1.0
NVML_RETRY_MAX_S = 30.0
# Registration retries while kubelet.sock exists but does not accept us.
REGISTER_RETRY_FIRST_S = 0.1
REGISTER_RETRY_MAX_S = 5.0
# With kubelet.sock absent, inotify says when it comes; this is only a safety net.
KUBELET_ABSENT_RETRY_S = 5.0
LOOP_TICK_S = 1.0
# kubelet's restart removes sockets then re-creates kubelet.sock; act once on the whole burst.
RESTART_SETTLE_S = 0.1


class InitError(AgentError):
    """NVML or discovery failed at start with failOnInitError true (exit 1)."""


def check_supported(cfg: Config) -> None:
    """Refuse, with the key and where it was set, settings `run` does not implement yet
    (config.py accepts them, as NVIDIA's schema has them)."""
    if cfg.mig_strategy != "none":
        src = cfg.source("mig_strategy")
        key = {"flag": src.name, "env": src.name}.get(src.kind, "flags.migStrategy")
        where = {"flag": "command line", "env": "environment"}.get(src.kind, src.name)
        raise ConfigError(key, f"MIG strategy {cfg.mig_strategy!r} is not supported by "
                               f"gpu-agent run yet (MIG devices come in a later release); "
                               f"use 'none'", where)
    if cfg.sharing.time_slicing is not None:
        raise ConfigError("sharing.timeSlicing", "time-slicing is not supported by gpu-agent "
                                                 "run yet; remove it", cfg.config_file or "")
    if cfg.sharing.mps is not None:
        raise ConfigError("sharing.mps", "MPS sharing is not supported by gpu-agent run yet; "
                                         "remove it", cfg.config_file or "")
    if cfg.imex.channel_ids:
        raise ConfigError("imex.channelIDs", "IMEX channels are not supported by gpu-agent run "
                                             "yet; remove them", cfg.config_file or "")


def response_options(cfg: Config) -> ResponseOptions:
    return ResponseOptions(list_strategies=cfg.device_list_strategy,
                           id_strategy=cfg.device_id_strategy,
                           pass_device_specs=cfg.pass_device_specs,
                           cdi_annotation_prefix=cfg.cdi_annotation_prefix,
                           dev_root=cfg.dev_root)


def init_failure_message(path: str, exc: Exception, cfg: Config) -> str:
    return (f"cannot initialise NVML with {path}: {exc}. Check that the NVIDIA driver is "
            f"loaded (nvidia-smi; lsmod | grep nvidia) and that the NVML library is the "
            f"driver's: --nvml-library / GPU_AGENT_NVML_LIBRARY ({cfg.nvml_library}), "
            f"--driver-root / NVIDIA_DRIVER_ROOT ({cfg.driver_root})")


@dataclass
class _Plugin:
    """The daemon's view of one resource's server and its registration."""

    server: PluginServer
    generation: int
    registered: bool = False
    registrations: int = 0
    in_flight: bool = False
    retry_at: float | None = None
    backoff: float = REGISTER_RETRY_FIRST_S
    last_error: str = ""


class Daemon:
    """One run of the agent. `Daemon(args, environ).run()` returns the exit code."""

    def __init__(self, args: Any, environ: Mapping[str, str] | None = None):
        self.args = args
        self.environ = os.environ if environ is None else environ
        self.notifier = Notifier(self.environ)
        self.cfg: Config | None = None
        self.started = time.time()
        self.phase = "starting"
        self.stop_requested = False
        # NVML
        self.nvml_path = ""
        self.nvml_up = False
        self.nvml_error = ""
        self.nvml_attempts = 0
        self.nvml_retry_at: float | None = None
        self.nvml_backoff = NVML_RETRY_FIRST_S
        self.gpus: list[discovery.Gpu] = []
        self.cdi: cdi.CdiCheck | None = None  # the last CDI spec check (cdi-* strategies)
        self.topology: TopologyModel | None = None  # rebuilt when the GPU set changes
        # allocation journal and its reconciliation with podresources (agent.state)
        self.state: AllocationState | None = None
        self._state_written = -1
        # device health (agent.health): the event loop, recovery, isolation
        self.health: HealthMonitor | None = None
        self._health_dirty = False
        # resources
        self.managers: dict[str, ResourceManager] = {}
        self.plugins: dict[str, _Plugin] = {}
        self.generation = 0
        self.restarts = 0
        self.reloads = 0
        self.last_error = ""
        # kubelet directory watch
        self.watch: SocketDirWatch | None = None
        self.watch_retry_at: float | None = None
        self.restart_at: float | None = None
        self.restart_why: list[str] = []
        # loop plumbing
        self._selector = selectors.DefaultSelector()
        self._sig_r, self._sig_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._results: collections.deque = collections.deque()
        self._wake_lock = threading.Lock()
        self.ready_sent = False
        self._last_status = ""
        self._watchdog_at: float | None = None
        self._status_warned = False

    # -- entry ---------------------------------------------------------------------------------

    def run(self) -> int:
        self._install_signals()
        try:
            self.cfg = load_config(self.args, self.environ)
            check_supported(self.cfg)
            log.info("gpu-agent %s starting (pid %d); config file: %s", __version__,
                     os.getpid(), self.cfg.config_file or "none")
            self._prepare_state_dir()
            self._start_state()
            if not self._start_nvml(first=True):
                pass  # degraded: retried from the loop
            self._publish()
            if self.notifier.watchdog_interval:
                self._watchdog_at = time.monotonic()
            self._loop()
        finally:
            self._shutdown()
        return 0

    def _install_signals(self) -> None:
        signal.set_wakeup_fd(self._sig_w, warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda s, f: None)  # the wakeup fd carries the number
        self._selector.register(self._sig_r, selectors.EVENT_READ, "signal")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")

    # -- NVML and discovery ------------------------------------------------------------------

    def _start_nvml(self, first: bool = False) -> bool:
        """Initialise NVML and discover; on success build and serve the resources. On failure
        exit (failOnInitError true, at start) or schedule a retry."""
        cfg = self.cfg
        self.nvml_attempts += 1
        try:
            self.nvml_path = library.resolve_library_path(cfg.driver_root,
                                                          cfg.nvml_library_explicit)
            library.init(self.nvml_path)
        except (NvmlError, NvmlLibraryError) as exc:
            message = init_failure_message(self.nvml_path or cfg.nvml_library, exc, cfg)
            return self._nvml_failed(message, first)
        try:
            gpus = discovery.discover()
        except NvmlError as exc:
            library.shutdown()
            return self._nvml_failed(f"GPU discovery through NVML ({self.nvml_path}) failed: "
                                     f"{exc}", first)
        self.nvml_up, self.nvml_error, self.nvml_retry_at = True, "", None
        log.info("NVML initialised from %s%s; %d GPUs", self.nvml_path,
                 "" if first else f" after {self.nvml_attempts} attempts", len(gpus))
        self._set_gpus(gpus)
        self._build_and_serve()
        return True

    def _nvml_failed(self, message: str, first: bool) -> bool:
        if self.cfg.fail_on_init_error and first:
            raise InitError(message + "; or set failOnInitError: false "
                                      "(--fail-on-init-error=false) to keep running and retry")
        delay = self.nvml_backoff
        self.nvml_backoff = min(self.nvml_backoff * 2, NVML_RETRY_MAX_S)
        self.nvml_retry_at = time.monotonic() + delay
        changed = message != self.nvml_error
        self.nvml_error = message
        (log.error if changed else log.info)(
            "%s; failOnInitError is false: advertising nothing, retrying NVML in %g s "
            "(attempt %d)", message, delay, self.nvml_attempts)
        if not self.ready_sent:  # the degraded steady state: up, waiting for the driver
            self._send_ready()
        return False

    def _set_gpus(self, gpus: list[discovery.Gpu]) -> None:
        self.gpus = gpus
        for g in gpus:
            numa = "-" if g.numa_node is None else g.numa_node
            if g.mig_enabled:
                log.info("GPU %d %s (%s): MIG enabled; not advertised with migStrategy none",
                         g.index, g.uuid, g.name)
            else:
                log.info("GPU %d %s (%s, PCI %s, NUMA %s, %d MiB, compute %d.%d) discovered",
                         g.index, g.uuid, g.name, g.pci_bus_id, numa, g.memory_total >> 20,
                         *g.compute_capability)
        if not gpus:
            log.warning("no GPUs found: advertising nothing")

    def _topology(self) -> TopologyModel:
        """The link model of the GPUs, read from NVML once per GPU set (at start, and when a
        reload finds other GPUs); pairs NVML cannot describe count as SYS (agent.nvml)."""
        gpus = sorted(self.gpus, key=lambda g: g.index)
        if self.topology is not None and \
                [g.uuid for g in self.topology.gpus] == [g.uuid for g in gpus]:
            return self.topology
        try:
            links = discovery.read_links(gpus)
        except NvmlError as exc:
            log.warning("GPU links unreadable (%s): every pair counts as SYS", exc)
            links = {}
        self.topology = TopologyModel.from_links(gpus, links)
        log.info("GPU topology: %s", self.topology.summary())
        return self.topology

    # -- resources and servers ---------------------------------------------------------------

    def _build_and_serve(self) -> None:
        cfg = self.cfg
        options = response_options(cfg)
        journal = self.state.record_allocation if self.state is not None else None
        topology = self._topology()
        self.managers = {
            name: ResourceManager(name, devices, options, journal=journal, topology=topology,
                                  allocation_policy=cfg.allocation_policy,
                                  replica_policy=cfg.replica_allocation_policy)
            for name, devices in devices_by_resource(self.gpus, cfg.resources.gpus).items()
        }
        if self.state is not None:
            self.state.poke()  # the GPUs are known now: match records to them
        self._start_health()  # before serving: the first snapshot has the recorded faults
        for name, m in self.managers.items():
            log.info("resource %s: %d devices (%s)", name, len(m.devices),
                     ", ".join(f"GPU {d.gpu_index} {d.gpu_uuid}" for d in m.devices))
        self._check_cdi()
        if not cfg.plugin_socket_dir:
            log.info("kubelet socket is empty (do not connect to kubelet): not serving")
            self._send_ready()
            return
        self._ensure_watch()
        self._start_servers()

    def _check_cdi(self) -> None:
        """With a cdi-* device-list strategy, check (at start and on every reload) that the
        toolkit's CDI spec defines every name Allocate will hand out. A missing name is logged
        as an error, with what to run, and shown in STATUS, but is not fatal: the toolkit's
        nvidia-cdi-refresh may write the spec moments later, and only containers given those
        devices are affected (docs/install.md#cdi)."""
        devices = [d for m in self.managers.values() for d in m.devices]
        self.cdi = cdi.check(devices, response_options(self.cfg), self.cfg.cdi_spec_dirs)
        if self.cdi is not None:
            level = log.error if not self.cdi.ok else log.warning if self.cdi.index.problems \
                else log.info
            level("%s", self.cdi.message())

    def _start_servers(self) -> None:
        self.generation += 1
        for name, manager in self.managers.items():
            server = PluginServer(manager, self.cfg.plugin_socket_dir)
            old = self.plugins.get(name)
            server.start()
            self.plugins[name] = _Plugin(server, self.generation,
                                         registrations=old.registrations if old else 0)
            self._register(name)

    def _stop_servers(self, why: str) -> None:
        plugins, self.plugins = self.plugins, {}
        for p in plugins.values():
            p.server.stop()
        if plugins:
            log.info("plugin servers stopped (%s)", why)
        self.plugins = {name: _Plugin(p.server, -1, registrations=p.registrations)
                        for name, p in plugins.items()}  # keep the counts for the next start

    def _restart_servers(self, why: str) -> None:
        log.info("restarting the plugin servers and registering again: %s", why)
        self.restarts += 1
        self._stop_servers(why)
        self._start_servers()
        self._publish()

    # -- registration --------------------------------------------------------------------------

    def _register(self, name: str) -> None:
        plugin = self.plugins[name]
        plugin.in_flight, plugin.retry_at = True, None
        generation, server, kubelet = plugin.generation, plugin.server, self.cfg.kubelet_socket

        def attempt() -> None:
            # Anything but a RegistrationError is a bug: threading's excepthook prints its
            # trace, and the loop still hears of the failure (and retries).
            error = "the registration thread failed unexpectedly (trace above)"
            try:
                server.register(kubelet)
                error = ""
            except RegistrationError as exc:
                error = str(exc)
            finally:
                self._post((name, generation, error))

        threading.Thread(target=attempt, name=f"register-{name}", daemon=True).start()

    def _post(self, result: tuple) -> None:
        """From another thread: hand `result` to the loop and wake it."""
        with self._wake_lock:
            if self._wake_w < 0:
                return  # stopped: nobody listens
            self._results.append(result)
            try:
                os.write(self._wake_w, b"r")
            except BlockingIOError:
                pass  # the pipe is full: the loop is awake anyway

    def _on_registered(self, name: str, generation: int, error: str) -> None:
        plugin = self.plugins.get(name)
        if plugin is None or plugin.generation != generation:
            return  # a server already replaced
        plugin.in_flight = False
        if not error:
            plugin.registered, plugin.registrations = True, plugin.registrations + 1
            plugin.backoff, plugin.last_error = REGISTER_RETRY_FIRST_S, ""
            log.info("registered %s with kubelet at %s (endpoint %s, %d devices; registration "
                     "%d)", name, self.cfg.kubelet_socket, plugin.server.endpoint,
                     len(plugin.server.manager.devices), plugin.registrations)
            if all(p.registered for p in self.plugins.values()) and not self.ready_sent:
                self._send_ready()
            if self.state is not None:
                self.state.poke()  # kubelet is (back) up: ask podresources now
            self._publish()
            return
        kubelet_there = os.path.exists(self.cfg.kubelet_socket)
        if kubelet_there:
            delay = plugin.backoff
            plugin.backoff = min(plugin.backoff * 2, REGISTER_RETRY_MAX_S)
        else:
            delay = KUBELET_ABSENT_RETRY_S
            error = f"kubelet is not serving {self.cfg.kubelet_socket} yet; waiting for it"
        (log.warning if error != plugin.last_error else log.debug)(
            "%s; retrying in %g s", error, delay)
        plugin.last_error = error
        plugin.retry_at = time.monotonic() + delay
        self._publish()

    # -- the kubelet directory -------------------------------------------------------------------

    def _ensure_watch(self) -> None:
        directory = self.cfg.plugin_socket_dir
        if self.watch is not None and self.watch.directory == directory:
            return
        self._close_watch()
        try:
            os.makedirs(directory, mode=0o750, exist_ok=True)
            self.watch = SocketDirWatch(directory)
        except OSError as exc:
            log.error("cannot watch the kubelet socket directory %s: %s; retrying in 1 s",
                      directory, exc)
            self.watch_retry_at = time.monotonic() + 1.0
            return
        self.watch_retry_at = None
        self._selector.register(self.watch.fileno(), selectors.EVENT_READ, "watch")

    def _close_watch(self) -> None:
        if self.watch is not None:
            self._selector.unregister(self.watch.fileno())
            self.watch.close()
            self.watch = None

    def _on_dir_events(self) -> None:
        kubelet_name = os.path.basename(self.cfg.kubelet_socket)
        why = []
        gone = False
        for event in self.watch.read():
            log.debug("kubelet directory: %s %s", event.kind, event.name)
            if event.kind == DIR_GONE:
                gone = True
            elif event.kind == CREATED and event.name == kubelet_name:
                why.append(f"{kubelet_name} was created (kubelet restarted)")
            elif event.kind == DELETED:
                for p in self.plugins.values():
                    if event.name == p.server.endpoint and not p.server.owns_socket():
                        why.append(f"our socket {p.server.endpoint} was removed")
        if gone:
            log.warning("the kubelet socket directory %s went away; watching for it again",
                        self.cfg.plugin_socket_dir)
            self._close_watch()
            self._ensure_watch()
            why.append("the kubelet socket directory was re-created")
        if why and self.nvml_up and self.watch is not None:
            self.restart_why += why
            if self.restart_at is None:
                self.restart_at = time.monotonic() + RESTART_SETTLE_S

    # -- reload and stop -----------------------------------------------------------------------

    def _reload(self) -> None:
        self.notifier.reloading()
        self.phase = "reloading"
        log.info("SIGHUP: reloading the configuration (config file: %s)",
                 self.cfg.config_file or "none")
        try:
            new = load_config(self.args, self.environ)
            check_supported(new)
        except ConfigError as exc:
            self.last_error = f"reload refused: {exc}"
            log.error("reload refused, keeping the running configuration: %s", exc)
            self.phase = "running"
            self._send_ready()
            return
        old, self.cfg = self.cfg, new
        self.reloads += 1
        if self.state is not None:
            self.state.reconfigure(keyed_by=new.checkpoint_device_id_strategy,
                                   socket_path=new.pod_resources_socket,
                                   period=new.reconcile_interval)
        self.last_error = ""
        for name in ("nvml_library", "driver_root"):
            if getattr(old, name) != getattr(new, name) and self.nvml_up:
                log.warning("%s changed from %s to %s: NVML stays loaded from %s until the "
                            "agent restarts", name, getattr(old, name), getattr(new, name),
                            self.nvml_path)
        if self.nvml_up:
            self._stop_servers("reload")
            try:
                gpus = discovery.discover()
            except NvmlError as exc:
                log.error("GPU discovery on reload failed: %s; keeping the %d GPUs found "
                          "before", exc, len(self.gpus))
            else:
                if [g.uuid for g in gpus] != [g.uuid for g in self.gpus]:
                    self._set_gpus(gpus)
                self.gpus = gpus
            if new.plugin_socket_dir != old.plugin_socket_dir:
                self._close_watch()
                self.plugins = {}
            self._build_and_serve()
        elif self.nvml_retry_at is not None:
            self.nvml_retry_at = time.monotonic()  # try the new settings now
        log.info("configuration reloaded (reload %d)", self.reloads)
        self.phase = "running"
        self._send_ready()

    def _shutdown(self) -> None:
        self.phase = "stopping"
        self.notifier.stopping(self._summary())
        signal.set_wakeup_fd(-1)
        self._stop_health()
        for p in self.plugins.values():
            p.server.manager.close()
            p.server.stop()
        self.plugins = {}
        self._close_watch()
        if self.state is not None:
            self.state.close()
        if self.nvml_up:
            try:
                library.shutdown()
            except NvmlError as exc:
                log.warning("NVML shutdown: %s", exc)
            self.nvml_up = False
        self.phase = "stopped"
        self._write_status()
        self.notifier.close()
        with self._wake_lock:
            for fd in (self._sig_r, self._sig_w, self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_w = -1
        self._selector.close()
        log.info("gpu-agent stopped")

    # -- the loop ----------------------------------------------------------------------------

    def _timers(self) -> list[float]:
        due = [p.retry_at for p in self.plugins.values() if p.retry_at is not None]
        due += [t for t in (self.nvml_retry_at, self.watch_retry_at, self._watchdog_at,
                            self.restart_at) if t is not None]
        return due

    def _loop(self) -> None:
        self.phase = "running" if self.phase == "starting" else self.phase
        while not self.stop_requested:
            now = time.monotonic()
            timeout = min([LOOP_TICK_S] + [max(0.0, t - now) for t in self._timers()])
            for key, _ in self._selector.select(timeout):
                if key.data == "signal":
                    self._on_signals()
                elif key.data == "wake":
                    self._drain(self._wake_r)
                elif key.data == "watch" and self.watch is not None:
                    self._on_dir_events()
                if self.stop_requested:
                    return
            while self._results:
                self._on_registered(*self._results.popleft())
            self._run_timers()
            self._publish()

    def _run_timers(self) -> None:
        now = time.monotonic()
        if self._watchdog_at is not None and now >= self._watchdog_at:
            self.notifier.watchdog()
            self._watchdog_at = now + self.notifier.watchdog_interval
        if self.nvml_retry_at is not None and now >= self.nvml_retry_at:
            self.nvml_retry_at = None
            self._start_nvml()
        if self.restart_at is not None and now >= self.restart_at:
            why, self.restart_at, self.restart_why = self.restart_why, None, []
            if self.nvml_up and self.plugins:
                self._restart_servers("; ".join(dict.fromkeys(why)))
        if self.watch_retry_at is not None and now >= self.watch_retry_at and self.nvml_up:
            self._ensure_watch()
            if self.watch is not None:
                self._restart_servers("watching the kubelet socket directory again")
        for name, p in list(self.plugins.items()):
            if p.retry_at is not None and now >= p.retry_at and not p.in_flight:
                self._register(name)

    @staticmethod
    def _drain(fd: int) -> bytes:
        data = b""
        while True:
            try:
                chunk = os.read(fd, 512)
            except BlockingIOError:
                return data
            if not chunk:
                return data
            data += chunk

    def _on_signals(self) -> None:
        for signum in self._drain(self._sig_r):
            if signum in (signal.SIGTERM, signal.SIGINT):
                log.info("%s: stopping", signal.Signals(signum).name)
                self.stop_requested = True
                return
            if signum == signal.SIGHUP:
                self._reload()

    # -- status and notifications ------------------------------------------------------------

    def _send_ready(self) -> None:
        self.ready_sent = True
        self._last_status = self._summary()
        self.notifier.ready(self._last_status)
        self._write_status()

    def _summary(self) -> str:
        """The one-line status (systemd STATUS=)."""
        if self.phase in ("stopping", "stopped"):
            return f"{self.phase}"
        if not self.nvml_up:
            if self.nvml_error:
                return (f"NVML unavailable, advertising nothing, retrying (attempt "
                        f"{self.nvml_attempts}): {self.nvml_error}")
            return "starting"
        parts = []
        for name, m in self.managers.items():
            p = self.plugins.get(name)
            if not self.cfg.plugin_socket_dir:
                state = "not serving (no kubelet socket)"
            elif p is None or p.generation < 0:
                state = "not serving"
            elif p.registered:
                state = f"registered ({p.registrations})"
            elif p.last_error:
                state = "waiting for kubelet"
            else:
                state = "registering"
            parts.append(f"{name}: {m.healthy_count}/{len(m.devices)} healthy, {state}")
        text = "; ".join(parts) or "no GPUs: advertising nothing"
        if self.state is not None and self.state.problem:
            text += f"; {self.state.problem}"
        if self.cdi is not None and not self.cdi.ok:
            text += f"; {self.cdi.summary()}"
        if self.last_error:
            text += f"; {self.last_error}"
        return text

    def status(self) -> dict:
        """The status document written to STATE_DIR/status.json."""
        resources = []
        for name, m in self.managers.items():
            p = self.plugins.get(name)
            snap = m.snapshot()
            resources.append({
                "name": name,
                "socket": p.server.path if p else None,
                "registered": bool(p and p.registered),
                "registrations": p.registrations if p else 0,
                "lastError": p.last_error if p else "",
                "devices": [{"id": h.device.id, "index": h.device.gpu_index,
                             "uuid": h.device.gpu_uuid, "numaNode": h.device.numa_node,
                             "healthy": h.healthy, "reason": h.reason} for h in snap.devices],
            })
        return {
            "pid": os.getpid(),
            "version": __version__,
            "phase": self.phase,
            "summary": self._summary(),
            "started": self.started,
            "updated": time.time(),
            "configFile": self.cfg.config_file if self.cfg else None,
            "kubeletSocket": self.cfg.kubelet_socket if self.cfg else None,
            "nvml": {"up": self.nvml_up, "library": self.nvml_path, "error": self.nvml_error,
                     "attempts": self.nvml_attempts},
            "restarts": self.restarts,
            "reloads": self.reloads,
            "lastError": self.last_error,
            "resources": resources,
            "state": self.state.status() if self.state is not None else None,
            "cdi": self.cdi.to_json() if self.cdi is not None else None,
            "health": self.health.status() if self.health is not None else None,
        }

    def _publish(self) -> None:
        summary = self._summary()
        if summary != self._last_status:
            self._last_status = summary
            self.notifier.status(summary)
            self._write_status()
        elif self.state is not None and self.state.version != self._state_written:
            self._write_status()  # new allocations or attributions: keep status.json current
        elif self._health_dirty:
            self._write_status()  # a health transition or an isolation-file problem

    def _prepare_state_dir(self) -> None:
        try:
            os.makedirs(self.cfg.state_dir, mode=0o755, exist_ok=True)
        except OSError as exc:
            log.warning("cannot create the state directory %s: %s (status is not written)",
                        self.cfg.state_dir, exc)
            self._status_warned = True

    def _start_health(self) -> None:
        """(Re)start the health monitor on the current devices (agent.health); its faults
        persist in the state directory, so a reload keeps withdrawn GPUs withdrawn."""
        self._stop_health()
        devices = [d for m in self.managers.values() for d in m.devices]
        self.health = monitor_from_config(self.cfg, library_path=self.nvml_path, gpus=self.gpus,
                                          devices=devices, sink=self._apply_health,
                                          on_change=self._health_changed)
        self.health.start()

    def _stop_health(self) -> None:
        if self.health is not None:
            self.health.stop()
            self.health = None

    def _apply_health(self, changes) -> None:
        """From the health monitor's threads: one batch of device health to the managers."""
        for manager in list(self.managers.values()):
            mine = {i: state for i, state in changes.items() if i in manager.by_id}
            if mine:
                manager.set_health_many(mine)

    def _health_changed(self) -> None:
        """From the health monitor's threads: status.json needs rewriting; wake the loop."""
        self._health_dirty = True
        with self._wake_lock:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"h")
                except BlockingIOError:
                    pass  # the pipe is full: the loop is awake anyway

    def _start_state(self) -> None:
        """Load the allocation checkpoint (a bad one is set aside) and start reconciling."""
        cfg = self.cfg
        self.state = AllocationState(
            cfg.state_dir, keyed_by=cfg.checkpoint_device_id_strategy,
            socket_path=cfg.pod_resources_socket, period=cfg.reconcile_interval,
            devices=self._advertised, environ=self.environ)
        self.state.start()

    def _advertised(self) -> dict | None:
        """The devices advertised now by resource; None before the first discovery (from
        the reconcile thread: reads the managers dict the loop replaces as a whole)."""
        managers = self.managers
        if not self.nvml_up or not managers:
            return None
        return {name: m.devices for name, m in managers.items()}

    def _write_status(self) -> None:
        if self.cfg is None:
            return
        if self.state is not None:
            self._state_written = self.state.version
        self._health_dirty = False
        path = os.path.join(self.cfg.state_dir, STATUS_FILE)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.status(), f, indent=1)
                f.write("\n")
            os.replace(tmp, path)
        except OSError as exc:
            if not self._status_warned:
                log.warning("cannot write %s: %s", path, exc)
                self._status_warned = True


# ---------------------------------------------------------------------------------------------
# `gpu-agent status` on a running agent


def read_status(state_dir: str) -> dict | None:
    """The status a running (or the last) agent wrote under `state_dir`, or None."""
    try:
        with open(os.path.join(state_dir, STATUS_FILE)) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise AgentError(f"cannot read {os.path.join(state_dir, STATUS_FILE)}: {exc}") from exc
    doc["running"] = doc.get("phase") not in ("stopped",) and _alive(doc.get("pid"))
    return doc


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


def format_status(doc: dict) -> str:
    lines = [f"agent: {'running' if doc['running'] else 'not running'} "
             f"(pid {doc.get('pid')}, phase {doc.get('phase')}, version {doc.get('version')})",
             f"summary: {doc.get('summary')}",
             f"config file: {doc.get('configFile') or 'none'}; kubelet socket: "
             f"{doc.get('kubeletSocket') or 'none'}"]
    nvml = doc.get("nvml", {})
    lines.append(f"NVML: {'up' if nvml.get('up') else 'down'} ({nvml.get('library') or '-'})"
                 + (f": {nvml['error']}" if nvml.get("error") else ""))
    lines.append(f"restarts: {doc.get('restarts', 0)}; reloads: {doc.get('reloads', 0)}"
                 + (f"; last error: {doc['lastError']}" if doc.get("lastError") else ""))
    for r in doc.get("resources", []):
        lines.append(f"{r['name']}: {'registered' if r['registered'] else 'not registered'} "
                     f"({r['registrations']} registrations) on {r['socket'] or '-'}")
        for d in r["devices"]:
            numa = "-" if d["numaNode"] is None else d["numaNode"]
            lines.append(f"  GPU {d['index']} {d['uuid']} NUMA {numa}: "
                         f"{'healthy' if d['healthy'] else 'unhealthy'}"
                         + (f" ({d['reason']})" if d.get("reason") else ""))
    if doc.get("cdi"):
        c = doc["cdi"]
        lines.append(f"CDI ({', '.join(c['strategies'])}): "
                     + (f"all {c['wanted']} device names defined" if c["ok"] else
                        f"{len(c['missing'])} of {c['wanted']} device names missing from the "
                        f"specs in {', '.join(c['dirs'])}: {', '.join(c['missing'])}"))
    if doc.get("state"):
        lines += format_state(doc["state"])
    if doc.get("health"):
        lines += format_health(doc["health"])
    return "\n".join(lines)


def run(args: Any, environ: Mapping[str, str] | None = None) -> int:
    """`gpu-agent run`: serve until SIGTERM/SIGINT; the exit code."""
    return Daemon(args, environ).run()
