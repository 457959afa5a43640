"""The .deb: built with dpkg-deb from this tree (scripts/build-deb, what `make deb` runs), linted
with lintian, installed with dpkg into a temporary root, run from there, upgraded, removed and
purged.

As tests/test_install.py does for the RPM (whose helpers these tests use), the installed agent
runs with the venv's own interpreter from the root, without a chroot. `dpkg --root=ROOT` runs
the maintainer scripts chrooted into ROOT, which gets /bin/sh, rm (for postrm purge) and
stand-ins for systemctl, deb-systemd-helper and deb-systemd-invoke that record their arguments:
nothing reaches this host's systemd, and the tests check what each script asks of it. ROOT has
/run/systemd/system, which is how the scripts (as debhelper's) tell that systemd runs, but for
the one test of a root without it (a chroot or an image build).

These tests need dpkg-dev (dpkg-shlibdeps, dpkg-gencontrol), lintian for the lint test, and
root for the install tests (dpkg chroots into ROOT). They are skipped without them, saying so;
`make test` installs the tools as root, which is how CI runs.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from agent import __version__
from tests.conftest import ROOT
from tests.test_install import (
    VENV,
    build_twice,
    check_installed_and_running,
    installed,
    recorded_calls,
    script_root,
)

needs_dpkg = pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in
        ("dpkg", "dpkg-deb", "dpkg-shlibdeps", "dpkg-gencontrol")),
    reason="dpkg-dev (dpkg-shlibdeps, dpkg-gencontrol) is not installed; make test installs it "
           "as root, as CI runs")
needs_lintian = pytest.mark.skipif(shutil.which("lintian") is None, reason=(
    "lintian is not installed; make test installs it as root, as CI runs"))
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason=(
    "dpkg --root runs the maintainer scripts chrooted into the root, which needs root"))
SPEC = ROOT / "packaging" / "rpm" / "gpu-agent.spec"
UNIT = "gpu-agent.service"
CONFIG = "etc/gpu-agent/config.yaml"
STATE = "var/lib/gpu-agent"


def system_python() -> str:
    """The X.Y of /usr/bin/python3, which scripts/build-deb builds the venv on."""
    return subprocess.run(["/usr/bin/python3", "-c",
                           "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def debs(tmp_path_factory) -> dict[int, Path]:
    """The .deb built from this tree with Debian revision 1, and again with revision 2 (for the
    upgrade), once per test session."""
    return build_twice("build-deb", tmp_path_factory.mktemp("debs"), "--revision")


def deb_field(deb: Path, name: str) -> str:
    return subprocess.run(["dpkg-deb", "--field", str(deb), name], capture_output=True,
                          text=True, check=True).stdout.strip()


def deb_files(deb: Path) -> tarfile.TarFile:
    """The .deb's files, as dpkg would unpack them."""
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True,
                          check=True).stdout
    return tarfile.open(fileobj=io.BytesIO(data))


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@needs_dpkg
@pytest.mark.timeout(900)
def test_the_deb_says_what_it_needs_and_what_dpkg_keeps(debs, tmp_path):
    deb = debs[1]
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert deb.name == f"gpu-agent_{__version__}-1_{arch}.deb"  # agent.__version__, as the RPM
    depends = [d.strip() for d in deb_field(deb, "Depends").split(",")]
    assert f"python{system_python()}" in depends  # what the venv's bin/python links to
    assert "nvidia-container-toolkit" in depends
    assert [d for d in depends if d.startswith("libc6 (>= ")]  # dpkg-shlibdeps ran
    assert not [d for d in depends if d.startswith("python3-")]  # no distribution modules

    control = tmp_path / "DEBIAN"
    subprocess.run(["dpkg-deb", "--control", str(deb), str(control)], check=True)
    # dpkg keeps the operator's config on upgrade and removal, and deletes it on purge only
    assert (control / "conffiles").read_text().split() == ["/" + CONFIG]
    for script in ("postinst", "prerm", "postrm"):
        assert os.access(control / script, os.X_OK), script

    doc = "/usr/share/doc/gpu-agent/"
    with deb_files(deb) as tar:
        members = {"/" + m.name.lstrip("./").rstrip("/"): m for m in tar.getmembers()
                   if m.name not in ("./", ".")}
        copyright_text = tar.extractfile(f".{doc}copyright").read().decode()
    assert {(m.uname, m.gname) for m in members.values()} == {("root", "root")}
    files = {path for path, m in members.items() if m.isfile()}
    # every file but the conffile has a checksum (the install test's `dpkg --verify` reads them)
    summed = {"/" + line.split(None, 1)[1]
              for line in (control / "md5sums").read_text().splitlines()}
    assert summed == files - {"/" + CONFIG}
    for path in ("/usr/bin/gpu-agent", f"/usr/lib/systemd/system/{UNIT}", "/" + STATE,
                 f"/{VENV}/pyvenv.cfg", "/usr/share/gpu-agent/gpu-agent-dashboard.json",
                 "/usr/share/gpu-agent/presets/vcuda-core.yaml",
                 "/usr/share/gpu-agent/kubernetes/gpu-agent-rbac.yaml",
                 "/usr/share/gpu-agent/kubernetes/gpu-agent-dra-deviceclasses.yaml"):
        assert path in members, path
    # the RPM's documentation (its %doc line), where the unit's Documentation= points, plus
    # what Debian asks of every package
    pages = next(line for line in SPEC.read_text().splitlines() if line.startswith("%doc "))
    assert {p[len(doc):] for p in files if p.startswith(doc)} == \
        {Path(page).name for page in pages.split()[1:]} | {"copyright", "changelog.Debian.gz"}
    # shared objects are not executable on Debian (policy 8.1)
    shared = [p for p in files if re.search(r"\.so(\.\d+)*$", p)]
    assert shared and not [p for p in shared if members[p].mode & 0o111]

    # the copyright names every Python package bundled in the venv, with its version
    named = set(re.findall(r"^Comment: (\S+) (\S+), installed from its wheel", copyright_text,
                           re.MULTILINE))
    bundled = {re.match(r".*/site-packages/(.+)-([^-]+)\.dist-info$", p).groups()
               for p in members if p.endswith(".dist-info")}
    assert {(normalized(n), v) for n, v in named} == \
        {(normalized(n), v) for n, v in bundled if normalized(n) != "gpu-agent"}


@needs_dpkg
@needs_lintian
@pytest.mark.timeout(900)
def test_lintian_passes_and_every_override_is_used(debs):
    # --fail-on: any error or warning not in packaging/deb/lintian-overrides fails; --info
    # shows an override that no longer matches anything (unused-override) or matches a tag
    # only in part (mismatched-override), so that none outlives its reason
    proc = subprocess.run(["lintian", "--fail-on", "error,warning", "--info", str(debs[1])],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stale = re.findall(r"^\w: gpu-agent: (?:unused|mismatched)-override .*$", proc.stdout,
                       re.MULTILINE)
    assert stale == [], proc.stdout


# -- installing --------------------------------------------------------------------------------


def dpkg_root(path: Path, systemd_running: bool = True) -> Path:
    """An empty root where dpkg can run the maintainer scripts (see the module's docstring),
    with its own empty package database."""
    script_root(path, programs=("/bin/sh", "/bin/rm"),
                recorded=("systemctl", "deb-systemd-helper", "deb-systemd-invoke"))
    (path / "var/lib/dpkg/updates").mkdir(parents=True)
    (path / "var/lib/dpkg/info").mkdir()
    (path / "var/lib/dpkg/status").touch()
    if systemd_running:
        (path / "run/systemd/system").mkdir(parents=True)
    return path


def dpkg(root: Path, *args: str) -> subprocess.CompletedProcess:
    """dpkg on ROOT; --force-depends on install, as the root holds none of the Depends (the
    RPM's test installs with --nodeps). No terminal: a conffile question would fail, not wait."""
    proc = subprocess.run(["dpkg", f"--root={root}", *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def status(root: Path) -> str:
    """What `dpkg -s gpu-agent` says of the package: its state and version, or "" if dpkg no
    longer knows it."""
    proc = subprocess.run(["dpkg-query", f"--root={root}", "--show", "--showformat",
                           "${Status} ${Version}", "gpu-agent"],
                          capture_output=True, text=True, timeout=60)
    return proc.stdout if proc.returncode == 0 else ""


@needs_dpkg
@needs_root
@pytest.mark.timeout(900)
def test_install_run_upgrade_remove_and_purge(debs, tmp_path):
    root = dpkg_root(tmp_path / "root")

    # install: the files in place, systemd told of the unit; nothing enabled or started
    dpkg(root, "--force-depends", "--install", str(debs[1]))
    assert status(root) == f"install ok installed {__version__}-1"
    assert recorded_calls(root) == [f"deb-systemd-helper update-state {UNIT}",
                                    "systemctl --system daemon-reload"]
    assert dpkg(root, "--verify", "gpu-agent").stdout == ""  # every file as packaged
    check_installed_and_running(root)
    assert (root / "usr/share/doc/gpu-agent/install.md").read_bytes() == \
        (ROOT / "docs/install.md").read_bytes()

    # the operator changes the config; the agent has written state
    config = root / CONFIG
    operator_config = "version: v1\nflags:\n  failOnInitError: false  # by the operator\n"
    config.write_text(operator_config)
    journal = root / STATE / "allocations.journal"
    journal.write_bytes(b"gpu-agent journal\n")

    # upgrade: the changed config stays, without a question (the packaged default is the same);
    # a running agent is restarted once the new files are in place, not stopped before
    dpkg(root, "--force-depends", "--install", str(debs[2]))
    assert status(root) == f"install ok installed {__version__}-2"
    assert config.read_text() == operator_config
    # no .dpkg-dist, .dpkg-new, .dpkg-old beside it; config.d: the named configs, empty
    assert sorted(p.name for p in config.parent.iterdir()) == ["config.d", "config.yaml"]
    assert recorded_calls(root) == [f"deb-systemd-helper update-state {UNIT}",
                                    "systemctl --system daemon-reload",
                                    f"deb-systemd-invoke try-restart {UNIT}"]
    assert installed(root, "--version").stdout == f"gpu-agent {__version__}\n"
    # what `dpkg --verify` tells an operator: the config was changed, nothing else
    assert dpkg(root, "--verify", "gpu-agent").stdout == f"??5?????? c /{CONFIG}\n"

    # remove: stopped first; the files go, the operator's config and the state stay
    dpkg(root, "--remove", "gpu-agent")
    assert status(root) == f"deinstall ok config-files {__version__}-2"
    assert recorded_calls(root) == [f"deb-systemd-invoke stop {UNIT}",
                                    "systemctl --system daemon-reload"]
    for path in (VENV, "usr/bin/gpu-agent", f"usr/lib/systemd/system/{UNIT}",
                 "usr/share/doc/gpu-agent", "usr/share/gpu-agent"):
        assert not os.path.lexists(root / path), path
    assert config.read_text() == operator_config
    assert journal.read_bytes() == b"gpu-agent journal\n"

    # purge: the config, the state and the record of the operator's enablement go too
    dpkg(root, "--purge", "gpu-agent")
    assert status(root) == ""
    assert recorded_calls(root) == [f"deb-systemd-helper purge {UNIT}"]
    assert not os.path.lexists(root / "etc/gpu-agent")
    assert not os.path.lexists(root / STATE)


@needs_dpkg
@needs_root
@pytest.mark.timeout(900)
def test_where_systemd_does_not_run_the_scripts_leave_it_alone(debs, tmp_path):
    # a chroot, a container or an image build: the unit's links are recorded and purged (that
    # needs no systemd), but nothing asks systemd to reload, restart or stop
    root = dpkg_root(tmp_path / "root", systemd_running=False)
    dpkg(root, "--force-depends", "--install", str(debs[1]))
    assert recorded_calls(root) == [f"deb-systemd-helper update-state {UNIT}"]
    dpkg(root, "--force-depends", "--install", str(debs[2]))
    assert recorded_calls(root) == [f"deb-systemd-helper update-state {UNIT}"]
    dpkg(root, "--purge", "gpu-agent")
    assert recorded_calls(root) == [f"deb-systemd-helper purge {UNIT}"]
    assert status(root) == ""
