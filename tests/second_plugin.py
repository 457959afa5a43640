"""A second device plugin serving `nvidia.com/gpu`, for the fast tests of a switch from
NVIDIA's plugin (tests/test_daemon_lifecycle.py). NVIDIA's real plugin runs in tests/e2e
(tests/e2e/test_migration.py); it cannot run against the simulated kubelet, because it
puts its socket in kubelet's fixed directory (/var/lib/kubelet/device-plugins).

What it shares with NVIDIA's plugin, which is what kubelet sees of a plugin during a switch:
its socket name (`nvidia-gpu.sock` beside kubelet.sock), the resource, the device IDs (GPU
UUIDs, all Healthy), registration once at start, and an Allocate answer of
NVIDIA_VISIBLE_DEVICES=<UUIDs> with the device nodes (NVIDIA's envvar strategy with
passDeviceSpecs). It has no GetPreferredAllocation, health checks, MIG or sharing. It exits on SIGTERM, its socket
removed.

Run: `python -m tests.second_plugin --kubelet-socket PATH --profile PROFILE --dev-root DIR`.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from concurrent import futures

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc

SOCKET = "nvidia-gpu.sock"  # NVIDIA's: internal/plugin/server.go, "nvidia-" + resource suffix
RESOURCE = "nvidia.com/gpu"
CONTROL = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


class Plugin(dp_grpc.DevicePluginServicer):
    def __init__(self, gpus: dict[str, int], dev_root: str, stop: threading.Event):
        self.gpus = gpus  # UUID -> minor
        self.dev_root = dev_root
        self.stop = stop

    def GetDevicePluginOptions(self, request, context):
        return dp.DevicePluginOptions()

    def ListAndWatch(self, request, context):
        yield dp.ListAndWatchResponse(devices=[
            dp.Device(ID=uuid, health="Healthy") for uuid in sorted(self.gpus)])
        self.stop.wait()

    def Allocate(self, request, context):
        responses = []
        for req in request.container_requests:
            unknown = [i for i in req.devices_ids if i not in self.gpus]
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown devices {unknown}")
            paths = [*CONTROL, *(f"/dev/nvidia{self.gpus[i]}" for i in req.devices_ids)]
            responses.append(dp.ContainerAllocateResponse(
                envs={"NVIDIA_VISIBLE_DEVICES": ",".join(req.devices_ids)},
                devices=[dp.DeviceSpec(container_path=p, host_path=self.dev_root + p,
                                       permissions="rw") for p in paths]))
        return dp.AllocateResponse(container_responses=responses)

    def PreStartContainer(self, request, context):
        return dp.PreStartContainerResponse()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.second_plugin")
    parser.add_argument("--kubelet-socket", required=True)
    parser.add_argument("--profile", required=True, help="node profile (a .yaml path)")
    parser.add_argument("--dev-root", required=True)
    args = parser.parse_args()

    from agent.sim.profile import load_profile

    gpus = {g["uuid"]: int(g["minor"]) for g in load_profile(args.profile)["gpus"]}
    stop = threading.Event()
    # blocked here, before gRPC's threads start, so that only sigwait below takes them
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    path = os.path.join(os.path.dirname(args.kubelet_socket), SOCKET)
    if os.path.exists(path):
        os.unlink(path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    dp_grpc.add_DevicePluginServicer_to_server(Plugin(gpus, args.dev_root, stop), server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    channel = grpc.insecure_channel(f"unix:{args.kubelet_socket}")
    dp_grpc.RegistrationStub(channel).Register(dp.RegisterRequest(
        version="v1beta1", endpoint=SOCKET, resource_name=RESOURCE,
        options=dp.DevicePluginOptions()), timeout=10)
    channel.close()
    print(f"registered {RESOURCE} from {path}", flush=True)

    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    stop.set()
    server.stop(0.5).wait()
    if os.path.exists(path):
        os.unlink(path)
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
