"""What the daemon tests share: a simulated node and `gpu-agent run` as a real subprocess.

`Node` is a short temp directory (unix socket paths are limited to 107 bytes) holding the
simulated kubelet's device-plugin directory, the simulated NVML's control directory and the
agent's state directory; it runs a SimKubelet in this process over real unix sockets (start it
later with `start_kubelet=False`). `Agent` is `gpu-agent run` against them, its output in a log
file, killed by PID if a test leaves it running. `NotifySocket` stands in for systemd's
NOTIFY_SOCKET; `ReadOnlyMount` makes a directory read-only for a while (root only;
bench/bench_faults.py uses it and NotifySocket too). Every wait is bounded and shows the
agent's log when it runs out; nothing here asserts on timing.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from agent.config.options import OPTIONS
from agent.sim import PROFILES_DIR, lib_path
from agent.sim.kubelet import SimKubelet, SimKubeletClient
from agent.status import read_status
from tests.conftest import ROOT, gpu_agent_cmd, run_gpu_agent

WAIT = 20.0  # upper bound of every wait; a healthy run needs far less
GPU = "nvidia.com/gpu"
SOCKET = "gpu-agent-gpu.sock"
LIB = str(lib_path())
_OPTION_ENV = {opt.env for opt in OPTIONS}
# INVOCATION_ID: a test run from a systemd service must not make the agent start MPS daemons
# with systemd-run (agent.mps.control.launcher)
_SYSTEMD_ENV = {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "INVOCATION_ID"}


# `gpu-agent run`'s lines off the journal: "2026-11-28 16:40:01.123 LEVEL logger: message"
LOG_LINE = re.compile(r"(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) (?P<level>[A-Z]+) "
                      r"(?P<logger>[\w.]+): (?P<message>.*)")


def log_level(line: str) -> str:
    """The level of one of the agent's log lines ("" for a line that is not one)."""
    found = LOG_LINE.fullmatch(line)
    return found["level"] if found else ""


def clean_env(**extra: str) -> dict:
    """This environment without anything that configures the agent or the simulator."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GPU_AGENT_") and k not in _OPTION_ENV and k not in _SYSTEMD_ENV}
    env.update(extra)
    return env


class Node:
    """A simulated GPU node: kubelet directory, simulated NVML, state directory."""

    def __init__(self, profile: str = "dgx1-v100", start_kubelet: bool = True,
                 pure_python: bool = False):
        self.root = tempfile.mkdtemp(prefix="ga", dir="/tmp")
        self.kdir = os.path.join(self.root, "kd")
        self.ctl = os.path.join(self.root, "ctl")
        self.state = os.path.join(self.root, "state")
        os.makedirs(self.ctl)
        os.makedirs(self.kdir)
        self.profile = profile
        self.pure_python = pure_python  # agents run agent._fast's twins (GPU_AGENT_PURE_PYTHON=1)
        self.kubelet_socket = os.path.join(self.kdir, "kubelet.sock")
        self.podresources_socket = os.path.join(self.kdir, "pod-resources", "kubelet.sock")
        self.plugin_socket = os.path.join(self.kdir, SOCKET)
        # the manual isolation file the agent watches (agent.health.isolation); not created here
        self.isolation = os.path.join(self.root, "unhealthyDevices.json")
        # the kubeconfig of the API server for events and the node condition: not created
        # here (the agent waits for it), a test that wants one writes it (tests/kube_api.py)
        self.kubeconfig = os.path.join(self.root, "kubeconfig")
        # the named configs a node label chooses from (agent.config.named): not created here
        self.config_dir = os.path.join(self.root, "config.d")
        # the node's CDI spec directories, standing in for /etc/cdi and /var/run/cdi (not created)
        self.cdi_dirs = (os.path.join(self.root, "etc-cdi"), os.path.join(self.root, "run-cdi"))
        # the agent's NFD label file (agent.rm.labels), standing in for NFD's features.d
        self.features_file = os.path.join(self.root, "features.d", "gpu-agent")
        self.kubelet: SimKubelet | None = None
        self.client = SimKubeletClient(self.kdir)
        self.agents: list[Agent] = []
        if start_kubelet:
            self.start_kubelet()

    def start_kubelet(self) -> None:
        self.kubelet = SimKubelet(self.kdir, dial_timeout=5.0)
        self.kubelet.start()

    def env(self, **extra: str) -> dict:
        twins = {"GPU_AGENT_PURE_PYTHON": "1"} if self.pure_python else {}
        return clean_env(**{"GPU_AGENT_SIM_PROFILE": self.profile,
                            "GPU_AGENT_SIM_CONTROL": self.ctl, **twins, **extra})

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def write(self, name: str, text: str) -> str:
        path = self.path(name)
        Path(path).write_text(text)
        return path

    def profile_copy(self, name: str = "profile.yaml", faults: str = "") -> str:
        """A copy of this node's shipped profile at ROOT/name, with `faults:` lines added."""
        text = (PROFILES_DIR / f"{self.profile}.yaml").read_text()
        return self.write(name, text + (f"faults:\n{faults}" if faults else ""))

    def agent(self, *args: str, env: dict | None = None, nvml: bool = True,
              kubelet: bool = True, services: bool = True) -> Agent:
        """`gpu-agent run` on this node; with `services`, the metrics endpoint on a free
        loopback port and the label file under this node (not the config's to choose)."""
        argv = ["run", "--state-dir", self.state, "--unhealthy-devices-file", self.isolation,
                "--cdi-spec-dirs", ",".join(self.cdi_dirs), "--kubeconfig", self.kubeconfig,
                "--config-dir", self.config_dir]
        if services:
            argv += ["--metrics-address", "127.0.0.1:0", "--nfd-features-file",
                     self.features_file]
        if kubelet:
            argv += ["--kubelet-socket", self.kubelet_socket,
                     "--pod-resources-socket", self.podresources_socket]
        if nvml:
            argv += ["--nvml-library", LIB]
        agent = Agent(self, [*argv, *args], self.env() if env is None else env)
        self.agents.append(agent)
        return agent

    def status_when(self, predicate, what: str, timeout: float = WAIT) -> dict:
        """status.json once predicate(doc) holds: it follows the agent within a loop tick, so
        a test that saw kubelet learn something waits here for the file to say it too."""
        deadline = time.monotonic() + timeout
        while True:
            doc = read_status(self.state)
            if doc is not None and predicate(doc):
                return doc
            if time.monotonic() > deadline:
                raise AssertionError(f"status.json never showed {what}: {doc}")
            time.sleep(0.05)

    def status_with(self, *texts: str, timeout: float = WAIT) -> str:
        """`gpu-agent status` once it shows every one of `texts` (or the last one printed)."""
        deadline = time.monotonic() + timeout
        while True:
            out = run_gpu_agent("status", "--state-dir", self.state, env=clean_env(), check=False).stdout
            if all(t in out for t in texts) or time.monotonic() > deadline:
                return out
            time.sleep(0.2)

    def close(self) -> None:
        for agent in self.agents:
            agent.kill()
        if self.kubelet is not None:
            self.kubelet.stop()
        self.client.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Agent:
    """`gpu-agent run ARGS` as a subprocess; stdout and stderr go to a log file."""

    def __init__(self, node: Node, args: list[str], env: dict):
        self.node = node
        self.args = args
        self.log_path = node.path(f"agent-{len(node.agents)}.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(gpu_agent_cmd(*args), env=env, cwd=ROOT, stdout=log,
                                         stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        self._channel: grpc.Channel | None = None

    @property
    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_log(self, text: str, timeout: float = WAIT, times: int = 1) -> str:
        """Wait until the log holds `text`, `times` times or more (the process may have
        exited)."""
        deadline = time.monotonic() + timeout
        while self.log.count(text) < times:
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not {times} times in the agent's log within "
                                     f"{timeout:g} s:\n{self.log}")
            time.sleep(0.05)
        return self.log

    def wait_for(self, predicate, what: str, timeout: float = WAIT):
        """Poll the kubelet's state until predicate(state); fail at once if the agent died."""
        def check(state):
            if not self.alive():
                raise AssertionError(f"the agent exited ({self.proc.returncode}) while waiting "
                                     f"for {what}:\n{self.log}")
            return predicate(state)
        try:
            return self.node.client.wait_for(check, timeout=timeout, what=what)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nagent log:\n{self.log}") from None

    def wait_registered(self, registrations: int = 1, resource: str = GPU, timeout: float = WAIT):
        """Wait until kubelet has `registrations` registrations of `resource`, the stream is
        open and a device list arrived from the current one; returns the ResourceState."""
        def registered(state):
            r = state.resource(resource)
            return (r is not None and r.connected and r.registrations >= registrations
                    and r.devices != () and r.last_snapshot_ns >= r.registered_ns)
        state = self.wait_for(registered, f"{resource} registration {registrations}", timeout)
        return state.resource(resource)

    def stub(self) -> dp_grpc.DevicePluginStub:
        """A DevicePlugin client on the agent's socket (as kubelet dials it)."""
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"unix:{self.node.plugin_socket}",
                                                  options=[("grpc.enable_http_proxy", 0)])
        return dp_grpc.DevicePluginStub(self._channel)

    def allocate(self, *containers: list[str]) -> dp.AllocateResponse:
        return self.stub().Allocate(dp.AllocateRequest(container_requests=[
            dp.ContainerAllocateRequest(devices_ids=ids) for ids in containers]), timeout=WAIT)

    def send(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = WAIT) -> int:
        """Send `signum` and wait for the exit code."""
        self.send(signum)
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float = WAIT) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the agent did not exit within {timeout:g} s:\n"
                                 f"{self.log}") from None

    def kill(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10)


class NotifySocket:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET; collects the messages.

    `abstract=True` binds in the abstract namespace and gives the `@name` form (no node
    needed: bench/bench_hung.py uses it too)."""

    def __init__(self, node: Node | None, abstract: bool = False):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"ga-notify-{os.getpid()}-{id(self)}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            self.address = node.path("notify.sock")
            self.sock.bind(self.address)
        self.sock.settimeout(0.1)
        self.messages: list[dict[str, str]] = []
        self.times: list[float] = []  # time.monotonic() each message came
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._cond:
                self.messages.append(fields)
                self.times.append(time.monotonic())
                self._cond.notify_all()

    def wait(self, predicate, what: str, timeout: float = WAIT) -> list[dict[str, str]]:
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self.messages), timeout):
                raise AssertionError(f"no {what} within {timeout:g} s; got {self.messages}")
            return list(self.messages)

    def wait_key(self, key: str, value: str | None = None, after: int = 0,
                 timeout: float = WAIT) -> int:
        """Index of the first message after position `after` that sets `key` (to `value`)."""
        def found(messages):
            return any(key in m and (value is None or m[key] == value)
                       for m in messages[after:])
        messages = self.wait(found, f"{key}={value or '*'} after message {after}", timeout)
        return next(i for i, m in enumerate(messages) if i >= after and key in m
                    and (value is None or m[key] == value))

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


class ReadOnlyMount:
    """A read-only bind mount of `path` over itself while in the `with` block: new files and
    renames there fail with EROFS, as after the kernel remounted a failing disk read-only;
    files opened before keep their writes (they belong to the mount underneath).

    The mount is read-only from the moment it appears (open_tree's detached copy is made
    read-only, then attached: Linux 5.12's mount API). `mount --bind` then `mount -o
    remount,bind,ro` left a window in which the running agent could open a file for writing
    through the new mount (its status file), and the remount then failed with "mount point is
    busy"; util-linux before 2.39 does the same two steps for `mount -o bind,ro`."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self):
        libc = ctypes.CDLL(None, use_errno=True)

        def call(number: int, *args) -> int:
            result = libc.syscall(ctypes.c_long(number), *(
                ctypes.c_long(a) if isinstance(a, int) else a for a in args))
            if result < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"syscall {number} on {self.path}: {os.strerror(err)}")
            return result

        path = os.fsencode(self.path)
        tree = call(_SYS_OPEN_TREE, _AT_FDCWD, path, _OPEN_TREE_CLONE | _O_CLOEXEC)
        try:
            # struct mount_attr: attr_set, attr_clr, propagation, userns_fd
            attr = (ctypes.c_uint64 * 4)(_MOUNT_ATTR_RDONLY, 0, 0, 0)
            call(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH, attr, ctypes.sizeof(attr))
            call(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, path, _MOVE_MOUNT_F_EMPTY_PATH)
        finally:
            os.close(tree)
        return self

    def __exit__(self, *exc):
        subprocess.run(["umount", self.path], check=True)


# linux/mount.h, fcntl.h; the new mount calls have one number on every architecture
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_AT_FDCWD, _AT_EMPTY_PATH, _O_CLOEXEC = -100, 0x1000, 0o2000000
_OPEN_TREE_CLONE, _MOVE_MOUNT_F_EMPTY_PATH, _MOUNT_ATTR_RDONLY = 1, 0x4, 0x1


def write_files(root: str, files: Mapping[str, bytes]) -> None:
    """Write `files` (path under `root` -> content), making their directories."""
    for name, data in files.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def changed_files(root: str, files: Mapping[str, bytes]) -> list[str]:
    """The names of `files` whose content under `root` is no longer what write_files wrote
    (changed or gone)."""
    changed = []
    for name, data in files.items():
        try:
            with open(os.path.join(root, name), "rb") as f:
                same = f.read() == data
        except FileNotFoundError:
            same = False
        if not same:
            changed.append(name)
    return changed


def thread_switches(pid: int) -> dict[int, tuple[str, int]]:
    """TID -> (name, voluntary context switches so far) of each thread of process `pid`, as
    /proc/PID/task shows them (agent.threadnames names the agent's); the main thread is named
    "main". A thread asleep on a descriptor or a lock does not switch: the count is its
    wake-ups (and its waits for a lock, the GIL among them)."""
    out = {}
    for task in sorted(os.listdir(f"/proc/{pid}/task")):
        tid = int(task)
        try:
            with open(f"/proc/{pid}/task/{task}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{task}/status") as f:
                status = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        switches = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        out[tid] = ("main" if tid == pid else name, switches)
    return out


def first_snapshot(node: Node, resource: str = GPU) -> object:
    """The first ListAndWatch snapshot the current registration of `resource` sent."""
    registration = node.client.state().resource(resource).registrations
    return next(s for s in node.client.snapshots(resource) if s.registration == registration)


def unhealthy(snapshot) -> set[str]:
    """The IDs a ListAndWatch snapshot advertises as not Healthy."""
    return {d.id for d in snapshot.devices if d.health != "Healthy"}


def mig_uuids_by_nvml(env: dict, index: int) -> list[str]:
    """The MIG devices of GPU `index` as another process reads them through the simulated
    NVML (`env`: its profile and control log, GPU_AGENT_SIM_*), sorted."""
    import subprocess
    import sys

    probe = "\n".join([
        "import pynvml", "pynvml.nvmlInit()", f"h = pynvml.nvmlDeviceGetHandleByIndex({index})",
        "for i in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):",
        "    try:", "        m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)",
        "    except pynvml.NVMLError_NotFound:", "        continue",
        "    print(pynvml.nvmlDeviceGetUUID(m))"])
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, env={**env, "LD_LIBRARY_PATH": os.path.dirname(LIB)})
    assert run.returncode == 0, run.stderr
    return sorted(line for line in run.stdout.split() if line.startswith("MIG-"))
