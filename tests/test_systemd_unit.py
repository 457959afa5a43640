"""The systemd unit (systemd/gpu-agent.service): what it must say, that it agrees with the
package and the agent, and what systemd's own tools make of it.

systemd cannot run in the tests, so `systemd-analyze verify` and `security --offline=true` run
against a temporary root: `verify` checks that ExecStart= and the other commands name executable
files, and /usr/bin/gpu-agent exists only once the RPM is installed. The root holds the host's
unit files (the targets the unit is ordered against), our unit, and /usr/bin/gpu-agent,
/bin/kill and /bin/mkdir; the installed package's own gpu-agent is run in tests/test_install.py.
The agent's side of the notify protocol (READY, STATUS, WATCHDOG, RELOADING, STOPPING in order)
is tested in tests/test_daemon_lifecycle.py.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from agent import daemon
from agent.__main__ import build_parser
from agent.config.options import OPTIONS_BY_NAME
from agent.constants import DEFAULT_KUBELET_SOCKET
from tests.conftest import ROOT

UNIT = ROOT / "systemd" / "gpu-agent.service"
SPEC = ROOT / "packaging" / "rpm" / "gpu-agent.spec"
INSTALL_DOC = ROOT / "docs" / "install.md"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed "
                                                           "(make test installs systemd as root)")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections -> keys -> values in order (systemd keys may repeat); an empty assignment
    resets the list, as systemd reads it."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        values = current.setdefault(key.strip(), [])
        if value.strip():
            values.append(value.strip())
        else:
            values.clear()
            values.append("")
    return sections


UNIT_DOC = parse_unit(UNIT.read_text())
SERVICE = UNIT_DOC["Service"]


def words(section: dict[str, list[str]], key: str) -> list[str]:
    return [w for value in section.get(key, []) for w in value.split()]


def one(key: str) -> str:
    (value,) = SERVICE[key]
    return value


def seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", text)
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


# -- what it says ------------------------------------------------------------------------------


def test_notify_service_with_watchdog_restart_and_reload():
    assert one("Type") == "notify" and one("NotifyAccess") == "main"
    assert one("Restart") == "always"
    assert one("ExecReload") == "/bin/kill -HUP $MAINPID"
    watchdog = seconds(one("WatchdogSec"))
    # the agent pings every WATCHDOG_USEC/2 (its loop wakes for it: tests/test_faults.py times
    # the pings); a status write asked for later waits at most LOOP_TICK_S, well within that
    assert watchdog / 2 > daemon.LOOP_TICK_S
    assert UNIT_DOC["Install"]["WantedBy"] == ["multi-user.target"]


def test_after_the_nvidia_units_wanted_never_required_and_free_of_kubelet():
    unit = UNIT_DOC["Unit"]
    after = words(unit, "After")
    for name in ("nvidia-persistenced.service", "nvidia-fabricmanager.service",
                 "nvidia-cdi-refresh.service"):
        assert name in after
    assert words(unit, "Wants") == ["nvidia-persistenced.service"]
    for key in ("Requires", "Requisite", "BindsTo", "PartOf", "Upholds"):
        assert key not in unit, key
    assert "kubelet" not in " ".join(after + words(unit, "Wants"))


def test_file_system_is_read_only_but_the_kubelet_directories_nfd_mps_and_the_state():
    assert one("ProtectSystem") == "strict"
    writable = set(words(SERVICE, "ReadWritePaths"))
    pod_resources = OPTIONS_BY_NAME.get("pod_resources_socket")
    kubelet_dirs = {os.path.dirname(DEFAULT_KUBELET_SOCKET), "/var/lib/kubelet/pod-resources"}
    if pod_resources is not None:
        assert os.path.dirname(pod_resources.default) in kubelet_dirs
    # the node label file's directory (agent.nfdFeaturesFile's default)
    nfd = os.path.dirname(OPTIONS_BY_NAME["nfd_features_file"].default)
    mps = OPTIONS_BY_NAME["mps_root"].default  # the MPS daemons' pipe and log directories
    assert writable == kubelet_dirs | {nfd, mps}
    # created before the sandbox is set up, so the bind mounts always have a target
    (pre,) = SERVICE["ExecStartPre"]
    assert pre.startswith("+/bin/mkdir -p ") and \
        set(pre.split()[2:]) == kubelet_dirs | {nfd, mps}
    # the state directory is systemd's StateDirectory=, which is the agent's default
    assert one("StateDirectory") == "gpu-agent"
    assert OPTIONS_BY_NAME["state_dir"].default == "/var/lib/gpu-agent"
    assert one("RuntimeDirectory") == "gpu-agent"
    for key in ("ProtectHome", "PrivateTmp", "NoNewPrivileges"):
        assert one(key) == "yes", key


def test_privileges_devices_and_system_calls():
    assert SERVICE["CapabilityBoundingSet"] == [""]  # none at all
    assert one("DevicePolicy") == "closed"
    assert "char-nvidia* rw" in SERVICE["DeviceAllow"]
    assert "PrivateDevices" not in SERVICE  # it would hide /dev/nvidia* altogether
    assert SERVICE["SystemCallFilter"][0] == "@system-service"
    # inotify is a system call, not netlink: nothing in the agent needs AF_NETLINK
    assert words(SERVICE, "RestrictAddressFamilies") == ["AF_UNIX", "AF_INET", "AF_INET6"]


# What the agent does in /dev: agent.devchar adds the missing /dev/char/<major>:<minor> links
# of the NVIDIA device nodes (mkdir /dev/char if missing, symlink, readlink, stat, inotify on /dev
# and /dev/nvidia-caps).
DEV_CHAR_SYSCALLS = ("mkdir", "mkdirat", "symlink", "symlinkat", "readlink", "readlinkat",
                     "lstat", "newfstatat", "statx", "chmod", "fchmodat", "getdents64",
                     "inotify_init1", "inotify_add_watch", "inotify_rm_watch")
# Settings that could take /dev (or /dev/char) away from the agent or make it read-only.
DEV_HIDING_KEYS = ("PrivateDevices", "ReadOnlyPaths", "InaccessiblePaths", "TemporaryFileSystem",
                   "BindReadOnlyPaths", "BindPaths", "RootDirectory", "RootImage",
                   "MountAPIVFS", "User", "DynamicUser")


def test_dev_char_links_need_no_more_than_the_unit_gives():
    assert OPTIONS_BY_NAME["dev_char_symlinks"].default is True
    # ProtectSystem=strict leaves the API file systems /dev, /proc and /sys writable (man
    # systemd.exec); nothing else touches /dev, and the agent runs as root, /dev/char's owner,
    # so it needs no capability (the bounding set stays empty) and no ReadWritePaths= entry.
    assert one("ProtectSystem") == "strict"
    for key in DEV_HIDING_KEYS:
        assert key not in SERVICE, key
    assert not any(p == "/dev" or p.startswith("/dev/") for p in words(SERVICE, "ReadWritePaths"))
    assert SERVICE["CapabilityBoundingSet"] == [""]
    assert "/dev/char" in UNIT.read_text()  # the comment that says all this


def _syscall_groups() -> dict[str, set[str]]:
    """`systemd-analyze syscall-filter`: each @group -> its entries (calls and @groups)."""
    out = analyze("syscall-filter").stdout
    groups: dict[str, set[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), set())
        elif current is not None and line.startswith(" ") and not line.strip().startswith("#"):
            current.add(line.strip())
        elif not line.strip():
            current = None
    return groups


def _expand(groups: dict[str, set[str]], names: list[str]) -> set[str]:
    calls, todo, seen = set(), list(names), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name.startswith("@"):
            todo += sorted(groups[name])
        else:
            calls.add(name)
    return calls


@needs_analyze
def test_the_system_call_filter_lets_the_agent_make_dev_char_links():
    groups = _syscall_groups()
    filters = SERVICE["SystemCallFilter"]
    allowed = _expand(groups, filters[0].split())
    denied = _expand(groups, [w for f in filters[1:] for w in f.lstrip("~").split()])
    assert all(f.startswith("~") for f in filters[1:])
    missing = [c for c in DEV_CHAR_SYSCALLS if c not in allowed or c in denied]
    assert not missing, f"the unit's SystemCallFilter= denies {missing}"


def test_it_runs_what_the_package_installs_with_a_command_line_the_agent_takes():
    argv = shlex.split(one("ExecStart"))
    assert argv[0] == "/usr/bin/gpu-agent"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "run" and args.config_file == "/etc/gpu-agent/config.yaml"
    assert "%config(noreplace) %{_sysconfdir}/gpu-agent/config.yaml" in SPEC.read_text()
    # packaging/install-tree stages the files of the RPM and the .deb alike
    staging = (ROOT / "packaging" / "install-tree").read_text()
    assert 'ln -s ../lib/gpu-agent/bin/gpu-agent "$destdir/usr/bin/gpu-agent"' in staging
    assert "install -D -m 0644 systemd/gpu-agent.service " \
        '"$destdir/usr/lib/systemd/system/gpu-agent.service"' in staging


# -- systemd's tools ---------------------------------------------------------------------------


def unit_root(tmp_path: Path, unit_text: str) -> Path:
    """A root with the host's unit files, this unit, and the commands it runs."""
    root = tmp_path / "root"
    units = root / "usr" / "lib" / "systemd" / "system"
    shutil.copytree("/usr/lib/systemd/system", units, symlinks=True)
    (units / "gpu-agent.service").write_text(unit_text)
    for path in ("/bin/kill", "/bin/mkdir"):
        (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, root / path.lstrip("/"))
    gpu_agent = root / "usr" / "bin" / "gpu-agent"
    gpu_agent.parent.mkdir(parents=True, exist_ok=True)
    gpu_agent.write_text("#!/bin/sh\n")  # verify only checks that it is an executable file
    gpu_agent.chmod(0o755)
    return root


def analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([ANALYZE, *args], capture_output=True, text=True, timeout=60)


@needs_analyze
def test_systemd_analyze_verify_is_clean(tmp_path):
    root = unit_root(tmp_path, UNIT.read_text())
    proc = analyze("verify", f"--root={root}", "gpu-agent.service")
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")


@needs_analyze
def test_systemd_analyze_verify_in_that_root_does_catch_mistakes(tmp_path):
    broken = UNIT.read_text().replace("Type=notify\n", "Type=notify\nBogus=1\n")
    root = unit_root(tmp_path, broken)
    proc = analyze("verify", f"--root={root}", "gpu-agent.service")
    assert "Unknown key 'Bogus'" in proc.stdout + proc.stderr


@needs_analyze
def test_exposure_score_is_at_most_2_5_and_is_the_one_documented(tmp_path):
    root = unit_root(tmp_path, UNIT.read_text())
    proc = analyze("security", "--offline=true", f"--root={root}", "gpu-agent.service")
    match = re.search(r"Overall exposure level for gpu-agent\.service: (\d+\.\d+)", proc.stdout)
    assert match, proc.stdout + proc.stderr
    score = float(match.group(1))
    assert score <= 2.5
    assert f"exposure level **{match.group(1)}**" in INSTALL_DOC.read_text()
