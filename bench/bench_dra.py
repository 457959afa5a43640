"""DRA mode as kubelet meets it: NodePrepareResources and NodeUnprepareResources of one claim,
beside Allocate of the device-plugin path, in the same run.

Owns: timing the calls kubelet makes when a pod with a claim starts and ends: `gpu-agent run
--mode dra` (a real subprocess, simulated NVML dgx1-v100) against the fast tests' API server
(tests/kube_api.py, in the bench process: the claim read by the agent over real HTTP), called
over its real DRA socket; and `gpu-agent run` in device-plugin mode against the simulated
kubelet, Allocate of one GPU straight to its plugin socket. Figures only; tests/test_dra_*.py
assert behaviour.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent._proto.dra.v1 import api_pb2 as v1
from agent._proto.dra.v1 import api_pb2_grpc as v1_grpc
from agent._proto.pluginregistration.v1 import api_pb2 as reg
from agent._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from agent.dra.plugin import socket_paths
from agent.sim import lib_path
from agent.sim.kubelet import SimKubelet, SimKubeletClient
from bench import (
    AGENT_COMMAND,
    Section,
    allocate_timed,
    ratio_row,
    sim_node_env,
    stop_agent,
    wait_until,
)
from tests.kube_api import KubeApi

CLAIMS = 300  # each prepared, then unprepared
WARMUP = 20
NODE = "bench-node"
DRIVER = "gpu.nvidia.com"


def _channel(path: str) -> grpc.Channel:
    return grpc.insecure_channel(f"unix:{path}", options=[("grpc.enable_http_proxy", 0)])


def _agent(work: str, env: dict, *args: str) -> subprocess.Popen:
    log = open(os.path.join(work, "agent.log"), "ab")  # noqa: SIM115 - the process's own
    return subprocess.Popen([*AGENT_COMMAND, "run", "--state-dir", os.path.join(work, "state"),
                             "--nvml-library", str(lib_path()), *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def _claims(work: str, env: dict) -> tuple[list[float], list[float]]:
    """(prepare seconds, unprepare seconds) of CLAIMS claims of one GPU each, in turn."""
    api = KubeApi(NODE)
    agent = _agent(work, env, "--mode", "dra", "--node-name", NODE,
                   "--kubeconfig", api.kubeconfig(os.path.join(work, "kubeconfig")),
                   "--kubelet-dir", work, "--cdi-spec-dirs", os.path.join(work, "cdi"),
                   "--kubelet-socket", "", "--metrics-address", "")
    socket, registration = socket_paths(work, DRIVER)
    prepare, unprepare = [], []
    try:
        wait_until(lambda: os.path.exists(registration), "the registration socket")
        with _channel(registration) as ch:  # as kubelet's plugin watcher: the slice waits for it
            reg_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=True), timeout=10)
        wait_until(lambda: os.path.exists(socket) and f"{NODE}-{DRIVER}" in api.slices,
                   "DRA socket and slice")
        with _channel(socket) as ch:
            stub = v1_grpc.DRAPluginStub(ch)
            for i in range(WARMUP + CLAIMS):
                uid, name = f"uid-{i}", f"claim-{i}"
                api.claims[("bench", name)] = {
                    "metadata": {"namespace": "bench", "name": name, "uid": uid},
                    "status": {"allocation": {"devices": {"results": [{
                        "request": "gpu", "driver": DRIVER, "pool": NODE,
                        "device": f"gpu-{i % 8}"}]}},
                        "reservedFor": [{"resource": "pods", "name": f"pod-{i}"}]}}
                claim = v1.Claim(namespace="bench", uid=uid, name=name)
                start = time.perf_counter()
                out = stub.NodePrepareResources(
                    v1.NodePrepareResourcesRequest(claims=[claim]), timeout=10)
                prepared = time.perf_counter()
                done = stub.NodeUnprepareResources(
                    v1.NodeUnprepareResourcesRequest(claims=[claim]), timeout=10)
                end = time.perf_counter()
                if out.claims[uid].error or done.claims[uid].error:
                    raise RuntimeError(f"bench_dra: claim {name}: "
                                       f"{out.claims[uid].error or done.claims[uid].error}")
                if i >= WARMUP:
                    prepare.append(prepared - start)
                    unprepare.append(end - prepared)
    finally:
        stop_agent(agent)
        api.stop()
    return prepare, unprepare


def _allocate(work: str, env: dict, kdir: str) -> list[float]:
    """Seconds of CLAIMS Allocate calls of one GPU (a different one each time, in turn)."""
    kubelet = SimKubelet(kdir)
    kubelet.start()
    client = SimKubeletClient(kdir)
    agent = _agent(work, env, "--kubelet-socket", os.path.join(kdir, "kubelet.sock"),
                   "--metrics-address", "")
    try:
        client.wait_for(lambda s: (r := s.resource("nvidia.com/gpu")) is not None
                        and r.allocatable == 8, 30, what="the agent registered")
        ids = sorted(client.state().resource("nvidia.com/gpu").healthy_ids)
        out = []
        with _channel(os.path.join(kdir, "gpu-agent-gpu.sock")) as ch:
            stub = dp_grpc.DevicePluginStub(ch)
            for i in range(WARMUP + CLAIMS):
                request = dp.AllocateRequest(container_requests=[
                    dp.ContainerAllocateRequest(devices_ids=[ids[i % 8]])])
                [seconds] = allocate_timed(stub, request, 1)
                if i >= WARMUP:
                    out.append(seconds)
    finally:
        stop_agent(agent)
        client.close()
        kubelet.stop()
    return out


def run() -> Section:
    section = Section(
        title="DRA mode: preparing a claim, beside Allocate",
        method=("`gpu-agent run --mode dra` as a subprocess on the simulated NVML (dgx1-v100), "
                "its API server the fast tests' (tests/kube_api.py) in the bench process; "
                f"{CLAIMS} claims of one GPU each (after {WARMUP} untimed), each prepared with "
                "NodePrepareResources (v1) over the agent's DRA socket, then unprepared: "
                "prepare reads the claim from the API server, writes its CDI spec and records "
                "it (both fsynced) before it answers; unprepare removes both. Beside it, in "
                "the same run, `gpu-agent run` in device-plugin mode against the simulated "
                f"kubelet: {CLAIMS} Allocate calls of one GPU (after {WARMUP} untimed), the "
                "journal record written before each answer. Ratios against Allocate's median."),
        header=["call", "calls", "median", "p99", "vs Allocate"],
    )
    work = tempfile.mkdtemp(prefix="gabd", dir="/tmp")
    try:
        kdir, _, env = sim_node_env(os.path.join(work, "dp"))
        allocate = _allocate(os.path.join(work, "dp"), env, kdir)
        os.makedirs(os.path.join(work, "dra"))
        _, _, env = sim_node_env(os.path.join(work, "dra", "node"))
        prepare, unprepare = _claims(os.path.join(work, "dra"), env)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = sorted(allocate)[len(allocate) // 2]
    section.rows.append(ratio_row("Allocate, 1 GPU (device-plugin mode)", allocate, base, 2))
    section.rows.append(ratio_row("NodePrepareResources, 1 claim of 1 GPU", prepare, base, 2))
    section.rows.append(ratio_row("NodeUnprepareResources, the same claim", unprepare, base, 2))
    section.notes.append(
        "A pod with a claim pays prepare once per claim (all its containers share it) and "
        "unprepare when it ends; a device-plugin pod pays Allocate once per container. Both are "
        "small beside the pod's start on the real kubelet (the section \"Real kubelet: pod "
        "created → container running\").")
    return section
