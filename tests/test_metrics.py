"""The Prometheus endpoint of a real `gpu-agent run` on the simulated node, scraped over HTTP
as Prometheus would: device health and pod attribution, GPU telemetry read at scrape time
(values set through the simulator's control channel), a GPU whose NVML calls hang, the agent's
own counters, the listener's settings, and `gpu-agent status`. The real Prometheus server is
tests/test_metrics_prometheus.py.
"""

from __future__ import annotations

import signal
import socket
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent.sim import control
from agent.sim.profile import load_profile
from tests.conftest import run_gpu_agent
from tests.daemon_harness import GPU, WAIT, Node, clean_env


def metrics_port(node: Node) -> int:
    doc = node.status_when(lambda d: (d.get("metrics") or {}).get("listening"),
                           "the metrics endpoint listening")
    return doc["metrics"]["port"]


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT) as r:
        return r.read().decode()


def scrape(port: int) -> list[tuple[str, dict, float]]:
    """Every sample: (name, labels, value)."""
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(scrape_text(port))
            for s in f.samples]


def samples(port: int, name: str, **labels: str) -> list[tuple[dict, float]]:
    return [(lab, v) for n, lab, v in scrape(port)
            if n == name and all(lab.get(k) == val for k, val in labels.items())]


def scrape_until(port: int, predicate, what: str, timeout: float = WAIT):
    """Scrape until predicate(samples list) is true; returns that scrape."""
    deadline = time.monotonic() + timeout
    while True:
        got = scrape(port)
        if predicate(got):
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"no scrape showed {what} within {timeout:g} s")
        time.sleep(0.05)


@pytest.fixture
def node():
    with Node() as n:
        yield n


@pytest.fixture
def running(node):
    agent = node.agent()
    agent.wait_registered()
    return node, agent, metrics_port(node)


def test_every_advertised_device_has_its_health_and_allocation(running):
    node, _, port = running
    gpus = node.client.state().resource(GPU).devices
    health = samples(port, "gpu_agent_device_healthy", resource=GPU)
    assert sorted(lab["device"] for lab, _ in health) == sorted(d.id for d in gpus)
    assert all(v == 1.0 and lab["reason"] == "" for lab, v in health)
    free = samples(port, "gpu_agent_device_allocated", resource=GPU)
    assert len(free) == len(gpus) and all(v == 0.0 and lab["pod"] == "" for lab, v in free)
    assert {lab["gpu"] for lab, _ in health} == {str(i) for i in range(len(gpus))}


def test_a_pods_labels_are_on_its_devices_while_it_runs_and_gone_when_it_ends(running):
    node, _, port = running
    pod = node.client.admit_pod("trainer", {"main": {GPU: 2}}, namespace="ml")
    held = set(pod.devices(GPU))
    # podresources lists the pod once admit_pod returns: the very next scrape names it
    got = samples(port, "gpu_agent_device_allocated", namespace="ml", pod="trainer")
    assert {lab["device"] for lab, v in got if v == 1.0} == held
    assert all(lab["container"] == "main" for lab, _ in got)
    free = samples(port, "gpu_agent_device_allocated", pod="")
    assert len(free) == 8 - 2 and all(lab["device"] not in held for lab, _ in free)
    node.client.delete_pod("trainer", namespace="ml")
    assert samples(port, "gpu_agent_device_allocated", pod="trainer") == []
    assert len(samples(port, "gpu_agent_device_allocated", pod="")) == 8


def test_a_critical_xid_shows_as_withdrawn_with_its_class_and_counted(running):
    node, agent, port = running
    uuid = node.client.state().resource(GPU).devices[3].id
    control.inject_xid(node.ctl, uuid, 79)
    agent.wait_for(lambda s: not s.resource(GPU).device(uuid).healthy, "GPU 3 unhealthy")
    (lab, v), = samples(port, "gpu_agent_device_healthy", device=uuid)
    assert v == 0.0 and lab["reason"] == "xid"
    got = samples(port, "gpu_agent_gpu_xid_events_total", uuid=uuid, xid="79")
    assert [v for _, v in got] == [1.0]
    assert samples(port, "gpu_agent_nvml_events_total", outcome="delivered")[0][1] >= 1


def test_allocate_and_preferred_calls_are_in_the_latency_histograms(running):
    node, agent, port = running
    ids = [d.id for d in node.client.state().resource(GPU).devices]
    stub = agent.stub()
    for _ in range(3):
        stub.Allocate(dp.AllocateRequest(container_requests=[
            dp.ContainerAllocateRequest(devices_ids=ids[:1])]), timeout=WAIT)
    stub.GetPreferredAllocation(dp.PreferredAllocationRequest(container_requests=[
        dp.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=2)]),
        timeout=WAIT)
    with pytest.raises(grpc.RpcError):  # refused calls are timed too
        stub.Allocate(dp.AllocateRequest(container_requests=[
            dp.ContainerAllocateRequest(devices_ids=["no-such-gpu"])]), timeout=WAIT)
    count = dict((lab["method"], v) for lab, v in
                 samples(port, "gpu_agent_rpc_duration_seconds_count", resource=GPU))
    assert count == {"Allocate": 4.0, "GetPreferredAllocation": 1.0}
    inf = samples(port, "gpu_agent_rpc_duration_seconds_bucket", method="Allocate", le="+Inf")
    assert [v for _, v in inf] == [4.0]
    writes = samples(port, "gpu_agent_journal_writes_total")
    assert writes[0][1] >= 1  # the three answered Allocates were journaled first


@pytest.mark.parametrize("accept", [
    "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",  # Prometheus 2
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",  # Prometheus 3
    "text/plain;version=0.0.4", ""], ids=["openmetrics", "openmetrics-utf8", "text", "none"])
def test_the_exposition_is_what_prometheus_client_writes_for_the_same_samples(running, accept):
    """The endpoint writes its text itself (agent.metrics.render); read back with
    prometheus_client's parser and written again by prometheus_client, it must not change."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import choose_encoder
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as openmetrics_families,
    )

    node, agent, port = running
    node.client.admit_pod("trainer", {"main": {GPU: 2}}, namespace="ml")
    uuid = node.client.state().resource(GPU).devices[5].id
    control.inject_xid(node.ctl, uuid, 79)
    agent.wait_for(lambda s: not s.resource(GPU).device(uuid).healthy, "GPU 5 unhealthy")
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=WAIT) as r:
        body, content_type = r.read(), r.headers["Content-Type"]
    encoder, expected_type = choose_encoder(accept)
    assert content_type == expected_type
    parse = openmetrics_families if "openmetrics" in accept else text_string_to_metric_families
    families = list(parse(body.decode()))
    assert {"gpu_agent_device_allocated", "gpu_agent_gpu_xid_events",
            "gpu_agent_rpc_duration_seconds"} <= {f.name for f in families}

    class Parsed:
        def collect(self):
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Parsed())
    assert body.decode() == encoder(registry).decode()


def test_a_scraper_that_accepts_gzip_gets_the_same_exposition_compressed(running):
    import gzip

    node, agent, port = running
    node.client.admit_pod("trainer", {"main": {GPU: 1}}, namespace="ml")
    scrape_until(port, lambda got: any(lab.get("pod") == "trainer" for _, lab, _ in got),
                 "trainer's labels")
    url = f"http://127.0.0.1:{port}/metrics"
    accept = "application/openmetrics-text;version=1.0.0"
    with urllib.request.urlopen(urllib.request.Request(
            url, headers={"Accept": accept, "Accept-Encoding": "gzip"}), timeout=WAIT) as r:
        encoding, packed = r.headers["Content-Encoding"], r.read()
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}),
                                timeout=WAIT) as r:
        plain_encoding, plain = r.headers["Content-Encoding"], r.read()
    assert encoding == "gzip" and plain_encoding is None
    text, plain_text = gzip.decompress(packed).decode(), plain.decode()
    assert 'pod="trainer"' in text and text.endswith("# EOF\n")
    # the same families and samples; only the values read at each scrape may differ
    assert [line.rsplit(" ", 1)[0] for line in text.splitlines()] == \
        [line.rsplit(" ", 1)[0] for line in plain_text.splitlines()]


def test_build_info_names_the_live_implementation(node):
    node.pure_python = True
    node.agent().wait_registered()
    (lab, v), = samples(metrics_port(node), "gpu_agent_build_info")
    assert v == 1.0 and lab["implementation"] == "python" and lab["version"]
    assert lab["hostname"] == socket.gethostname()


def test_status_shows_the_endpoint_and_the_last_scrape(running):
    node, _, port = running
    node.status_when(lambda d: d["phase"] == "running" and d["state"]["podResources"]
                     ["reconciles"] >= 1, "the first reconcile")  # nothing else to publish
    for n in (1, 2, 3):  # each scrape reaches status.json on its own
        scrape(port)
        out = node.status_with(f"(port {port}), {n} scrapes")
        assert f"metrics: listening on 127.0.0.1:0 (port {port}), {n} scrapes, last" in out


def test_an_empty_address_turns_the_endpoint_off(node):
    node.agent("--metrics-address", "").wait_registered()
    doc = node.status_when(lambda d: d.get("phase") == "running", "running")
    assert doc["metrics"] is None
    assert "metrics: off" in node.status_with("metrics: off")


def test_a_port_in_use_is_reported_and_the_gpus_are_still_served(running):
    node, first, port = running
    other = Node(start_kubelet=True)
    try:
        agent = other.agent("--metrics-address", f"127.0.0.1:{port}")
        agent.wait_registered()  # served all the same
        doc = other.status_when(lambda d: d.get("metrics") and d["metrics"]["error"],
                                "the listen error")
        assert not doc["metrics"]["listening"]
        assert f"cannot listen on 127.0.0.1:{port}" in doc["metrics"]["error"]
        assert "metricsAddress" in agent.wait_log("metrics endpoint: cannot listen")
        assert agent.alive()
    finally:
        other.close()


@pytest.mark.parametrize("value", ["9445", "host:http", "127.0.0.1:70000", "a b:1", "::1:9445"])
def test_a_bad_address_exits_naming_the_key_and_the_file(node, value):
    path = node.write("config.yaml", f'version: v1\nagent:\n  metricsAddress: "{value}"\n')
    proc = run_gpu_agent("run", "--config-file", path, env=clean_env(), check=False)
    assert proc.returncode != 0
    assert "agent.metricsAddress" in proc.stderr and path in proc.stderr


def test_a_reload_turns_the_endpoint_off_and_on(node):
    path = node.write("config.yaml", 'version: v1\nagent:\n  metricsAddress: "127.0.0.1:0"\n')
    agent = node.agent("--config-file", path, "--nfd-features-file", node.features_file,
                       services=False)
    agent.wait_registered()
    first = metrics_port(node)
    node.write("config.yaml", 'version: v1\nagent:\n  metricsAddress: ""\n')
    agent.send(signal.SIGHUP)
    node.status_when(lambda d: d.get("metrics") is None, "the endpoint off after the reload")
    with pytest.raises(OSError):
        scrape_text(first)
    node.write("config.yaml", 'version: v1\nagent:\n  metricsAddress: "127.0.0.1:0"\n')
    agent.send(signal.SIGHUP)
    assert samples(metrics_port(node), "gpu_agent_reloads_total")[0][1] == 2.0
    assert agent.wait_registered().registrations == 1  # kubelet saw none of it


def test_mig_devices_carry_their_pod_and_their_parent_gpu():
    with Node("a100-mig") as node:
        agent = node.agent("--mig-strategy", "mixed")
        mig = "nvidia.com/mig-3g.40gb"
        agent.wait_registered(resource=mig)
        port = metrics_port(node)
        pod = node.client.admit_pod("sim", {"solver": {mig: 1}}, namespace="hpc")
        (device,) = pod.devices(mig)
        (lab, v), = samples(port, "gpu_agent_device_allocated", resource=mig, pod="sim")
        assert (v, lab["device"], lab["namespace"], lab["container"]) == \
            (1.0, device, "hpc", "solver")
        parent = next(g for g in load_profile("a100-mig")["gpus"]
                      if device in {i["uuid"] for i in g.get("mig", {}).get("instances", [])})
        assert (lab["uuid"], lab["gpu"]) == (parent["uuid"], str(parent["index"]))
        healthy = samples(port, "gpu_agent_device_healthy", device=device)
        assert [(h["uuid"], h["gpu"]) for h, _ in healthy] == [(lab["uuid"], lab["gpu"])]


def test_memory_used_is_what_nvidia_smi_shows_without_the_reserved_memory():
    # NVML's v2 memory call counts what the driver and firmware reserve apart (nvidia-smi's
    # "Memory-Usage"); the v1 struct counts it as used: 480 MiB on an idle H100 with driver
    # 580 (docs/hardware/h100-580.159.04/), 543 MiB on the dgx-h100 profile's GPUs
    gpu = load_profile("dgx-h100")["gpus"][3]
    assert gpu["memory"]["reserved"] > 0
    with Node("dgx-h100") as node:
        node.agent().wait_registered()
        port = metrics_port(node)
        control.set_telemetry(gpu["uuid"], node.ctl, memory_used_mib=10240)
        got = dict((n, v) for n, lab, v in scrape(port) if lab.get("uuid") == gpu["uuid"])
        assert got["gpu_agent_gpu_memory_used_bytes"] == 10240 * 2**20
        assert got["gpu_agent_gpu_memory_total_bytes"] == gpu["memory"]["total"]


def test_telemetry_is_read_when_scraped(running):
    node, _, port = running
    uuid = node.client.state().resource(GPU).devices[5].id
    (lab5, _), = samples(port, "gpu_agent_device_healthy", device=uuid)
    gpu5 = dict(gpu=lab5["gpu"], uuid=uuid)
    idle = {n: v for n, lab, v in scrape(port) if lab.get("uuid") == uuid
            and n.startswith("gpu_agent_gpu_") and "reason" not in lab and "type" not in lab}
    assert idle["gpu_agent_gpu_temperature_celsius"] > 0 and idle["gpu_agent_gpu_power_watts"] > 0
    assert idle["gpu_agent_gpu_power_limit_watts"] >= idle["gpu_agent_gpu_power_watts"]
    control.set_telemetry(uuid, node.ctl, temperature_c=87, gpu_util=93, power_mw=281500,
                          memory_used_mib=12288, sm_clock_mhz=1530, throttle_reasons=0x20)
    got = {n: v for n, lab, v in scrape(port) if lab.get("uuid") == uuid}
    assert got["gpu_agent_gpu_temperature_celsius"] == 87.0
    assert got["gpu_agent_gpu_utilization_ratio"] == 0.93
    assert got["gpu_agent_gpu_power_watts"] == 281.5
    assert got["gpu_agent_gpu_memory_used_bytes"] == 12288 * 2**20
    assert got["gpu_agent_gpu_sm_clock_hertz"] == 1530e6
    throttled = {lab["reason"]: v for lab, v in samples(port, "gpu_agent_gpu_throttle_reason",
                                                        **gpu5)}
    assert throttled["sw_thermal_slowdown"] == 1.0 and throttled["gpu_idle"] == 0.0
    # a V100 has retired pages and no row remapping: asked once, then left out
    assert samples(port, "gpu_agent_gpu_retired_pages_pending", **gpu5) == [(gpu5, 0.0)]
    assert samples(port, "gpu_agent_gpu_remapped_rows_pending", **gpu5) == []
    assert samples(port, "gpu_agent_gpu_telemetry_failures_total") == []


def test_a_gpu_whose_nvml_calls_hang_is_left_out_and_counted(running):
    node, agent, port = running
    uuid = node.client.state().resource(GPU).devices[2].id
    (lab, _), = samples(port, "gpu_agent_device_healthy", device=uuid)
    control.set_telemetry(uuid, node.ctl, delay_ms=600_000)  # hangs for the rest of the test
    got = scrape(port)  # answered: the scrape waits the budget (0.5 s), not the call
    temps = {lab["uuid"] for n, lab, _ in got if n == "gpu_agent_gpu_temperature_celsius"}
    assert len(temps) == 7 and uuid not in temps
    failures = samples(port, "gpu_agent_gpu_telemetry_failures_total", uuid=uuid)
    # the first scrape timed out; this one found the call still hanging and did not ask again
    assert sorted((lab["cause"], v) for lab, v in failures) == [("busy", 1.0), ("timeout", 1.0)]
    assert len([n for n, lab, _ in got if n == "gpu_agent_device_healthy"]) == 8
    agent.wait_log(f"GPU {lab['gpu']} {uuid}: NVML did not answer within 0.5 s; left out")
    assert node.client.state().resource(GPU).device(uuid).healthy  # health is not telemetry
    assert agent.stop() == 0  # the thread stuck in NVML does not hold up the stop
