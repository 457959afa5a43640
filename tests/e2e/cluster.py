"""A one-node Kubernetes cluster on this machine, made of the real components that
scripts/e2e-build builds from their Go modules: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, containerd (CRI, CDI on, the native snapshotter) with Debian's runc, and kubelet
registered as a Node; beside it, `gpu-agent run` (or NVIDIA's k8s-device-plugin) as a plain
process on the simulated NVML and a simulated driver tree whose /dev/nvidia* are real character
devices. Only NVML and the driver are simulated.

Owns: starting and stopping those processes (each in its own session, its output in
DIR/logs/NAME.log), their configuration files, the node's driver trees and CDI spec (written by
NVIDIA's `nvidia-ctk cdi generate` over the simulated NVML), importing the locally built images,
and the `python -m tests.e2e.cluster up|down` command (docs/e2e.md). Must not assert anything:
the tests do.

What this machine kind needed (docs/e2e.md says why for each):
- cgroup v1: kubelet 1.35+ refuses it unless `failCgroupV1: false`;
- root without CAP_SYS_RESOURCE: containerd's `restrict_oom_score_adj = true`, or runc fails to
  lower a sandbox's oom_score_adj ("can't get final child's PID from pipe");
- kubelet's device-plugin directory is /var/lib/kubelet/device-plugins whatever --root-dir
  says, and its kubelet_internal_checkpoint outlives a cluster: cleared at each start;
- no image registry and no pod network: local images, host-network pods.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from tests.e2e import images, pki
from tests.e2e.kube import Kube

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ROOT / "tests" / "e2e" / "components"
BIN_DIR = Path(os.environ.get("E2E_BIN_DIR", ROOT / ".e2e" / "bin"))
# kubelet's device-plugin directory: a constant of its device manager
# (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1 DevicePluginPath), not under --root-dir
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
CHECKPOINT = os.path.join(DEVICE_PLUGIN_DIR, "kubelet_internal_checkpoint")
LOCK = "/run/gpu-agent-e2e.lock"  # one cluster per machine: the directory above is shared
NODE = "e2e-gpu-node"
CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
STARTUP = 120.0  # the bound of each component's start on a busy machine
WAIT = 60.0


class ClusterError(Exception):
    """A component is missing or did not start; the message says which and shows its log."""


# Before 1.36 kubelet reports a DRA device's health in pod status only with this alpha gate on,
# in kubelet and kube-apiserver (which drops the field otherwise) (KEP-4680: beta, on by
# default, from 1.36); the e2e cluster turns it on there (docs/e2e.md).
OLD_GATES = {"ResourceHealthStatus": True}


def versions() -> list[str]:
    """The Kubernetes versions pinned under tests/e2e/components, newest first."""
    found = [d.name.removeprefix("kubernetes-v") for d in COMPONENTS.glob("kubernetes-v*")]
    return sorted(found, key=lambda v: tuple(int(p) for p in v.split(".")), reverse=True)


def pinned(component: str, module: str) -> str:
    """The version of `module` that tests/e2e/components/<component>/go.mod requires."""
    for line in (COMPONENTS / component / "go.mod").read_text().splitlines():
        words = line.split()
        if module in words:
            return words[words.index(module) + 1]
    raise ClusterError(f"{module} is not required in {COMPONENTS / component / 'go.mod'}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, what: str, timeout: float, proc: Process | None = None) -> None:
    """Poll `predicate` (cheap, local: a socket or an HTTP endpoint) until true; fail with the
    log of `proc` when it exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and not proc.alive():
            raise ClusterError(f"{proc.name} exited ({proc.returncode}) before {what}:\n"
                               f"{proc.tail()}")
        if time.monotonic() > deadline:
            tail = f":\n{proc.tail()}" if proc is not None else ""
            raise ClusterError(f"no {what} within {timeout:g} s{tail}")
        time.sleep(0.05)


class Process:
    """One component: started in its own session, output to DIR/logs/NAME.log."""

    def __init__(self, name: str, argv: list[str], log_dir: str, env: dict | None = None,
                 cwd: str | None = None):
        self.name = name
        self.argv = argv
        self.log_path = os.path.join(log_dir, f"{name}.log")
        with open(self.log_path, "ab") as log:
            log.write(f"--- started: {' '.join(argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                         start_new_session=True)
        self.pid = self.proc.pid
        self.started = time.monotonic()

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def send(self, signum: int) -> None:
        if self.alive():
            os.kill(self.pid, signum)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Send `signum`, wait; SIGKILL the whole session if it does not exit in time."""
        if self.alive():
            os.kill(self.pid, signum)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.wait(30)


def profile_path(profile: str) -> Path:
    """The shipped profile `profile` as a path (what a copy of the simulated NVML needs)."""
    from agent.sim import PROFILES_DIR

    return PROFILES_DIR / f"{profile}.yaml"


class Agent:
    """`gpu-agent run` on the cluster's node: its process, state directory (status.json),
    simulated NVML control directory and driver tree."""

    def __init__(self, name: str, proc: Process, state: str, control: str, root: str):
        self.name = name
        self.proc = proc
        self.state = state
        self.control = control
        self.root = root

    def log(self) -> str:
        return self.proc.log()

    def wait_log(self, text: str, times: int = 1, timeout: float = WAIT) -> None:
        _wait(lambda: self.log().count(text) >= times,
              f"{text!r} {times} time(s) in {self.name}'s log", timeout, self.proc)

    def status(self) -> dict | None:
        from agent.status import read_status

        return read_status(self.state)

    def status_when(self, predicate, what: str, timeout: float = WAIT) -> dict:
        found: list[dict] = []

        def check() -> bool:
            doc = self.status()
            if doc is not None and predicate(doc):
                found.append(doc)
                return True
            return False
        _wait(check, what, timeout, self.proc)
        return found[0]

    def metrics_url(self) -> str:
        doc = self.status_when(lambda d: (d.get("metrics") or {}).get("port"),
                               "the metrics port in status.json")
        return f"http://127.0.0.1:{doc['metrics']['port']}/metrics"


class Cluster:
    """The cluster of Kubernetes `version` in a fresh directory under /tmp (short: unix socket
    paths are limited to 107 bytes). `start()` brings it up with the node Ready; `stop()` takes
    it down, containers first, and leaves no process or mount behind."""

    def __init__(self, version: str, keep: bool = False):
        self.version = version
        self.bin = BIN_DIR / f"kubernetes-v{version}"
        self.dir = tempfile.mkdtemp(prefix="gae2e", dir="/tmp")
        self.keep = keep
        self.logs = os.path.join(self.dir, "logs")
        os.makedirs(self.logs)
        self.procs: dict[str, Process] = {}
        self.kubelet_root = os.path.join(self.dir, "kubelet")
        self.containerd_socket = os.path.join(self.dir, "containerd.sock")
        self.podresources_socket = os.path.join(self.kubelet_root, "pod-resources", "kubelet.sock")
        self.kubelet_socket = os.path.join(DEVICE_PLUGIN_DIR, "kubelet.sock")
        self.cdi_dir = os.path.join(self.dir, "cdi")
        self.api: Kube | None = None
        self.pki: pki.Pki | None = None
        self.server = ""
        self._lock: int | None = None

    # -- paths -----------------------------------------------------------------------------

    def tool(self, name: str) -> str:
        """The path of a built binary (kubelet, etcd, containerd, crictl, nvidia-ctk, ...)."""
        for directory in (self.bin, *sorted(BIN_DIR.glob("*"))):
            if directory.name.startswith("kubernetes-v") and directory != self.bin:
                continue
            path = directory / name
            if path.is_file():
                return str(path)
        raise ClusterError(f"{name} is not built under {BIN_DIR}: run scripts/e2e-build "
                           f"--k8s {self.version} (or make e2e)")

    def path(self, *parts: str) -> str:
        return os.path.join(self.dir, *parts)

    # -- start -----------------------------------------------------------------------------

    def start(self) -> Cluster:
        for name in ("kubelet", "kube-apiserver", "kube-scheduler", "kube-controller-manager",
                     "etcd", "containerd", "containerd-shim-runc-v2", "crictl", "nvidia-ctk",
                     "nvidia-device-plugin", "kubectl"):
            self.tool(name)
        for cmd, package in (("runc", "runc"), ("openssl", "openssl"),
                             (images.BUSYBOX_BINARY, "busybox-static")):
            if shutil.which(cmd) is None and not os.path.isfile(cmd):
                raise ClusterError(f"{cmd} is missing: install Debian's {package}")
        self._lock = os.open(LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ClusterError(f"another end-to-end cluster holds {LOCK}: one per machine, "
                               f"since kubelet's {DEVICE_PLUGIN_DIR} is shared") from None
        try:
            self._etcd()
            self._apiserver()
            self._controllers()
            self._containerd()
            self._kubelet()
        except BaseException:
            self.stop()
            raise
        return self

    def _etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self.procs["etcd"] = proc = Process("etcd", [
            self.tool("etcd"), "--name", "e2e", "--data-dir", self.path("etcd"),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"e2e=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync", "--log-level", "warn"], self.logs)

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(self.etcd_url + "/health", timeout=2) as resp:
                    return json.loads(resp.read()).get("health") == "true"
            except (OSError, ValueError):
                return False
        _wait(healthy, "etcd healthy", STARTUP, proc)

    def _apiserver(self) -> None:
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        self.pki = p = pki.make(self.path("pki"), NODE, ["127.0.0.1", "10.96.0.1"])
        self.procs["kube-apiserver"] = proc = Process("kube-apiserver", [
            self.tool("kube-apiserver"), "--etcd-servers", self.etcd_url,
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", str(port), "--endpoint-reconciler-type", "none",
            "--tls-cert-file", p.path("apiserver.crt"),
            "--tls-private-key-file", p.path("apiserver.key"), "--client-ca-file", p.ca,
            "--token-auth-file", p.path("tokens.csv"),
            "--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
            "--service-account-issuer", "https://kubernetes.default.svc",
            "--service-account-key-file", p.path("sa.pub"),
            "--service-account-signing-key-file", p.path("sa.key"),
            "--service-cluster-ip-range", "10.96.0.0/16", "--allow-privileged=true",
            *self.gates(), "--profiling=false", "--v", "1"], self.logs)
        self.api = Kube(self.server, p.users["admin"].token, p.ca)
        _wait(self.api.readyz, "kube-apiserver ready", STARTUP, proc)

    def stop_apiserver(self) -> None:
        """The API server down (SIGTERM): etcd and everything else keep running."""
        self.procs["kube-apiserver"].stop(signal.SIGTERM)

    def start_apiserver(self) -> float:
        """The API server up again with the same flags; when it answered /readyz (monotonic)."""
        old = self.procs["kube-apiserver"]
        self.procs["kube-apiserver"] = proc = Process("kube-apiserver", old.argv, self.logs)
        _wait(self.api.readyz, "kube-apiserver ready again", STARTUP, proc)
        return time.monotonic()

    def _controllers(self) -> None:
        p = self.pki
        self.procs["kube-controller-manager"] = Process("kube-controller-manager", [
            self.tool("kube-controller-manager"),
            "--kubeconfig", p.kubeconfig("controller-manager", self.server),
            "--leader-elect=false", "--use-service-account-credentials=true",
            "--service-account-private-key-file", p.path("sa.key"), "--root-ca-file", p.ca,
            "--secure-port", "0", "--v", "1"], self.logs)
        self.procs["kube-scheduler"] = Process("kube-scheduler", [
            self.tool("kube-scheduler"), "--kubeconfig", p.kubeconfig("scheduler", self.server),
            "--leader-elect=false", "--secure-port", "0", "--v", "1"], self.logs)

    def _containerd(self) -> None:
        os.makedirs(self.cdi_dir, exist_ok=True)
        cni = self.path("cni")
        os.makedirs(cni)
        # A network config makes the runtime report its network ready (kubelet's node Ready
        # needs it); the pods use the host's network, so it is never called.
        Path(cni, "10-e2e.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "e2e", "plugins": [
                {"type": "bridge", "bridge": "e2e0", "isGateway": True, "ipMasq": False,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}]]}},
                {"type": "loopback"}]}))
        config = self.path("containerd.toml")
        Path(config).write_text(f"""version = 3
root = "{self.path('containerd', 'root')}"
state = "{self.path('containerd', 'state')}"

[grpc]
  address = "{self.containerd_socket}"

[ttrpc]
  address = "{self.containerd_socket}.ttrpc"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "native"

[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "{images.PAUSE}"

[plugins."io.containerd.cri.v1.runtime"]
  # root here lacks CAP_SYS_RESOURCE: never lower oom_score_adj below this process's own
  restrict_oom_score_adj = true
  cdi_spec_dirs = ["{self.cdi_dir}"]

[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = "runc"

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins."io.containerd.cri.v1.runtime".cni]
  bin_dirs = ["{CNI_BIN_DIR}"]
  conf_dir = "{cni}"

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
""")
        env = {**os.environ, "PATH": f"{Path(self.tool('containerd-shim-runc-v2')).parent}:"
                                     f"{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}
        self.procs["containerd"] = proc = Process("containerd", [
            self.tool("containerd"), "--config", config, "--log-level", "warn"], self.logs,
            env=env)
        _wait(lambda: os.path.exists(self.containerd_socket), "containerd's socket", STARTUP,
              proc)
        workdir = self.path("images")
        os.makedirs(workdir)
        for tar in (images.busybox_image(os.path.join(workdir, "busybox.tar")),
                    images.pause_image(os.path.join(workdir, "pause.tar"), workdir)):
            self.ctr("images", "import", "--no-unpack", tar)

    def ctr(self, *args: str) -> str:
        out = subprocess.run([self.tool("ctr"), "--address", self.containerd_socket,
                              "--namespace", "k8s.io", *args],
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise ClusterError(f"ctr {' '.join(args)}: {out.stderr.strip()}")
        return out.stdout

    def crictl(self, *args: str, check: bool = True, timeout: float = 60
               ) -> subprocess.CompletedProcess:
        out = subprocess.run([self.tool("crictl"), "--runtime-endpoint",
                              f"unix://{self.containerd_socket}", "--image-endpoint",
                              f"unix://{self.containerd_socket}", "--timeout", "30s", *args],
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise ClusterError(f"crictl {' '.join(args)}: {out.stderr.strip()}")
        return out

    def kubectl(self, *args: str, timeout: float = 60) -> str:
        """`kubectl ARGS` as the cluster's admin (the kubectl built with this version); its
        output, ClusterError when it fails."""
        out = subprocess.run([self.tool("kubectl"), "--kubeconfig",
                              self.pki.kubeconfig("admin", self.server), *args],
                             capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)}: {out.stderr.strip()}")
        return out.stdout

    @property
    def minor(self) -> int:
        return int(self.version.split(".")[1])

    def gates(self) -> list[str]:
        """The --feature-gates argument of this version's control plane (OLD_GATES)."""
        return (["--feature-gates", ",".join(f"{k}={str(v).lower()}" for k, v in
                                             OLD_GATES.items())] if self.minor < 36 else [])

    def _kubelet_config(self) -> str:
        path = self.path("kubelet.yaml")
        Path(path).write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": self.pki.ca}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            # this machine kind mounts cgroup v1 (hybrid); kubelet 1.35+ refuses it otherwise
            "failCgroupV1": False,
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "port": free_port(), "readOnlyPort": 0, "healthzPort": 0,
            "podLogsDir": self.path("pod-logs"),
            "serializeImagePulls": False,
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            # a busy CI machine's disk is not this test's business
            "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "registerNode": True,
            **({"featureGates": OLD_GATES} if self.minor < 36 else {}),
        }))
        return path

    def _kubelet(self) -> None:
        os.makedirs(DEVICE_PLUGIN_DIR, exist_ok=True)
        for entry in os.listdir(DEVICE_PLUGIN_DIR):  # an earlier cluster's sockets, checkpoint
            os.unlink(os.path.join(DEVICE_PLUGIN_DIR, entry))
        self.kubelet_config = self._kubelet_config()
        self.kubelet_kubeconfig = self.pki.kubeconfig("kubelet", self.server)
        self.start_kubelet()
        self.wait_node_ready()

    def start_kubelet(self) -> Process:
        """Start kubelet (again); its earlier process must have exited."""
        old = self.procs.get("kubelet")
        if old is not None and old.alive():
            raise ClusterError("kubelet is still running")
        self.procs["kubelet"] = proc = Process("kubelet", [
            str(self.bin / "kubelet"), "--config", self.kubelet_config,
            "--kubeconfig", self.kubelet_kubeconfig, "--root-dir", self.kubelet_root,
            "--hostname-override", NODE, "--v", "2"], self.logs)
        return proc

    def wait_node_ready(self, timeout: float = STARTUP) -> dict:
        def ready(node: dict):
            conds = node.get("status", {}).get("conditions", [])
            return node if any(c["type"] == "Ready" and c["status"] == "True"
                               for c in conds) else None
        _wait(lambda: self._node_exists(), "the node registered", timeout,
              self.procs["kubelet"])
        return self.api.wait_for(f"/api/v1/nodes/{NODE}", ready, "the node Ready", timeout)

    def _node_exists(self) -> bool:
        try:
            self.api.get(f"/api/v1/nodes/{NODE}")
            return True
        except Exception:  # noqa: BLE001 - not yet: 404, or the server busy
            return False

    # -- the node's GPUs ---------------------------------------------------------------------

    def driver_tree(self, profile: str) -> str:
        """The simulated driver tree of `profile` (a shipped name) with real character device
        nodes and the driver's libraries, built once per cluster; the CDI spec of its GPUs is
        written into the CDI directory containerd reads by NVIDIA's nvidia-ctk, over the
        simulated NVML. Returns the tree's root (the agent's driver and device-node root)."""
        from agent.sim.driver_tree import build

        root = self.path("driver", profile)
        if not os.path.isdir(root):
            build(root, str(profile_path(profile)), node_kind="char",
                  containerd=None, toolkit=False, cdi_spec=False, driver_libraries=True)
        libdir = os.path.join(root, "usr", "lib", "x86_64-linux-gnu")
        # nvidia-ctk reads the MIG capability minors of each MIG device from the host's
        # /proc/driver/nvidia-caps/mig-minors whatever --driver-root says
        # (internal/platform-support/dgpu/dgpu.go, nvcaps.NewMigCaps): it runs in a mount
        # namespace of its own where /proc/driver holds the simulated driver's file.
        minors = os.path.join(root, "proc", "driver", "nvidia-caps", "mig-minors")
        setup = ('mount -t tmpfs e2e /proc/driver && mkdir /proc/driver/nvidia-caps && '
                 'cp "$1" /proc/driver/nvidia-caps/mig-minors && shift && exec "$@"')
        out = subprocess.run([
            "unshare", "--mount", "--propagation", "private", "sh", "-c", setup, "sh", minors,
            self.tool("nvidia-ctk"), "cdi", "generate", "--driver-root", root,
            "--dev-root", root, "--nvidia-cdi-hook-path", self.tool("nvidia-cdi-hook"),
            "--output", os.path.join(self.cdi_dir, "nvidia.yaml")],
            env={**os.environ, "LD_LIBRARY_PATH": libdir,
                 "GPU_AGENT_SIM_PROFILE": str(profile_path(profile))},
            capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise ClusterError(f"nvidia-ctk cdi generate failed:\n{out.stderr[-4000:]}")
        return root

    def start_agent(self, profile: str = "dgx1-v100", *args: str, name: str = "gpu-agent",
                    env: dict | None = None, config: str | None = None,
                    kubeconfig: str | None = None) -> Agent:
        """`gpu-agent run` beside kubelet, as the systemd unit would run it (no systemd here):
        kubelet's real sockets, the driver tree of `profile` as driver and device-node root
        (NVML found there: the simulated library), its own state directory, metrics on a free
        loopback port, the kubelet's kubeconfig (as the agent's default is: the node's own
        identity) unless `kubeconfig` names another, and `args` last (they win)."""
        root = self.driver_tree(profile)
        state = self.path(f"{name}-state")
        ctl = self.path(f"simctl-{profile}")  # one control log per simulated node
        os.makedirs(ctl, exist_ok=True)
        from tests.daemon_harness import clean_env

        environ = clean_env(GPU_AGENT_SIM_PROFILE=str(profile_path(profile)),
                            GPU_AGENT_SIM_CONTROL=ctl,
                            GPU_AGENT_MIG_MINORS_FILE=os.path.join(
                                root, "proc", "driver", "nvidia-caps", "mig-minors"),
                            # the simulated driver's majors (nvidia-caps: MIG devices made)
                            GPU_AGENT_PROC_DEVICES_FILE=os.path.join(root, "proc", "devices"),
                            **(env or {}))
        argv = [sys.executable, "-m", "agent", "run",
                "--kubelet-socket", self.kubelet_socket,
                "--pod-resources-socket", self.podresources_socket,
                "--driver-root", root, "--state-dir", state, "--cdi-spec-dirs", self.cdi_dir,
                "--metrics-address", "127.0.0.1:0",
                "--nfd-features-file", self.path(f"{name}-features.d", "gpu-agent"),
                "--unhealthy-devices-file", self.path(f"{name}-unhealthyDevices.json"),
                "--kubeconfig", kubeconfig or self.kubelet_kubeconfig, "--node-name", NODE,
                "--config-dir", self.path(f"{name}-config.d"),  # none unless a test writes some
                *(["--config", config] if config else []), *args]
        agent = Agent(name, Process(name, argv, self.logs, env=environ, cwd=str(ROOT)),
                      state=state, control=ctl, root=root)
        self.procs[name] = agent.proc
        return agent

    def start_nvidia_plugin(self, profile: str = "dgx1-v100", config: str = "",
                            name: str = "nvidia-device-plugin") -> Process:
        """NVIDIA's k8s-device-plugin (the module scripts/e2e-build pins) as its DaemonSet's
        container would run it on this node, but as a plain process: the simulated NVML of
        `profile` found through LD_LIBRARY_PATH (go-nvml opens libnvidia-ml.so.1), the same
        driver tree and control directory as gpu-agent's on that profile, kubelet's real
        socket, and `config` (a `version: v1` file's text; empty: its defaults)."""
        root = self.driver_tree(profile)
        ctl = self.path(f"simctl-{profile}")
        os.makedirs(ctl, exist_ok=True)
        argv = [self.tool("nvidia-device-plugin"), "--kubelet-socket", self.kubelet_socket,
                "--driver-root", root, "--dev-root", root]
        if config:
            argv += ["--config-file", self.write(f"{name}.yaml", config)]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
               "LD_LIBRARY_PATH": os.path.join(root, "usr", "lib", "x86_64-linux-gnu"),
               "GPU_AGENT_SIM_PROFILE": str(profile_path(profile)),
               "GPU_AGENT_SIM_CONTROL": ctl}
        proc = Process(name, argv, self.logs, env=env)
        self.procs[name] = proc
        return proc

    def write(self, name: str, text: str) -> str:
        path = self.path(name)
        Path(path).write_text(text)
        return path

    # -- stop ------------------------------------------------------------------------------

    def stop(self) -> None:
        """kubelet, then every pod sandbox and container (through the CRI), containerd, the
        control plane, etcd; then leftover shims and mounts under the directory."""
        errors = []
        kubelet = self.procs.pop("kubelet", None)
        if kubelet is not None:
            kubelet.stop()
        if "containerd" in self.procs and self.procs["containerd"].alive():
            out = self.crictl("rmp", "--all", "--force", check=False, timeout=120)
            if out.returncode != 0:
                errors.append(f"crictl rmp: {out.stderr.strip()}")
        for name in ("containerd", "kube-scheduler", "kube-controller-manager",
                     "kube-apiserver", "etcd"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                proc.stop()
        for name in list(self.procs):
            self.procs.pop(name).stop()
        self._kill_leftovers()
        self._unmount()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            print("\n".join(errors), file=sys.stderr)

    def _kill_leftovers(self) -> None:
        """Shims and container processes that name this cluster's directory."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                cmdline = Path("/proc", pid, "cmdline").read_bytes()
            except OSError:
                continue
            if self.dir.encode() in cmdline:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _unmount(self) -> None:
        mounts = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = line.split()[4].replace("\\040", " ")
                if point == self.dir or point.startswith(self.dir + "/"):
                    mounts.append(point)
        for point in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self) -> str:
        """What a developer needs to use the cluster by hand."""
        return (f"cluster {self.version} in {self.dir}\n"
                f"  API server {self.server} (admin kubeconfig: "
                f"{self.pki.kubeconfig('admin', self.server)})\n"
                f"  containerd {self.containerd_socket}\n"
                f"  kubelet root {self.kubelet_root}, device plugins {DEVICE_PLUGIN_DIR}\n"
                f"  logs {self.logs}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.e2e.cluster",
        description="Start the end-to-end cluster, with gpu-agent on a simulated node, and keep "
                    "it until interrupted (docs/e2e.md).")
    parser.add_argument("command", choices=("up",))
    parser.add_argument("--k8s", default=None, help=f"Kubernetes version (one of "
                        f"{', '.join(versions())}; default the newest)")
    parser.add_argument("--profile", default="dgx1-v100",
                        help="the simulated node gpu-agent runs on (default dgx1-v100)")
    parser.add_argument("--no-agent", action="store_true", help="start no gpu-agent")
    parser.add_argument("agent_args", nargs="*", metavar="-- AGENT-ARG",
                        help="more `gpu-agent run` arguments (after --)")
    args = parser.parse_args(argv)
    cluster = Cluster(args.k8s or versions()[0], keep=True)
    try:
        cluster.start()
        print(cluster.describe(), flush=True)
        if not args.no_agent:
            agent = cluster.start_agent(args.profile, *args.agent_args)
            print(f"  gpu-agent on {args.profile}: pid {agent.proc.pid}, log "
                  f"{agent.proc.log_path}, state {agent.state}, simulated NVML control "
                  f"{agent.control} (gpu-agent sim inject-xid --control-dir ...)", flush=True)
        print("Ctrl-C stops it.", flush=True)
        # handlers, not a blocked mask: the components inherit a process's signal mask
        stopped = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stopped.set())
        while not stopped.wait(1.0):
            pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
