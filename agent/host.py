"""Facts about the host the agent runs on: the boot ID, and the driver's MIG capability minors.

Owns: reading the kernel's boot ID (a random UUID the kernel draws at every boot), which the
health module uses to tell that a reboot-class error has been cleared and the state module
uses to tell a checkpoint written before the last reboot; the minor numbers of the
/dev/nvidia-caps nodes that give a container access to a MIG GPU or compute instance, and
making such a node where a MIG device made after boot lacks one (`ensure_cap_node`).
`GPU_AGENT_BOOT_ID_FILE`, `GPU_AGENT_MIG_MINORS_FILE` and `GPU_AGENT_PROC_DEVICES_FILE` point
them at other files (tests, or a host whose /proc is elsewhere). Must not import anything of
`agent` but errors.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from agent.errors import AgentError

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
BOOT_ID_ENV = "GPU_AGENT_BOOT_ID_FILE"


def boot_id_file(environ: Mapping[str, str] | None = None) -> str:
    """The file the boot ID is read from: $GPU_AGENT_BOOT_ID_FILE, else the kernel's."""
    env = os.environ if environ is None else environ
    return env.get(BOOT_ID_ENV) or BOOT_ID_FILE


def boot_id(environ: Mapping[str, str] | None = None) -> str:
    """This boot's ID (stripped text); AgentError naming the file if it cannot be read."""
    path = boot_id_file(environ)
    try:
        with open(path, encoding="ascii") as f:
            value = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AgentError(f"cannot read the boot ID from {path}: {exc}") from exc
    if not value:
        raise AgentError(f"the boot ID file {path} is empty")
    return value


MIG_MINORS_FILE = "/proc/driver/nvidia-caps/mig-minors"
MIG_MINORS_ENV = "GPU_AGENT_MIG_MINORS_FILE"


def mig_minors(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """The driver's MIG capability minors by name ("config", "monitor", "gpu0/gi1/access",
    "gpu0/gi1/ci0/access"; gpuN is the GPU's minor number), from
    /proc/driver/nvidia-caps/mig-minors (or $GPU_AGENT_MIG_MINORS_FILE): the node is
    /dev/nvidia-caps/nvidia-cap<minor>. {} when the file does not exist (a driver without MIG);
    lines that are not "NAME MINOR" are skipped, as NVIDIA's plugin skips them
    (k8s-device-plugin internal/mig/mig-dp.go GetMigCapabilityDevicePaths)."""
    env = os.environ if environ is None else environ
    path = env.get(MIG_MINORS_ENV) or MIG_MINORS_FILE
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise AgentError(f"cannot read the MIG capability minors from {path}: {exc}") from exc
    out = {}
    for line in lines:
        name, _, minor = line.strip().rpartition(" ")
        if name and minor.isdigit():
            out[name] = int(minor)
    return out


PROC_DEVICES_FILE = "/proc/devices"
PROC_DEVICES_ENV = "GPU_AGENT_PROC_DEVICES_FILE"


def ensure_cap_node(dev_root: str, path: str, environ: Mapping[str, str] | None = None) -> None:
    """Make MIG capability node `path` (/dev/nvidia-caps/nvidia-cap<minor>) under `dev_root`
    when it is missing, as nvidia-modprobe -f does for a GPU or compute instance made after
    boot: a character device of the driver's nvidia-caps major (/proc/devices, or
    $GPU_AGENT_PROC_DEVICES_FILE), mode 0444 as the driver's DeviceFileMode for an access
    file. AgentError when it cannot."""
    host = os.path.join(dev_root, path.lstrip("/"))
    if os.path.exists(host):
        return
    minor = int(path.rsplit("nvidia-cap", 1)[1])
    env = os.environ if environ is None else environ
    devices = env.get(PROC_DEVICES_ENV) or PROC_DEVICES_FILE
    try:
        with open(devices, encoding="ascii", errors="replace") as f:
            majors = [line.split() for line in f]
        major = next((int(m[0]) for m in majors if len(m) == 2 and m[1] == "nvidia-caps"
                      and m[0].isdigit()), None)
        if major is None:
            raise AgentError(f"no nvidia-caps major in {devices}")
        os.makedirs(os.path.dirname(host), exist_ok=True)
        os.mknod(host, 0o444 | stat.S_IFCHR, os.makedev(major, minor))
    except OSError as exc:
        raise AgentError(f"cannot make MIG capability node {host}: {exc}") from None
