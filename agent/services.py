"""The services beside the device plugin: /dev/char links, the Prometheus endpoint, and the
node-feature-discovery label file.

Owns: when each starts (after the first registration: none is on the start path), what a
reload does to it (restarted only when its own settings changed: `devchar.SETTINGS`,
agent.metricsAddress, agent.nfdFeaturesFile), rewriting the label file when the advertised
devices change, and stopping them (the links and the label file stay: a stopped agent's GPUs
are still there). Must not decide what a service does (agent.devchar, agent.metrics,
agent.rm.labels) nor let one failing service stop the others or the agent.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from agent.config import Config
from agent.errors import AgentError

log = logging.getLogger(__name__)


class Services:
    """The optional services of daemon `d` (agent.daemon.Daemon); `on_change` is the daemon's
    wake-up (something to publish)."""

    def __init__(self, d: Any, on_change: Callable[[], None]):
        self.d = d
        self.on_change = on_change
        self.dev_char: Any = None  # agent.devchar.DevCharLinks
        self.metrics: Any = None  # agent.metrics.Exporter
        self.labels: Any = None  # agent.rm.labels.FeatureFile
        self.labels_error = ""
        self.started = False

    def start(self, cfg: Config) -> None:
        self.started = True
        self._start_dev_char(cfg)
        self._start_metrics(cfg)
        self.devices_changed(cfg)

    def reconfigure(self, old: Config, new: Config) -> None:
        from agent import devchar  # imported by the start already

        if devchar.changed(old, new):
            self._start_dev_char(new)
        if old.metrics_address != new.metrics_address:
            self._start_metrics(new)
        # the label file follows in devices_changed(), which the reload's re-advertising calls
        # (a new path gets a new FeatureFile there; the old file stays, nobody updates it)

    def devices_changed(self, cfg: Config) -> None:
        """The GPUs, the MIG layout or the config changed: bring the label file up to date."""
        if not self.started or not cfg.nfd_features_file or not self.d.nvml.up:
            return
        try:
            from agent.rm import labels

            if self.labels is None or self.labels.path != cfg.nfd_features_file:
                self.labels = labels.FeatureFile(cfg.nfd_features_file)
            if self.labels.update(labels.node_labels(self.d.resources.gpus, cfg)):
                log.info("node feature labels written to %s", cfg.nfd_features_file)
            self.labels_error = ""
        except (AgentError, OSError) as exc:
            if str(exc) != self.labels_error:
                log.error("node feature labels not written: %s", exc)
            self.labels_error = str(exc)
        except Exception as exc:  # a bug: the labels are not worth the GPUs; show it once
            if repr(exc) != self.labels_error:
                log.exception("node feature labels not written (a bug)")
            self.labels_error = repr(exc)

    def stop(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()
        if self.dev_char is not None:
            self.dev_char.stop()  # the links stay

    def status(self) -> dict:
        return {
            "devChar": self.dev_char.status() if self.dev_char is not None else None,
            "metrics": self.metrics.status() if self.metrics is not None else None,
            "labels": {"file": self.labels.path if self.labels is not None else "",
                       "error": self.labels_error},
        }

    def _start_dev_char(self, cfg: Config) -> None:
        """Create the missing /dev/char links of the NVIDIA nodes, now and as nodes appear
        (agent.devchar): containers keep their GPUs across `systemctl daemon-reload`."""
        from agent import devchar

        if self.dev_char is not None:
            self.dev_char.stop()
        self.dev_char = devchar.from_config(cfg, on_change=self.on_change)
        if self.dev_char is not None:
            self.dev_char.start()
            self.on_change()

    def _scraped(self) -> None:
        # Later, not now: a write per scrape would run while the scrape's own work still runs,
        # and that CPU comes out of the Allocates answered at the same time.
        self.d.publish_later()

    def _start_metrics(self, cfg: Config) -> None:
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if cfg.metrics_address:
            from agent.metrics.exporter import Exporter  # after the registration

            self.metrics = Exporter(self.d, cfg.metrics_address, on_scrape=self._scraped)
            self.metrics.start()
            self.on_change()
