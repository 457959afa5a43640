"""A real Prometheus (Debian's `prometheus` package, installed by `make test` through the
Makefile's APT_TEST) scrapes `gpu-agent run` on the simulated node; the test asks Prometheus'
HTTP API, as an operator's dashboard would, for an allocated device's pod labels and for a
health change, and `promtool check metrics` lints the exposition.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from agent.sim import control
from tests.daemon_harness import GPU, WAIT, Node
from tests.test_metrics import metrics_port, scrape_text

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus/promtool not installed (make test installs Debian's prometheus as root)")

PROMETHEUS_WAIT = 60.0  # its start (TSDB, web) on a busy 2-core machine, then scrapes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """prometheus scraping 127.0.0.1:`target` every second, its data in `root`."""

    def __init__(self, root: str, target: int):
        self.port = free_port()
        config = f"{root}/prometheus.yml"
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                    "scrape_configs:\n  - job_name: gpu-agent\n    static_configs:\n"
                    f"      - targets: ['127.0.0.1:{target}']\n")
        self.log_path = f"{root}/prometheus.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={root}/tsdb",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT)

    def api(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=WAIT) as r:
            return json.load(r)["data"]

    def query_until(self, query: str, predicate, what: str) -> list[dict]:
        """The instant-query result once predicate(result) holds."""
        deadline = time.monotonic() + PROMETHEUS_WAIT
        result = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{open(self.log_path).read()}")
            try:
                result = self.api("query", query=query)["result"]
            except OSError:  # not listening yet
                result = None
            if result is not None and predicate(result):
                return result
            time.sleep(0.2)
        raise AssertionError(f"Prometheus never showed {what} ({query}): {result}\n"
                             f"targets: {self._targets()}")

    def _targets(self) -> object:
        try:
            return self.api("targets")
        except OSError as exc:
            return exc

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def scraped():
    with Node() as node:
        agent = node.agent()
        agent.wait_registered()
        prometheus = Prometheus(node.root, metrics_port(node))
        try:
            yield node, agent, prometheus
        finally:
            prometheus.stop()


def test_prometheus_sees_a_pods_devices_and_a_health_change(scraped):
    node, agent, prometheus = scraped
    prometheus.query_until("up{job='gpu-agent'} == 1", bool, "the agent's target up")
    pod = node.client.admit_pod("infer", {"server": {GPU: 1}}, namespace="serving")
    (device,) = pod.devices(GPU)
    got = prometheus.query_until(
        "gpu_agent_device_allocated{namespace='serving', pod='infer'} == 1", bool,
        "the pod's device")
    assert [(r["metric"]["device"], r["metric"]["container"]) for r in got] == \
        [(device, "server")]
    control.inject_xid(node.ctl, device, 48)  # double-bit ECC XID: withdrawn
    agent.wait_for(lambda s: not s.resource(GPU).device(device).healthy, "unhealthy")
    got = prometheus.query_until(f"gpu_agent_device_healthy{{device='{device}'}} == 0", bool,
                                 "the device withdrawn")
    assert got[0]["metric"]["reason"] == "xid"
    got = prometheus.query_until("sum(gpu_agent_device_healthy)", lambda r: r and
                                 r[0]["value"][1] == "7", "7 healthy devices")
    node.client.delete_pod("infer", namespace="serving")
    prometheus.query_until("count(gpu_agent_device_allocated{pod='infer'})", lambda r: not r,
                           "the pod's labels gone")


def test_promtool_finds_nothing_to_report_in_the_exposition():
    with Node() as node:
        agent = node.agent()
        agent.wait_registered()
        node.client.admit_pod("p", {"c": {GPU: 2}})
        uuid = node.client.state().resource(GPU).devices[0].id
        control.inject_xid(node.ctl, uuid, 79)
        agent.wait_for(lambda s: not s.resource(GPU).device(uuid).healthy, "unhealthy")
        text = scrape_text(metrics_port(node))
    assert 'pod="p"' in text and 'reason="xid"' in text  # the linted text has every kind
    proc = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=WAIT)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
