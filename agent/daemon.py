"""`gpu-agent run`: the composition root. Builds the parts, wires them, runs the main loop.

Owns: the order of start (config → NVML → resources → health → registrar, which registers
first; then the CDI check and the allocation journal, which Allocate waits for), what a SIGHUP
changes (applied behind the running servers: agent.rm.resources keeps each resource's manager,
the registrar adds and removes only the servers of resources that come or go), the clean stop,
and the systemd conversation (READY once every resource registered, STATUS, WATCHDOG, ...).
Threads: the main thread runs the loop (signals, the watchdog, NVML retries, the status); the
registrar, gRPC, health and state run their own and call back through `_wake`. Must not talk
gRPC, build devices or responses, format the status, or call NVML but through agent.nvml.session.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

from agent import __version__, gcpause, status, threadnames
from agent.config import Config, check_supported, has_named_configs, load_config
from agent.errors import AgentError, ConfigError, InitError, MigLayoutError
from agent.health.monitor import HealthMonitor, monitor_from_config
from agent.kubelet.registrar import Registrar
from agent.mps.daemons import MpsDaemons
from agent.nvml.guard import GUARD
from agent.nvml.session import NvmlSession
from agent.rm.resources import Resources
from agent.services import Services
from agent.signals import Waiter
from agent.systemd import Notifier

log = logging.getLogger(__name__)

# The loop sleeps until a signal, another thread's wake or what is due (the watchdog, an NVML
# retry, the MIG check, a status write asked for "later"). A status that may wait (a scrape
# still answering, a reconciliation pass) is written at most this long after it was asked for.
LOOP_TICK_S = 1.0
FIRST_REGISTRATION_WAIT_S = 2.0  # then the rest of the start goes on while it retries
# The settings of the Kubernetes events and condition: a reload that changes one restarts them.
FAULT_SETTINGS = ("kubeconfig", "node_name", "fault_events", "node_condition")
# The settings the health monitor is built from: a reload that changes none of them (and not
# the devices) keeps the running monitor.
HEALTH_SETTINGS = ("disable_healthchecks", "enable_healthchecks", "xid_policy", "xid_actions",
                   "recovery_quiet_period", "unhealthy_devices_file", "state_dir")


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
        self.died = False  # a thread ended by an exception (_thread_died)
        self.nvml = NvmlSession(on_change=self._wake)
        self.state: Any = None  # the allocation journal and its reconciler (AllocationState)
        self.resources = Resources()
        self.health: HealthMonitor | None = None
        self.mps = MpsDaemons(on_change=lambda: self.health and self.health.outages_changed())
        self._dra_plan: dict = {}  # the MPS daemons DRA mode's claims need (_dra_mps)
        self._mps_lock = threading.Lock()  # one plan built and applied at a time
        self.registrar: Registrar | None = None
        self.dra: Any = None  # agent.mode dra: the DRA driver (agent.dramode.DraMode)
        self.cdi: Any = None  # the last CDI spec check, agent.rm.cdi.CdiCheck (cdi-* only)
        self.services = Services(self, on_change=self._wake)  # /dev/char, metrics, labels
        self.faults: Any = None  # events and the node condition, agent.kubeapi.faults
        self.label_watch: Any = None  # the label choosing a named config, agent.kubeapi.nodelabel
        self._label_changed = False
        self.reloads = 0
        self.last_error = ""
        self.ready_sent = False
        self.publisher = status.Publisher(self.notifier)
        self._registrations = 0  # seen in the registrar's status
        self._watchdog_at: float | None = None
        self._later_at: float | None = None  # a status asked for later is written then
        self._waiter: Waiter | None = None

    # -- start ---------------------------------------------------------------------------------

    def run(self) -> int:
        threadnames.install()  # top -H and /proc/PID/task/*/comm name each thread
        self._waiter = Waiter()
        default_hook, threading.excepthook = threading.excepthook, self._thread_died
        try:
            self.cfg = self._load_config()
            check_supported(self.cfg)
            log.info("gpu-agent %s starting (pid %d); config file: %s", __version__,
                     os.getpid(), self.cfg.config_file or "none")
            self._warn_ignored(self.cfg)
            self.last_error = self.cfg.choice.problem
            if self.label_watch is not None:
                self.label_watch.start()
            GUARD.while_waiting = (threading.get_ident(), self._watchdog)  # this thread's
            try:  # health.json and the journal live there
                os.makedirs(self.cfg.state_dir, mode=0o755, exist_ok=True)
            except OSError as exc:
                log.warning("cannot create the state directory %s: %s", self.cfg.state_dir, exc)
            self._bring_up(first=True)  # registered as early as can be ...
            self._start_state()  # ... the journal loads meanwhile (Allocate waits for it)
            self.services.start(self.cfg)
            self._start_faults()
            self._watchdog_at = time.monotonic() if self.notifier.watchdog_interval else None
            gcpause.resume()  # off since agent.__main__: the start keeps nearly all it makes
            self._loop()
        finally:
            try:
                self._shutdown()
            finally:
                threading.excepthook = default_hook
        return 1 if self.died else 0

    def _thread_died(self, args: threading.ExceptHookArgs) -> None:
        """threading.excepthook while the agent runs. A thread that ends by an exception leaves
        the agent running without what it did (the registrar's death: no registration after
        kubelet's next restart, so kubelet loses the resource), so the agent stops, cleanly,
        with exit code 1, and systemd (Restart=always) starts a whole one."""
        if args.exc_type is SystemExit:
            return  # a thread's way to end, as Python's own hook takes it
        name = args.thread.name if args.thread is not None else "?"
        log.critical("thread %s died: %s: %s; the agent stops (exit code 1) to be started "
                     "again whole", name, args.exc_type.__name__, args.exc_value,
                     exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
        self.died = True
        self.last_error = f"thread {name} died: {args.exc_type.__name__}: {args.exc_value}"
        self.stop_requested = True
        self._waiter.wake()

    def _start_state(self) -> None:
        """Load the allocation journal (a bad one is set aside) and start reconciling."""
        from agent.kubelet.podresources import PodResourcesClient  # not on the start path
        from agent.state.allocations import AllocationState

        cfg = self.cfg
        self.state = AllocationState(
            cfg.state_dir, keyed_by=cfg.checkpoint_device_id_strategy,
            socket_path=cfg.pod_resources_socket, period=cfg.reconcile_interval,
            ended_grace=cfg.ended_pod_grace,
            sync_interval=cfg.journal_sync_interval, connect=PodResourcesClient,
            devices=self.resources.advertised, environ=self.environ,
            on_change=self.publish_later)
        self.state.start()
        self.resources.set_journal(self.state.journal)

    def _bring_up(self, first: bool = False) -> None:
        """NVML and discovery, then advertise; on failure exit (failOnInitError true, at
        start) or retry later with backoff, advertising nothing meanwhile."""
        try:
            gpus = self.nvml.open(self.cfg)
        except InitError as exc:
            if self.cfg.fail_on_init_error and first:
                raise InitError(f"{exc}; or set failOnInitError: false "
                                f"(--fail-on-init-error=false) to keep running and retry") from None
            self.nvml.failed(str(exc))
            if not self.ready_sent:  # the degraded steady state: up, waiting for the driver
                self._send_ready()
            return
        self._advertise(gpus, restart_health=True)

    def _apply_mps(self, dra_plan: dict | None = None) -> None:
        """The MPS daemons: sharing.mps's and (dra mode) those the prepared claims need (from
        the main loop and kubelet's calls alike: one at a time, so that a plan built earlier
        is never applied after a later one)."""
        with self._mps_lock:
            if dra_plan is not None:
                self._dra_plan = dict(dra_plan)
            self.mps.apply({**self.resources.mps, **self._dra_plan},
                           self.cfg.mps_control_program, self.cfg.mps_root_dir, self.environ)

    def _dra_mps(self, plan: dict) -> dict[str, str]:
        """From DRA mode's claims (a prepare, an unprepare, the start): the daemons they need
        now (UUID -> agent.rm.sharing.MpsGpu) run; returns those down, UUID -> why."""
        self._apply_mps(plan)
        return {d["gpuUuid"]: d["reason"] or "not running" for d in self.mps.status()["daemons"]
                if d["gpuUuid"] in plan and not d["running"]}

    def _advertise(self, gpus: list, restart_health: bool) -> None:
        """Build (or update) the resources from `gpus` and the config, then serve them."""
        before = [d.id for d in self.resources.devices]
        self.resources.apply(gpus, self.cfg)  # then sharing.mps's daemons, before serving
        self._apply_mps()
        if self.state is not None:
            self.state.poke()  # the GPUs are known now: match records to them
        if restart_health or [d.id for d in self.resources.devices] != before:
            self._start_health()  # before serving: the first snapshot has the recorded faults
        if self.cfg.mode == "dra":
            if self.dra is None:
                from agent.dramode import DraMode  # the DRA driver's parts load in this mode

                self.dra = DraMode(self.cfg, on_change=self._wake, mps=self._dra_mps)
            self.dra.apply(self.resources.gpus, self.cfg)
            if not self.ready_sent:
                self._send_ready()
        elif not self.cfg.plugin_socket_dir:
            log.info("kubelet socket is empty (do not connect to kubelet): not serving")
        else:
            first = self.registrar is None
            if first:
                self.registrar = Registrar(self.cfg.kubelet_socket, on_change=self._wake)
            generation = self.registrar.serve(self.resources.managers)
            self.registrar.start()  # once: a running registrar ignores it
            if first:  # at start, the registration goes first: nothing else holds the GIL
                self.registrar.wait_synced(generation, FIRST_REGISTRATION_WAIT_S)
        if self.health is not None:
            self.health.watch_isolation()  # (at start, after the first registration)
        self.cdi = self.resources.check_cdi(self.cfg)
        self.services.devices_changed(self.cfg)
        if not self.cfg.plugin_socket_dir and self.cfg.mode != "dra":
            self._send_ready()

    # -- health ------------------------------------------------------------------------------

    def _start_health(self) -> None:
        """(Re)start the health monitor on the current devices, handing over from the running
        one; faults persist in the state directory, so a reload keeps withdrawn GPUs out."""
        old, self.health = self.health, monitor_from_config(
            self.cfg, library_path=self.nvml.path, gpus=self.resources.gpus,
            devices=self.resources.devices, sink=self.resources.set_health,
            on_change=self._wake, current=self.resources.health(), outages=self.mps.outages,
            on_transition=self._on_transition, holders=self.held_by)
        # its event set is registered before the old one stops; at start the isolation file
        # is read now and watched once registered (_advertise)
        self.health.start(watch_isolation=self.registrar is not None)
        if old is not None:
            old.stop(wait=False)
        if self.faults is not None:
            self.faults.refresh()

    def _on_transition(self, record: dict) -> None:
        """From the health thread: a GPU withdrawn or back; queued for the events, and in
        DRA mode for the slice's taints (published by DraMode's own thread)."""
        if self.dra is not None:
            self.dra.set_health(self.resources.health(), self._reboot_needed())
        faults = self.faults
        if faults is not None:
            faults.notify(record)

    def _reboot_needed(self) -> set[str]:
        return self.health.reboot_needed() if self.health is not None else set()

    def held_by(self, ids: list[str]) -> list[str]:
        """namespace/pod/container of the containers holding any of device `ids`, as the
        allocation journal has them attributed (memory only: no call to kubelet)."""
        if self.state is None:
            return []
        return sorted({"/".join(pod) for pod in _held(self.state.holders(), ids)})

    # -- the Kubernetes API: fault events and the node condition ------------------------------

    def _start_faults(self, replay: bool = True) -> None:
        """Start reporting faults to the API server when a kubeconfig is set and events or
        the condition are on (its thread loads the client: nothing here waits on the API).
        `replay`: at start, what the health monitor saw before (faults cleared by a reboot,
        an XID during the start) is reported too."""
        cfg = self.cfg
        if not cfg.kubeconfig or not (cfg.fault_events or cfg.node_condition):
            log.info("Kubernetes events and the node condition are off (%s)",
                     "no kubeconfig" if not cfg.kubeconfig else "both turned off")
            return
        from agent.kubeapi.faults import FaultReporter, node_name

        self.faults = FaultReporter(
            kubeconfig=cfg.kubeconfig, node=node_name(cfg.node_name), events=cfg.fault_events,
            condition=cfg.node_condition, on_change=self._wake,
            gpus_out=lambda: self.health.gpus_out() if self.health is not None else {},
            holders=self._pod_holders)
        if replay and self.health is not None:
            for record in self.health.transitions():
                self.faults.notify(record)
        self.faults.start()

    def _pod_holders(self, ids: list[str]) -> list[tuple[str, str, str]]:
        """From the events' thread: (namespace, pod, container) holding any of device `ids`
        now, asked of kubelet's podresources (PodResourcesError when it cannot say)."""
        from agent.kubelet.podresources import PodResourcesClient

        if not self.cfg.pod_resources_socket:
            return []
        from agent.state.reconcile import holders_listed  # loaded with the journal by then

        client = PodResourcesClient(self.cfg.pod_resources_socket)
        try:
            return sorted(_held(holders_listed(client.list()), ids))
        finally:
            client.close()

    # -- the config: files, and the node label that chooses a named one ----------------------

    def _load_config(self) -> Config:
        """The config from the flags, the environment and the config file, or the named config
        the node's label chooses (agent.config.named) when there are named configs; the label
        is read (and watched) only then."""
        base = load_config(self.args, self.environ)
        self._watch_label(base)
        cfg = base
        if self.label_watch is not None:
            cfg = load_config(self.args, self.environ, label=self.label_watch.value)
        choice = cfg.choice
        if choice.name or choice.problem:
            log.info("named config: %s (%s)", choice.name or "none, the --config file",
                     choice.why)
        if choice.problem:
            log.error("%s", choice.problem)
        return cfg

    def _watch_label(self, cfg: Config) -> None:
        """Watch the node label when named configs and a kubeconfig are there; the label is
        read now (the start waits for it briefly: at most nodelabel.READ_TIMEOUT_S). The
        API client loads only then: most nodes have no named configs."""
        wanted = None
        if cfg.kubeconfig and has_named_configs(cfg):
            from agent.kubeapi.faults import node_name

            wanted = (cfg.kubeconfig, node_name(cfg.node_name), cfg.node_label)
        watch = self.label_watch
        if watch is not None and (watch.kubeconfig, watch.node, watch.label) == wanted:
            return
        if watch is not None:
            watch.stop()
            self.label_watch = None
        if wanted is None:
            return
        from agent.kubeapi.nodelabel import NodeLabelWatch

        watch = NodeLabelWatch(kubeconfig=wanted[0], node=wanted[1], label=wanted[2],
                               on_change=self._on_label)
        try:
            watch.prime()
        except AgentError as exc:
            log.warning("node label %s not read (%s): the config of a node without it until "
                        "it is", wanted[2], exc)
        self.label_watch = watch
        if self.phase != "starting":
            watch.start()  # (at start, once the config is known good)

    def _on_label(self, value: str) -> None:
        """From the label's thread: the value changed; the loop reloads."""
        self._label_changed = True
        self._wake()

    # -- the loop ----------------------------------------------------------------------------

    def _wake(self) -> None:
        """From any thread: something to publish; wake the loop."""
        self.publisher.dirty = True
        self._waiter.wake()

    def publish_later(self) -> None:
        """From any thread: status.json has something new to say, which may wait LOOP_TICK_S
        (written with what comes meanwhile, never while a scrape's own work still runs)."""
        self.publisher.dirty = True
        if self._later_at is None:
            self._later_at = time.monotonic() + LOOP_TICK_S
            self._waiter.wake()  # (the loop takes up the new due time)

    def _loop(self) -> None:
        self.phase = "running"
        self._publish()
        while not self.stop_requested:
            now = time.monotonic()
            due = [t for t in (self.nvml.retry_at, self._watchdog_at,
                               self.resources.mig_watch.due, self._later_at) if t is not None]
            signals = self._waiter.wait(min(max(0.0, t - now) for t in due) if due else None)
            self._on_signals(signals)
            if self.stop_requested:
                return
            acted = bool(signals)
            if self._label_changed:
                self._label_changed = False
                self._reload(f"node label {self.label_watch.label}={self.label_watch.value!r}")
                acted = True
            self._watchdog()
            now = time.monotonic()
            if self.nvml.retry_at is not None and now >= self.nvml.retry_at:
                self.nvml.retry_at = None
                self._bring_up()
                acted = True
            elif self.nvml.up and (self.nvml.rediscover_due or
                                   self.resources.mig_watch.changed(self.resources.gpus, now)):
                self._remig()
                acted = True
            later = self._later_at  # a wake asks for the status now, publish_later() by then
            if later is not None and now >= later:
                self._later_at = later = None
            if acted or (self.publisher.dirty and later is None):
                self._later_at = None
                self._publish()

    def _watchdog(self) -> None:
        """Ping systemd's watchdog when due (from the loop, and while it waits for NVML)."""
        now = time.monotonic()
        if self._watchdog_at is not None and now >= self._watchdog_at:
            self.notifier.watchdog()
            self._watchdog_at = now + self.notifier.watchdog_interval

    def _remig(self) -> None:
        """The MIG layout changed, or a GPU discovery left out answers: advertise it."""
        try:
            self._advertise(self.nvml.rediscover(self.resources.gpus), restart_health=False)
        except MigLayoutError as exc:
            self.last_error = f"MIG layout refused: {exc}"
            log.error("the new MIG layout is refused, keeping the advertised one: %s", exc)

    def _on_signals(self, signals: list[int]) -> None:
        for signum in signals:
            if signum in (signal.SIGTERM, signal.SIGINT):
                log.info("%s: stopping", signal.Signals(signum).name)
                self.stop_requested = True
                return
            if signum == signal.SIGHUP:
                self._reload("SIGHUP")

    def _reload(self, cause: str) -> None:
        """SIGHUP, or the node label changed: re-read the config and apply it while every
        server keeps serving."""
        self.notifier.reloading()
        self.phase = "reloading"
        log.info("%s: reloading the configuration (config file: %s)", cause,
                 self.cfg.config_file or "none")
        try:
            new = self._load_config()
            check_supported(new)
            if new.mode != self.cfg.mode:
                raise ConfigError("agent.mode", f"{new.mode!r} differs from the running "
                                  f"{self.cfg.mode!r}; a change of mode takes a restart "
                                  f"(docs/dra.md)", str(new.sources["mode"]))
            if self.nvml.up:  # a MIG layout the new strategy refuses keeps the old one
                self.resources.device_map(self.resources.gpus, new)
        except (ConfigError, MigLayoutError) as exc:
            self.last_error = f"reload refused: {exc}"
            log.error("reload refused, keeping the running configuration: %s", exc)
            new = None
        else:
            self._apply_config(new)
        self.phase = "running"
        self._send_ready()  # status.json is current before the log line says so
        if new is not None:
            log.info("configuration reloaded (reload %d)", self.reloads)

    @staticmethod
    def _warn_ignored(cfg: Config) -> None:
        """NVIDIA's keys the file sets that gpu-agent accepts (so the file loads) but does
        not act on: said once per start or reload, not silently dropped."""
        if cfg.compat:
            log.warning("config file %s: gpu-agent accepts and ignores NVIDIA's %s (see "
                        "docs/configuration.md)", cfg.config_file, ", ".join(sorted(cfg.compat)))

    def _apply_config(self, new: Config) -> None:
        self._warn_ignored(new)
        old, self.cfg = self.cfg, new
        self.reloads += 1
        self.last_error = new.choice.problem
        self.state.reconfigure(keyed_by=new.checkpoint_device_id_strategy,
                               socket_path=new.pod_resources_socket,
                               period=new.reconcile_interval,
                               sync_interval=new.journal_sync_interval,
                               ended_grace=new.ended_pod_grace)
        self.nvml.reconfigured(old, new)
        if self.nvml.up:
            if new.kubelet_socket != old.kubelet_socket and self.registrar is not None:
                self.registrar.stop()  # another kubelet: serve beside its socket instead
                self.registrar = None
            health = any(getattr(old, k) != getattr(new, k) for k in HEALTH_SETTINGS)
            self._advertise(self.nvml.rediscover(self.resources.gpus), restart_health=health)
        elif self.nvml.retry_at is not None:
            self.nvml.retry_at = time.monotonic()  # try the new settings now
        self.services.reconfigure(old, new)
        if any(getattr(old, k) != getattr(new, k) for k in FAULT_SETTINGS):
            if self.faults is not None:
                self.faults.stop()
                self.faults = None
            self._start_faults(replay=False)

    # -- stop ----------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        self.phase = "stopping"
        self.notifier.stopping(status.summary(self))
        if self.health is not None:
            self.health.stop()
        if self.faults is not None:
            self.faults.stop()  # what is still queued is dropped: the agent is going away
        if self.label_watch is not None:
            self.label_watch.stop()
        self.mps.stop()  # the daemons go on serving their clients
        if self.dra is not None:
            self.dra.stop()  # the kubelet plugin's sockets; the ResourceSlice stays
        if self.registrar is not None:
            self.registrar.stop()  # the servers and their sockets
        self.resources.close()
        if self.state is not None:
            self.state.close()
        self.nvml.close()
        self.services.stop()
        self.phase = "stopped"
        self.publisher.write(self)
        self.notifier.close()
        self._waiter.close()
        log.info("gpu-agent stopped")

    # -- status and notifications ------------------------------------------------------------

    def _send_ready(self) -> None:
        self.ready_sent = True
        self.publisher.ready(self)

    def _publish(self) -> None:
        """Tell systemd and status.json what changed; READY once every resource registered;
        in DRA mode, the devices' health to the slice's taints."""
        if self.dra is not None:
            self.dra.set_health(self.resources.health(), self._reboot_needed())
        registered = self.registrar.status() if self.registrar is not None else {}
        count = sum(r.registrations for r in registered.values())
        if count != self._registrations and self.state is not None:
            self._registrations = count
            self.state.poke()  # kubelet is (back) up: ask podresources now
        if not self.ready_sent and registered and all(
                n in registered and registered[n].registered for n in self.resources.managers):
            self._send_ready()
        self.publisher.publish(self)


def _held(holders: Mapping[tuple[str, str], list], ids: list[str]) -> set[tuple[str, str, str]]:
    """The containers in `holders` (agent.state.reconcile.Holders) that hold any of device
    `ids` (of whichever resource)."""
    wanted = set(ids)
    return {pod for (_, device_id), pods in holders.items() if device_id in wanted
            for pod in pods}


def run(args: Any, environ: Mapping[str, str] | None = None) -> int:
    """`gpu-agent run`: serve until SIGTERM/SIGINT; the exit code."""
    return Daemon(args, environ).run()
