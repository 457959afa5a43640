"""The RPM: built with rpmbuild from this tree (scripts/build-rpm, what `make rpm` runs), linted,
installed into a temporary root, run from there, upgraded and erased.

How the installed agent is run without a chroot: the venv's bin/python is a link to the
system's python3.X (the one the package was built with, here the same machine), and a venv
finds its site-packages from pyvenv.cfg next to the interpreter link, wherever the venv is. So
ROOT/usr/lib/gpu-agent/bin/python runs ROOT/usr/bin/gpu-agent with ROOT's modules; `-I`
keeps this checkout and the environment out of sys.path, and a test checks that the modules
do come from ROOT. The script's own shebang names the final path, which is checked as text.

Scriptlets: rpm runs them chrooted into ROOT with /bin/sh, so ROOT gets a minimal /bin/sh
(dash and the two libraries it loads) and, since systemd cannot run here, a `systemctl` that
records its arguments: the tests check what each scriptlet asks systemd to do on install,
upgrade and erase. These tests need rpm (rpmbuild) and are skipped without it; `make test`
installs it as root, which is how CI runs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from agent import __version__
from agent.config import check_config_file, load_config
from agent.config.options import OPTIONS
from tests.conftest import ROOT, run_gpu_agent
from tests.daemon_harness import GPU, WAIT, Node, clean_env

CONFIG = ROOT / "packaging" / "rpm" / "config.yaml"
VENV = "usr/lib/gpu-agent"
RPMDB = "/var/lib/rpm"
needs_rpm = pytest.mark.skipif(
    shutil.which("rpmbuild") is None or shutil.which("rpm") is None,
    reason="rpm (rpmbuild) is not installed; make test installs it as root, as CI runs")


# -- the packaged config file (no rpm tools needed) ---------------------------------------------


def uncommented(text: str) -> str:
    """The config with every commented-out setting turned on: lines `#key...` lose their `#`;
    `## ...` lines are explanations and go."""
    out = []
    for line in text.splitlines():
        if line.startswith("##"):
            continue
        out.append(line[1:] if line.startswith("#") else line)
    return "\n".join(out) + "\n"


OPTION_KEYS = {opt.key for opt in OPTIONS if opt.key}


def leaf_keys(doc: dict, prefix: str = "") -> set[str]:
    """The settings' key paths in `doc` (a mapping-valued option such as xidActions is one)."""
    keys = set()
    for name, value in doc.items():
        key = f"{prefix}.{name}" if prefix else name
        nested = isinstance(value, dict) and key not in OPTION_KEYS
        keys |= leaf_keys(value, key) if nested else {key}
    return keys


def test_packaged_config_passes_config_check():
    proc = run_gpu_agent("config", "check", str(CONFIG), env=clean_env())
    assert proc.stdout == f"{CONFIG}: ok\n"


def test_packaged_config_comments_every_setting_with_its_default(tmp_path):
    text = uncommented(CONFIG.read_text())
    keys = leaf_keys(yaml.safe_load(text)) - {"version"}
    assert sorted(OPTION_KEYS - keys) == [], "settings missing from packaging/rpm/config.yaml"
    assert sorted(keys - OPTION_KEYS) == [], "settings that are not options"
    path = tmp_path / "all-on.yaml"
    path.write_text(text)
    check_config_file(str(path))
    on = load_config({"config_file": str(path)}, {})
    default = load_config({}, {})
    assert {k: v for k, v in on.values().items() if k != "config_file"} == \
        {k: v for k, v in default.values().items() if k != "config_file"}


# -- building ----------------------------------------------------------------------------------


def build_twice(script: str, out: Path, numbered: str) -> dict[int, Path]:
    """scripts/SCRIPT run with `numbered` 1 and 2 (the RPM's Release, the .deb's revision: two
    builds of this tree, for the upgrade), into OUT: the package each one printed last."""
    # Both at once: each build is one process at a time (pip, Cython, gcc), and this fixture
    # was the suite's longest wait (two minutes one after the other on 2 CPUs).
    builds = {number: subprocess.Popen([str(ROOT / "scripts" / script), "--output", str(out),
                                        numbered, str(number)],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for number in (1, 2)}
    built = {}
    try:
        for number, proc in builds.items():
            stdout, stderr = proc.communicate(timeout=900)
            assert proc.returncode == 0, stdout[-4000:] + stderr[-4000:]
            built[number] = Path(stdout.strip().splitlines()[-1])
    finally:
        for proc in builds.values():  # the other build, when one failed or timed out
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return built


@pytest.fixture(scope="module")
def rpms(tmp_path_factory) -> dict[int, Path]:
    """The binary RPM built from this tree with Release 1, and again with Release 2 (for the
    upgrade), once per test session."""
    return build_twice("build-rpm", tmp_path_factory.mktemp("rpms"), "--release")


def query(rpm_file: Path, *args: str) -> str:
    return subprocess.run(["rpm", "-qp", *args, str(rpm_file)], capture_output=True, text=True,
                          check=True).stdout


@needs_rpm
@pytest.mark.timeout(900)
def test_the_package_says_what_it_needs_and_offers_nothing_of_its_venv(rpms):
    rpm_file = rpms[1]
    assert rpm_file.name == f"gpu-agent-{__version__}-1.x86_64.rpm"
    requires = query(rpm_file, "--requires").splitlines()
    assert "nvidia-container-toolkit" in requires
    py = subprocess.run(["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                        capture_output=True, text=True, check=True).stdout.strip()
    assert f"python(abi) = {py}" in requires and f"/usr/bin/python{py}" in requires
    assert not [r for r in requires if "dist(" in r]  # no distro Python packages pulled in
    provides = query(rpm_file, "--provides").split()
    assert "libnvidia-ml.so.1()(64bit)" not in provides  # the simulator never stands in for NVML
    assert {p for p in provides if "(" in p} <= {"gpu-agent(x86-64)", "config(gpu-agent)"}
    files = {path: flags for flags, path in (line.split(" ", 1) for line in query(
        rpm_file, "--qf", "[%{FILEFLAGS:fflags} %{FILENAMES}\n]").splitlines())}
    assert files["/etc/gpu-agent/config.yaml"] == "cn"  # %config(noreplace)
    for path in ("/usr/bin/gpu-agent", "/usr/lib/systemd/system/gpu-agent.service",
                 "/var/lib/gpu-agent", f"/{VENV}/pyvenv.cfg",
                 "/usr/share/doc/gpu-agent/install.md", "/usr/share/licenses/gpu-agent/LICENSE",
                 "/usr/share/gpu-agent/gpu-agent-dashboard.json",
                 "/usr/share/gpu-agent/presets/vcuda-core.yaml",
                 "/usr/share/gpu-agent/kubernetes/gpu-agent-rbac.yaml",
                 "/usr/share/gpu-agent/kubernetes/gpu-agent-dra-deviceclasses.yaml",
                 "/usr/share/doc/gpu-agent/sharing.md"):
        assert path in files, path
    assert not [f for f in files if f.startswith("/usr/lib/.build-id")]
    scripts = query(rpm_file, "--scripts")
    assert "preset gpu-agent.service" in scripts or "install-system-units" in scripts


@needs_rpm
@pytest.mark.timeout(900)
@pytest.mark.skipif(shutil.which("rpmlint") is None, reason="rpmlint is not installed")
def test_rpmlint_finds_no_errors(rpms):
    srpm = next(rpms[1].parent.glob(f"gpu-agent-{__version__}-1.src.rpm"))
    proc = subprocess.run(["rpmlint", "-r", str(ROOT / "packaging/rpm/gpu-agent.rpmlintrc"),
                           str(rpms[1]), str(srpm), str(ROOT / "packaging/rpm/gpu-agent.spec")],
                          capture_output=True, text=True, timeout=300)
    summary = re.search(r"(\d+) errors, (\d+) warnings", proc.stdout)
    assert summary, proc.stdout + proc.stderr
    assert summary.group(1) == "0", proc.stdout


# -- installing --------------------------------------------------------------------------------


def script_root(path: Path, programs: tuple[str, ...] = ("/bin/sh",),
                recorded: tuple[str, ...] = ("systemctl",)) -> Path:
    """An empty root where a package manager can run scriptlets chrooted: `programs` copied
    from this host with the libraries they load (/bin/sh is dash on Debian), /dev/null, and for
    each command in `recorded` a stand-in in /usr/bin that writes its name and arguments to
    /systemd.log (systemd cannot run here; recorded_calls reads what was asked of it)."""
    for program in programs:
        ldd = subprocess.run(["ldd", program], capture_output=True, text=True, check=True).stdout
        for source in (program, *re.findall(r"(/\S+\.so[.\d]*)", ldd)):
            target = path / source.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, target)
    (path / "dev").mkdir()
    (path / "dev" / "null").touch()
    for name in recorded:
        command = path / "usr" / "bin" / name
        command.parent.mkdir(parents=True, exist_ok=True)
        command.write_text(f'#!/bin/sh\necho "{name} $*" >> /systemd.log\n')
        command.chmod(0o755)
    return path


def make_root(path: Path) -> Path:
    """An empty root where rpm can run scriptlets: /bin/sh, /dev/null, a recording systemctl."""
    script_root(path)
    subprocess.run(["rpm", "--root", str(path), "--dbpath", RPMDB, "--initdb"], check=True)
    return path


def rpm(root: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(["rpm", "--root", str(root), "--dbpath", RPMDB, *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "scriptlet failed" not in proc.stderr, proc.stderr
    return proc


def recorded_calls(root: Path) -> list[str]:
    """What the scriptlets asked of the recorded commands since the last call, in order."""
    log = root / "systemd.log"
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return calls


def installed(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the installed /usr/bin/gpu-agent with the installed venv's interpreter."""
    return subprocess.run([str(root / VENV / "bin" / "python"), "-I",
                           str(root / "usr" / "bin" / "gpu-agent"), *args],
                          capture_output=True, text=True, timeout=120, cwd="/",
                          env=clean_env() if env is None else env)


def serve_once(root: Path) -> None:
    """The installed agent, with the simulator it ships, registers with a simulated kubelet."""
    lib = next((root / VENV).glob("lib/python*/site-packages/agent/sim/lib/libnvidia-ml.so.1"))
    with Node() as node:
        proc = subprocess.Popen(
            [str(root / VENV / "bin" / "python"), "-I", str(root / "usr/bin/gpu-agent"), "run",
             "--kubelet-socket", node.kubelet_socket, "--state-dir", node.state,
             "--nvml-library", str(lib), "--cdi-spec-dirs", ",".join(node.cdi_dirs)],
            env=node.env(), cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            def registered(state):
                r = state.resource(GPU)
                return proc.poll() is not None or (r is not None and r.connected
                                                   and len(r.devices) == 8)
            node.client.wait_for(registered, timeout=WAIT,
                                 what="the installed agent's registration")
            assert proc.poll() is None, proc.stdout.read()
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=WAIT)
        assert proc.returncode == 0, out


# Where the package builds leave their paths (rpmbuild's buildroot, the build environments of
# the spec and of scripts/build-deb): none may be named in an installed file.
BUILD_PATHS = "BUILDROOT|/rpmbuild/|buildenv-gpu-agent|/gpu-agent-deb\\.|/buildenv/"


def check_installed_and_running(root: Path) -> None:
    """The package's files are in place in ROOT as packaging/install-tree staged them, and the
    installed agent runs from there: its own modules, the compiled hot paths, the packaged
    config, and a registration with a simulated kubelet."""
    assert os.readlink(root / "usr/bin/gpu-agent") == "../lib/gpu-agent/bin/gpu-agent"
    script = root / VENV / "bin" / "gpu-agent"
    assert script.read_text().splitlines()[0] == "#!/usr/lib/gpu-agent/bin/python"
    assert "home = /usr/bin" in (root / VENV / "pyvenv.cfg").read_text()
    assert (root / "var/lib/gpu-agent").is_dir()
    assert (root / "etc/gpu-agent/config.d").is_dir()  # the named configs' place, empty
    assert not list((root / "etc/gpu-agent/config.d").iterdir())
    for installed_path, source in (
            ("usr/lib/systemd/system/gpu-agent.service", "systemd/gpu-agent.service"),
            ("etc/gpu-agent/config.yaml", "packaging/rpm/config.yaml"),
            ("usr/share/gpu-agent/gpu-agent-dashboard.json",
             "packaging/grafana/gpu-agent-dashboard.json"),
            ("usr/share/gpu-agent/presets/vcuda-core.yaml", "packaging/presets/vcuda-core.yaml"),
            ("usr/share/gpu-agent/kubernetes/gpu-agent-rbac.yaml",
             "packaging/kubernetes/gpu-agent-rbac.yaml"),
            ("usr/share/gpu-agent/kubernetes/gpu-agent-dra-deviceclasses.yaml",
             "packaging/kubernetes/gpu-agent-dra-deviceclasses.yaml")):
        assert (root / installed_path).read_bytes() == (ROOT / source).read_bytes(), source
    assert not list((root / VENV).glob("lib/python*/site-packages/agent/_fast/*.c"))
    leftovers = subprocess.run(["grep", "-rlE", BUILD_PATHS, str(root / VENV)],
                               capture_output=True, text=True)
    assert leftovers.stdout == ""  # no build paths in any installed file, .pyc included

    proc = installed(root, "--version")
    assert proc.stdout == f"gpu-agent {__version__}\n", proc.stderr
    config = root / "etc/gpu-agent/config.yaml"
    assert installed(root, "config", "check", str(config)).stdout == f"{config}: ok\n"
    proc = subprocess.run([str(root / VENV / "bin/python"), "-I", "-c",
                           "import agent, agent._fast as f; print(agent.__file__, f.IMPLEMENTATION)"],
                          capture_output=True, text=True, cwd="/", env=clean_env(), check=True)
    module, implementation = proc.stdout.split()
    assert module.startswith(f"{root}/{VENV}/lib/") and implementation == "cython"
    serve_once(root)


@needs_rpm
@pytest.mark.timeout(900)
def test_install_run_upgrade_and_erase(rpms, tmp_path):
    root = make_root(tmp_path / "root")

    # install: files in place, first-install scriptlet applies the preset and starts nothing
    rpm(root, "-i", "--nodeps", str(rpms[1]))
    assert recorded_calls(root) == ["systemctl --no-reload preset gpu-agent.service"]
    check_installed_and_running(root)

    # the operator changes the config; the agent has written state
    config = root / "etc/gpu-agent/config.yaml"
    operator_config = "version: v1\nflags:\n  failOnInitError: false  # by the operator\n"
    config.write_text(operator_config)
    state = root / "var/lib/gpu-agent/checkpoint.msgpack"
    state.write_bytes(b"\x81\xa1v\x01")

    # upgrade: the changed config stays, the running agent is restarted, nothing is disabled
    rpm(root, "-U", "--nodeps", str(rpms[2]))
    assert rpm(root, "-q", "gpu-agent").stdout.strip() == f"gpu-agent-{__version__}-2.x86_64"
    assert config.read_text() == operator_config
    assert not (root / "etc/gpu-agent/config.yaml.rpmnew").exists()  # same packaged default
    assert recorded_calls(root) == ["systemctl daemon-reload",
                                   "systemctl try-restart gpu-agent.service"]
    assert installed(root, "--version").stdout == f"gpu-agent {__version__}\n"

    # erase: stopped and disabled first; the files go, the state and the operator's config stay
    rpm(root, "-e", "--nodeps", "gpu-agent")
    assert recorded_calls(root) == ["systemctl --no-reload disable --now gpu-agent.service",
                                    "systemctl daemon-reload"]
    for path in (VENV, "usr/bin/gpu-agent", "usr/lib/systemd/system/gpu-agent.service",
                 "etc/gpu-agent/config.yaml", "usr/share/doc/gpu-agent", "usr/share/gpu-agent"):
        assert not os.path.lexists(root / path), path
    assert (root / "etc/gpu-agent/config.yaml.rpmsave").read_text() == operator_config
    assert state.read_bytes() == b"\x81\xa1v\x01"
    assert rpm(root, "-qa").stdout == ""


def test_every_page_a_help_names_and_install_md_lists_is_shipped():
    # `doctor --help` sent operators to docs/troubleshooting.md, which the package did not have
    import re

    spec = (ROOT / "packaging/rpm/gpu-agent.spec").read_text()
    shipped = set(next(line for line in spec.splitlines()
                       if line.startswith("%doc ")).split()[1:])
    named = set()
    for command in ("", "run", "status", "config", "state", "doctor", "demo", "sim"):
        text = run_gpu_agent(*([command] if command else []), "--help").stdout
        named |= set(re.findall(r"docs/[a-z_-]+\.md", text.replace("\n", "")))
    assert named and named <= shipped, named - shipped
    listed = next(line for line in (ROOT / "docs/install.md").read_text().splitlines()
                  if line.startswith("| `/usr/share/doc/gpu-agent/` |"))
    assert {f"docs/{name}" for name in re.findall(r"([a-z_-]+\.md)", listed)
            if name != "README.md"} | {"README.md"} == shipped
