"""A simulated driver tree: what a GPU host's file system shows of the NVIDIA driver, the
container toolkit and the container runtime, built under a directory for `gpu-agent doctor`'s
tests, its benchmark and the demo (`doctor --root DIR`).

Owns: `build(root, ...)` and the `gpu-agent sim driver-tree DIR` command. The tree holds:
- device nodes /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools, /dev/nvidia<minor> per
  GPU of the profile (MIG-enabled ones too), /dev/nvidia-caps/nvidia-cap1, -cap2 (the MIG
  config and monitor capabilities) and the GPU- and compute-instance capabilities of the
  profile's MIG devices, as empty regular files or FIFOs by default. Real character devices
  (`char`, root only) are for the end-to-end cluster (tests/e2e), whose containers must get
  device nodes: on a host without NVIDIA's driver they open nothing, but on a GPU host a
  character device 195:0 opens the real GPU 0, so they are never the default. Their major:minor
  numbers (the driver's: 195 for the GPUs and nvidiactl; nvidia-uvm and nvidia-caps take
  dynamic majors, here 508 and 509) are recorded in /dev/.gpu-agent-sim-nodes.json
  (agent.devchar.SIM_RECORD), which the agent and the doctor read for entries that are not
  character devices;
- /dev/char/<major>:<minor> links to them (relative, as udev makes them), unless asked not to;
- /proc/devices (the majors by driver name), /proc/driver/nvidia/capabilities/mig/{config,
  monitor} (the capability files giving the caps' minors) and /proc/driver/nvidia-caps/mig-minors
  (every GPU instance 0-14 and compute instance 0-7 of every GPU minor, numbered as the driver
  numbers them: config 1, monitor 2, then 9 per GPU instance), as the driver writes them;
- /etc/containerd/config.toml, version 2 or 3, with or without the `nvidia` runtime and with
  enable_cdi true, false or unset; optionally /etc/crio/crio.conf.d/99-nvidia.conf;
- /etc/cdi/nvidia.yaml: the CDI spec `nvidia-ctk cdi generate` would write (index and UUID
  names per GPU and per MIG device of a MIG-enabled GPU, and `all`);
- /usr/bin/nvidia-ctk and /usr/bin/nvidia-container-runtime: scripts that answer --version
  only; optionally /usr/bin/systemctl answering `is-active` with a given state;
- /usr/bin/nvidia-smi: a script that takes the two commands NVIDIA's DRA driver runs to
  time-slice a GPU (`-i ID -c MODE`, `compute-policy -i ID --set-timeslice N`), answers as
  nvidia-smi does and records each call in /var/log/nvidia-smi.log (NVIDIA_SMI_LOG);
- optionally the driver's libraries in /usr/lib/x86_64-linux-gnu, named for the profile's
  driver version as the driver installs them: libnvidia-ml.so.<version> is a copy of the
  simulated NVML, libcuda.so.<version> an empty placeholder, each with its .so.1 link. That is
  what NVIDIA's own `nvidia-ctk cdi generate --driver-root DIR` needs to write its spec for the
  simulated node, and what `--driver-root DIR` lets the agent find NVML by.
Must not create anything outside `root`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
from dataclasses import dataclass, field

from agent.errors import SimError

NVIDIA_MAJOR = 195  # the driver's fixed major: /dev/nvidia<N> and /dev/nvidiactl
NVIDIACTL_MINOR = 255
UVM_MAJOR = 508  # dynamic on a real host (see /proc/devices)
CAPS_MAJOR = 509
TOOLKIT_VERSION = "1.17.8"
CONTAINERD_PLUGIN = {2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
RUNTIME_BINARY = "/usr/bin/nvidia-container-runtime"
NVIDIA_SMI_LOG = "/var/log/nvidia-smi.log"  # the calls of the simulated nvidia-smi
LIBRARY_DIR = "/usr/lib/x86_64-linux-gnu"  # where Debian and Ubuntu drivers put them
NODE_KINDS = ("file", "fifo", "char")


@dataclass
class DriverTree:
    """What `build` made: the root and each device node's (host path, major, minor)."""

    root: str
    nodes: list[tuple[str, int, int]] = field(default_factory=list)

    def path(self, host_path: str) -> str:
        return os.path.join(self.root, host_path.lstrip("/"))

    def char_link(self, host_path: str) -> str:
        """The /dev/char link of the node at `host_path`, under the root."""
        major, minor = next((ma, mi) for p, ma, mi in self.nodes if p == host_path)
        return self.path(f"/dev/char/{major}:{minor}")


def containerd_config(version: int = 2, nvidia_runtime: bool = True, default: bool = True,
                      enable_cdi: bool | None = True) -> str:
    """A containerd config.toml of `version` (2 or 3): the `nvidia` runtime as
    `nvidia-ctk runtime configure --runtime=containerd [--set-as-default] [--cdi.enabled]`
    writes it, or only runc."""
    if version not in CONTAINERD_PLUGIN:
        raise SimError(f"containerd config version {version}: expected 2 or 3")
    plugin = CONTAINERD_PLUGIN[version]
    lines = [f"version = {version}", "", f'[plugins."{plugin}"]']
    if enable_cdi is not None:
        lines.append(f"  enable_cdi = {'true' if enable_cdi else 'false'}")
    lines += ["", f'[plugins."{plugin}".containerd]',
              f'  default_runtime_name = "{"nvidia" if nvidia_runtime and default else "runc"}"',
              "", f'[plugins."{plugin}".containerd.runtimes.runc]',
              '  runtime_type = "io.containerd.runc.v2"']
    if nvidia_runtime:
        lines += ["", f'[plugins."{plugin}".containerd.runtimes.nvidia]',
                  '  runtime_type = "io.containerd.runc.v2"',
                  "", f'[plugins."{plugin}".containerd.runtimes.nvidia.options]',
                  f'  BinaryName = "{RUNTIME_BINARY}"']
    return "\n".join(lines) + "\n"


CRIO_DROP_IN = f"""[crio.runtime]
default_runtime = "nvidia"

[crio.runtime.runtimes.nvidia]
runtime_path = "{RUNTIME_BINARY}"
runtime_type = "oci"
"""


def _script(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)


def _version_stub(name: str, banner: str) -> str:
    return (f"#!/bin/sh\n# gpu-agent simulated driver tree: a stand-in for {name} that only "
            f"tells its version.\nif [ \"$1\" = \"--version\" ]; then\n"
            f"  echo \"{banner} version {TOOLKIT_VERSION}\"\n  echo \"commit: simulated\"\n"
            f"  exit 0\nfi\necho \"simulated {name}: only --version is implemented\" >&2\n"
            f"exit 1\n")


def _systemctl_stub(state: str) -> str:
    return ("#!/bin/sh\n# gpu-agent simulated driver tree: systemctl answering is-active.\n"
            f"if [ \"$1\" = \"is-active\" ]; then\n  echo \"{state}\"\n"
            f"  [ \"{state}\" = active ] && exit 0\n  exit 3\nfi\n"
            "echo \"simulated systemctl: only is-active is implemented\" >&2\nexit 1\n")


def _nvidia_smi_stub(log: str) -> str:
    return ("#!/bin/sh\n# gpu-agent simulated driver tree: nvidia-smi setting a compute mode or "
            "a time slice, recorded, nothing changed.\n"
            f"mkdir -p '{os.path.dirname(log)}' && echo \"$*\" >> '{log}'\n"
            "case \"$*\" in\n"
            "  \"-i \"*\" -c \"*) echo \"Compute mode set to $4 for GPU $2.\"; exit 0;;\n"
            "  \"compute-policy -i \"*\" --set-timeslice \"*)\n"
            "    echo \"Set timeslice to $5 for GPU $3\"; exit 0;;\n"
            "esac\n"
            "echo \"simulated nvidia-smi: only -i ID -c MODE and compute-policy -i ID "
            "--set-timeslice N are implemented\" >&2\nexit 2\n")


def _cdi_spec(gpus: list[dict]) -> str:
    import yaml

    devices = []
    for gpu in gpus:
        edits = {"deviceNodes": [{"path": f"/dev/nvidia{gpu['minor']}"}]}
        devices.append({"name": str(gpu["index"]), "containerEdits": edits})
        devices.append({"name": gpu["uuid"], "containerEdits": edits})
    for gpu in gpus:  # MIG devices, as the toolkit names them: "<GPU index>:<MIG index>", UUID
        mig = gpu.get("mig", {})
        for k, inst in enumerate(mig.get("instances", []) if mig.get("mode") == "enabled"
                                 else []):
            base = _cap_base(int(gpu["minor"]), int(inst["gi"]))
            edits = {"deviceNodes": [{"path": f"/dev/nvidia{gpu['minor']}"},
                                     {"path": f"/dev/nvidia-caps/nvidia-cap{base}"},
                                     {"path": f"/dev/nvidia-caps/nvidia-cap{base + 1 + inst['ci']}"}]}
            devices.append({"name": f"{gpu['index']}:{k}", "containerEdits": edits})
            devices.append({"name": inst["uuid"], "containerEdits": edits})
    devices.append({"name": "all", "containerEdits": {"deviceNodes": [
        {"path": f"/dev/nvidia{g['minor']}"} for g in gpus]}})
    spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices,
            "containerEdits": {"deviceNodes": [{"path": "/dev/nvidiactl"},
                                               {"path": "/dev/nvidia-uvm"},
                                               {"path": "/dev/nvidia-uvm-tools"}]}}
    return "# written by gpu-agent's simulated driver tree, as `nvidia-ctk cdi generate`\n" + \
        yaml.safe_dump(spec, sort_keys=False)


def _cap_base(gpu_minor: int, gi: int) -> int:
    """The capability minor of GPU instance `gi` of GPU `gpu_minor` (its compute instances
    follow it), as the driver numbers them in mig-minors."""
    return 3 + gpu_minor * 135 + gi * 9


def _mig_cap_minors(gpus: list[dict]) -> list[int]:
    """The capability minors of the MIG devices of the profile's MIG-enabled GPUs: the access
    nodes of each GPU instance and compute instance (one per instance, in order)."""
    minors: dict[int, None] = {}
    for gpu in gpus:
        mig = gpu.get("mig", {})
        for inst in mig.get("instances", []) if mig.get("mode") == "enabled" else []:
            base = _cap_base(int(gpu["minor"]), int(inst["gi"]))
            minors.update({base: None, base + 1 + int(inst["ci"]): None})
    return list(minors)


def mig_minors_text(gpus: int) -> str:
    """/proc/driver/nvidia-caps/mig-minors of a driver with `gpus` GPU minors."""
    lines = ["config 1", "monitor 2"]
    for gpu in range(gpus):
        for gi in range(15):
            base = _cap_base(gpu, gi)
            lines.append(f"gpu{gpu}/gi{gi}/access {base}")
            lines += [f"gpu{gpu}/gi{gi}/ci{ci}/access {base + 1 + ci}" for ci in range(8)]
    return "\n".join(lines) + "\n"


def build(root: str, profile: str | None = None, *, node_kind: str = "file",
          dev_char: bool = True, containerd: int | None = 2, nvidia_runtime: bool = True,
          default_runtime: bool = True, enable_cdi: bool | None = True, crio: bool = False,
          toolkit: bool = True, cdi_spec: bool = True, systemctl: str | None = None,
          driver_libraries: bool = False) -> DriverTree:
    """Build the tree for the GPUs of `profile` (a shipped name or a path; default
    $GPU_AGENT_SIM_PROFILE, else dgx1-v100) under `root` (created if missing)."""
    from agent.devchar import SIM_RECORD
    from agent.sim.profile import load_profile

    if node_kind not in NODE_KINDS:
        raise SimError(f"node kind {node_kind!r}: expected one of {', '.join(NODE_KINDS)}")
    loaded = load_profile(profile)
    gpus = loaded["gpus"]
    tree = DriverTree(os.path.abspath(root))
    nodes = [("/dev/nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR),
             ("/dev/nvidia-uvm", UVM_MAJOR, 0), ("/dev/nvidia-uvm-tools", UVM_MAJOR, 1)]
    nodes += [(f"/dev/nvidia{g['minor']}", NVIDIA_MAJOR, int(g["minor"])) for g in gpus]
    nodes += [("/dev/nvidia-caps/nvidia-cap1", CAPS_MAJOR, 1),
              ("/dev/nvidia-caps/nvidia-cap2", CAPS_MAJOR, 2)]
    nodes += [(f"/dev/nvidia-caps/nvidia-cap{minor}", CAPS_MAJOR, minor)
              for minor in _mig_cap_minors(gpus)]
    for host_path, major, minor in nodes:
        path = tree.path(host_path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.lexists(path):
            os.unlink(path)
        if node_kind == "fifo":
            os.mkfifo(path, 0o666)
        elif node_kind == "char":
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        else:
            with open(path, "w"):
                pass
        if dev_char:
            link = tree.path(f"/dev/char/{major}:{minor}")
            os.makedirs(os.path.dirname(link), exist_ok=True)
            if os.path.lexists(link):
                os.unlink(link)
            os.symlink(os.path.relpath(path, os.path.dirname(link)), link)
    tree.nodes = nodes
    record = {"version": 1, "nodes": {p: [ma, mi] for p, ma, mi in nodes}}
    _write(tree.path(f"/dev/{SIM_RECORD}"), json.dumps(record, indent=1) + "\n")
    _write(tree.path("/proc/devices"),
           f"Character devices:\n  1 mem\n{NVIDIA_MAJOR} nvidia-frontend\n"
           f"{UVM_MAJOR} nvidia-uvm\n{CAPS_MAJOR} nvidia-caps\n\nBlock devices:\n  8 sd\n")
    for cap, minor, mode in (("config", 1, 256), ("monitor", 2, 292)):
        _write(tree.path(f"/proc/driver/nvidia/capabilities/mig/{cap}"),
               f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n")
    _write(tree.path("/proc/driver/nvidia-caps/mig-minors"), mig_minors_text(len(gpus)))
    if containerd is not None:
        _write(tree.path("/etc/containerd/config.toml"),
               containerd_config(containerd, nvidia_runtime, default_runtime, enable_cdi))
    if crio:
        _write(tree.path("/etc/crio/crio.conf.d/99-nvidia.conf"), CRIO_DROP_IN)
    if cdi_spec:
        _write(tree.path("/etc/cdi/nvidia.yaml"), _cdi_spec(gpus))
    if toolkit:
        _script(tree.path("/usr/bin/nvidia-ctk"),
                _version_stub("nvidia-ctk", "NVIDIA Container Toolkit CLI"))
        _script(tree.path(RUNTIME_BINARY),
                _version_stub("nvidia-container-runtime", "NVIDIA Container Runtime"))
    if systemctl is not None:
        _script(tree.path("/usr/bin/systemctl"), _systemctl_stub(systemctl))
    _script(tree.path("/usr/bin/nvidia-smi"), _nvidia_smi_stub(tree.path(NVIDIA_SMI_LOG)))
    if driver_libraries:
        _driver_libraries(tree, loaded["driver_version"])
    return tree


def _driver_libraries(tree: DriverTree, version: str) -> None:
    from agent.sim import lib_path

    libdir = tree.path(LIBRARY_DIR)
    os.makedirs(libdir, exist_ok=True)
    for name in ("libnvidia-ml.so", "libcuda.so"):
        real = os.path.join(libdir, f"{name}.{version}")
        if name == "libnvidia-ml.so":
            shutil.copyfile(lib_path(), real)
        else:
            _write(real, "")
        link = os.path.join(libdir, f"{name}.1")
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(os.path.basename(real), link)


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _cmd_driver_tree(args: argparse.Namespace) -> int:
    cdi = {"on": True, "off": False, "unset": None}[args.enable_cdi]
    tree = build(args.dir, args.profile, node_kind=args.node_kind,
                 dev_char=not args.no_dev_char,
                 containerd=None if args.containerd == "none" else int(args.containerd),
                 nvidia_runtime=not args.no_nvidia_runtime, enable_cdi=cdi, crio=args.crio,
                 toolkit=not args.no_toolkit, systemctl=args.systemctl,
                 driver_libraries=args.driver_libraries)
    print(f"simulated driver tree in {tree.root}: {len(tree.nodes)} device nodes; check it "
          f"with: gpu-agent doctor --root {tree.root} --cdi-spec-dirs {tree.path('/etc/cdi')}")
    return 0


def add_cli(simsub: argparse._SubParsersAction) -> None:
    p = simsub.add_parser(
        "driver-tree", help="build a simulated driver tree (device nodes, /dev/char, "
                            "containerd config, toolkit stubs) for `gpu-agent doctor --root`",
        description="Build under DIR what a GPU host shows of the driver, the container "
                    "toolkit and containerd (docs/simulator.md, 'The simulated driver tree').")
    p.add_argument("dir", metavar="DIR", help="where to build it (created if missing)")
    p.add_argument("--profile", default=None,
                   help="node profile giving the GPUs (default $GPU_AGENT_SIM_PROFILE or "
                        "dgx1-v100)")
    p.add_argument("--node-kind", choices=NODE_KINDS, default="file",
                   help="device nodes as empty files, FIFOs or (root only; never on a GPU "
                        "host) real character devices (default file)")
    p.add_argument("--no-dev-char", action="store_true", help="make no /dev/char links")
    p.add_argument("--containerd", choices=("2", "3", "none"), default="2",
                   help="containerd config.toml version, or none (default 2)")
    p.add_argument("--no-nvidia-runtime", action="store_true",
                   help="leave the nvidia runtime out of the containerd config")
    p.add_argument("--enable-cdi", choices=("on", "off", "unset"), default="on",
                   help="containerd's enable_cdi (default on)")
    p.add_argument("--crio", action="store_true", help="add a CRI-O drop-in with the nvidia "
                                                       "runtime")
    p.add_argument("--no-toolkit", action="store_true",
                   help="no nvidia-ctk / nvidia-container-runtime stubs")
    p.add_argument("--driver-libraries", action="store_true",
                   help="add the driver's libnvidia-ml (the simulated one) and libcuda "
                        "(a placeholder) for the profile's driver version")
    p.add_argument("--systemctl", metavar="STATE", default=None,
                   help="add a systemctl stub whose `is-active` prints STATE")
    p.set_defaults(func=_cmd_driver_tree)
