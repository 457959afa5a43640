"""agent.devchar: the missing /dev/char/<major>:<minor> links of the NVIDIA device nodes, as
nvidia-container-toolkit's `nvidia-ctk system create-dev-char-symlinks` makes them
(NVIDIA/nvidia-container-toolkit cmd/nvidia-ctk/system/create-dev-char-symlinks/, existing.go:
character devices `<root>/dev/nvidia*` and `<root>/dev/nvidia-caps/nvidia-*` but nvidia-fs*,
nvidia-nvswitch*, nvidia-nvlink*; create-dev-char-symlinks.go: `os.Symlink(<the node's path
under the root>, <dev char>/<major>:<minor>)`, an existing entry left as it is).

The trees hold real character devices (os.mknod, as root): the module reads them with the
lstat it uses on a host. Where mknod is not permitted (not root), the nodes are FIFOs and the
module is given a reader that knows their numbers (the `read_numbers` it takes), so the same
tests run. A node 195:0 in a temp tree is never opened: only its numbers are read.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from agent import devchar
from agent.config.options import OPTIONS_BY_NAME
from agent.constants import DEFAULT_DEV_CHAR_SYMLINKS
from agent.devchar import DevCharLinks


def _mknod_works(tmp_path_factory) -> bool:
    probe = tmp_path_factory.mktemp("mknod") / "probe"
    try:
        os.mknod(probe, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except OSError:
        return False
    os.unlink(probe)
    return True


class Tree:
    """A temp root with /dev, its NVIDIA nodes, and what the module needs to read them."""

    def __init__(self, root: str, real: bool, make_dev: bool = True):
        self.root = root
        self.real = real
        self.numbers: dict[str, tuple[int, int]] = {}  # realpath -> numbers (FIFO mode only)
        os.makedirs(self.path("/dev/char") if make_dev else root)

    def path(self, host_path: str) -> str:
        return os.path.join(self.root, host_path.lstrip("/"))

    def node(self, host_path: str, major: int, minor: int) -> str:
        path = self.path(host_path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if self.real:
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(major, minor))
        else:
            os.mkfifo(path, 0o600)
            self.numbers[os.path.realpath(path)] = (major, minor)
        return path

    def read_numbers(self, path: str):
        if self.real:
            return devchar.char_device_numbers(path)
        return self.numbers.get(os.path.realpath(path)) if not os.path.islink(path) else None

    def links(self, **kwargs) -> DevCharLinks:
        return DevCharLinks(self.root, read_numbers=self.read_numbers, **kwargs)

    def char(self, name: str) -> str:
        return self.path(f"/dev/char/{name}")

    def entries(self) -> dict[str, str]:
        """/dev/char as it is: name -> link target (or '<file>' / '<dir>')."""
        out = {}
        for name in sorted(os.listdir(self.path("/dev/char"))):
            p = self.char(name)
            out[name] = os.readlink(p) if os.path.islink(p) else \
                "<dir>" if os.path.isdir(p) else "<file>"
        return out


@pytest.fixture(scope="session")
def mknod_works(tmp_path_factory) -> bool:
    return _mknod_works(tmp_path_factory)


@pytest.fixture
def tree(tmp_path, mknod_works) -> Tree:
    return Tree(str(tmp_path / "root"), real=mknod_works)


# The nodes of a 2-GPU host with MIG capabilities, as the driver numbers them (nvidia-uvm and
# nvidia-caps take dynamic majors; 508 and 509 here).
HOST_NODES = [
    ("/dev/nvidiactl", 195, 255), ("/dev/nvidia-modeset", 195, 254),
    ("/dev/nvidia0", 195, 0), ("/dev/nvidia1", 195, 1),
    ("/dev/nvidia-uvm", 508, 0), ("/dev/nvidia-uvm-tools", 508, 1),
    ("/dev/nvidia-caps/nvidia-cap1", 509, 1), ("/dev/nvidia-caps/nvidia-cap2", 509, 2),
]


def host(tree: Tree, nodes=HOST_NODES) -> None:
    for path, major, minor in nodes:
        tree.node(path, major, minor)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def started():
    """Start DevCharLinks objects; every one is stopped after the test."""
    running: list[DevCharLinks] = []

    def start(links: DevCharLinks) -> DevCharLinks:
        links.start()
        running.append(links)
        return links

    yield start
    for links in running:
        links.stop()


# -- one pass ----------------------------------------------------------------------------------


def test_a_pass_creates_every_missing_link_to_the_nodes_absolute_path(tree):
    host(tree)
    created = tree.links().sync()
    want = {f"{ma}:{mi}": tree.path(p) for p, ma, mi in HOST_NODES}
    assert tree.entries() == want
    assert sorted(created) == sorted(tree.char(n) for n in want)
    # each link leads to its node (systemd resolves the path to the device number)
    for name, target in want.items():
        assert os.path.realpath(tree.char(name)) == os.path.realpath(target)


def test_the_nodes_are_the_toolkits(tree):
    """nvidia* character devices in /dev and nvidia-* in /dev/nvidia-caps, but not
    nvidia-fs*, nvidia-nvswitch*, nvidia-nvlink*, symlinks, files or other devices."""
    host(tree)
    tree.node("/dev/nvidia-nvswitchctl", 507, 255)
    tree.node("/dev/nvidia-nvswitch0", 507, 0)
    tree.node("/dev/nvidia-nvlink", 506, 0)
    tree.node("/dev/nvidia-fs0", 505, 0)
    tree.node("/dev/fuse", 10, 229)
    tree.node("/dev/nvidia-caps/other-cap", 509, 9)
    open(tree.path("/dev/nvidia7"), "w").close()  # a regular file: not a node
    os.symlink("nvidia0", tree.path("/dev/nvidia8"))  # a link to a node: not a node
    os.makedirs(tree.path("/dev/nvidia-caps-imex-channels"))
    nodes = tree.links().nodes()
    assert [(n.path, n.major, n.minor) for n in nodes] == sorted(
        [(tree.path(p), ma, mi) for p, ma, mi in HOST_NODES if "caps/" not in p]) + \
        [(tree.path(p), ma, mi) for p, ma, mi in HOST_NODES if "caps/" in p]
    tree.links().sync()
    assert sorted(tree.entries()) == sorted(f"{ma}:{mi}" for _, ma, mi in HOST_NODES)


def test_only_the_missing_links_are_created_and_nothing_else_is_touched(tree, caplog):
    host(tree)
    # present and right: udev's relative link, and the toolkit's absolute one
    os.symlink("../nvidiactl", tree.char("195:255"))
    os.symlink(tree.path("/dev/nvidia-uvm"), tree.char("508:0"))
    # foreign: a link to another node, a dangling link, a regular file, a directory
    os.symlink("../nvidia1", tree.char("195:0"))
    os.symlink("../nvidia-gone", tree.char("508:1"))
    with open(tree.char("195:254"), "w") as f:
        f.write("not a link\n")
    os.mkdir(tree.char("509:1"))
    # entries for devices that are not NVIDIA's, and one for no device at all
    os.symlink("../null", tree.char("1:3"))
    os.symlink("../nowhere", tree.char("999:9"))
    before = {name: os.lstat(tree.char(name)) for name in tree.entries()}
    before_entries = tree.entries()

    links = tree.links()
    with caplog.at_level(logging.INFO, logger="agent.devchar"):
        created = links.sync()

    assert sorted(created) == [tree.char("195:1"), tree.char("509:2")]
    after = tree.entries()
    assert after == {**before_entries, "195:1": tree.path("/dev/nvidia1"),
                     "509:2": tree.path("/dev/nvidia-caps/nvidia-cap2")}
    for name, st in before.items():  # the very same inodes, unchanged
        now = os.lstat(tree.char(name))
        assert (now.st_ino, now.st_mtime_ns, now.st_mode) == \
            (st.st_ino, st.st_mtime_ns, st.st_mode), name
    status = links.status()
    assert status["foreign"] == {
        tree.char("195:0"): f"points to ../nvidia1 (want -> {tree.path('/dev/nvidia0')})",
        tree.char("195:254"): f"is not a link (want -> {tree.path('/dev/nvidia-modeset')})",
        tree.char("508:1"): "points to ../nvidia-gone "
                            f"(want -> {tree.path('/dev/nvidia-uvm-tools')})",
        tree.char("509:1"): "is not a link "
                            f"(want -> {tree.path('/dev/nvidia-caps/nvidia-cap1')})",
    }
    assert (status["nodes"], status["linked"], status["created"]) == (8, 4, 2)
    assert status["problems"] == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4 and all(w.startswith("left alone: ") for w in warnings)
    assert any(tree.char("195:0") in w for w in warnings)

    # a second pass changes nothing and says nothing new
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agent.devchar"):
        assert links.sync() == []
    assert tree.entries() == after
    assert caplog.records == []


def test_a_foreign_entry_put_right_by_someone_else_is_no_longer_reported(tree, caplog):
    host(tree, [("/dev/nvidia0", 195, 0), ("/dev/nvidia1", 195, 1)])
    os.symlink("../nvidia1", tree.char("195:0"))
    links = tree.links()
    links.sync()
    assert list(links.status()["foreign"]) == [tree.char("195:0")]
    os.unlink(tree.char("195:0"))
    os.symlink("../nvidia0", tree.char("195:0"))  # the operator's fix
    with caplog.at_level(logging.INFO, logger="agent.devchar"):
        assert links.sync() == []
    assert links.status()["foreign"] == {}
    assert any(r.getMessage() == f"{tree.char('195:0')} needs no attention any more (it "
               f"points to ../nvidia1 (want -> {tree.path('/dev/nvidia0')}))"
               for r in caplog.records)


def test_no_nodes_no_links_and_no_directory_made(tmp_path):
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    links = DevCharLinks(str(root))
    assert links.sync() == []
    assert not (root / "dev" / "char").exists()
    assert links.status()["nodes"] == 0


def test_a_missing_dev_char_is_made_0755_whatever_the_umask(tree):
    host(tree, [("/dev/nvidia0", 195, 0)])
    os.rmdir(tree.path("/dev/char"))
    old = os.umask(0o077)  # the unit's UMask=
    try:
        tree.links().sync()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tree.path("/dev/char")).st_mode) == 0o755
    assert tree.entries() == {"195:0": tree.path("/dev/nvidia0")}


def test_a_dev_char_that_is_not_a_directory_is_reported_and_left(tree):
    host(tree, [("/dev/nvidia0", 195, 0)])
    os.rmdir(tree.path("/dev/char"))
    open(tree.path("/dev/char"), "w").close()
    links = tree.links()
    assert links.sync() == []
    assert os.path.isfile(tree.path("/dev/char"))
    assert links.status()["problems"] == [
        f"{tree.path('/dev/char')} exists and is not a directory; no links made"]


def test_a_read_only_dev_char_is_reported_once_not_fatal_and_recovers(tree, monkeypatch,
                                                                       caplog, started):
    host(tree, [("/dev/nvidia0", 195, 0), ("/dev/nvidia1", 195, 1)])
    real_symlink = os.symlink

    def read_only(src, dst, *args, **kwargs):
        if str(dst).startswith(tree.path("/dev/char") + "/"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), dst)
        return real_symlink(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "symlink", read_only)
    links = tree.links()
    with caplog.at_level(logging.INFO, logger="agent.devchar"):
        started(links)  # does not raise
        links.sync()
        links.sync()
    problems = links.status()["problems"]
    assert problems == [f"cannot create 2 /dev/char links ({tree.char('195:0')} -> "
                        f"{tree.path('/dev/nvidia0')}, {tree.char('195:1')} -> "
                        f"{tree.path('/dev/nvidia1')}): Read-only file system"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == problems  # once, for three passes
    assert links.running and tree.entries() == {}

    # writable again: the next pass (here, a new node) makes them all and says so
    monkeypatch.setattr(os, "symlink", real_symlink)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agent.devchar"):  # until "resolved" is logged:
        # the watch thread says it after the links, and a busy machine let the level go first
        tree.node("/dev/nvidia2", 195, 2)
        assert wait_for(lambda: len(tree.entries()) == 3)
        assert wait_for(lambda: links.status()["problems"] == [])
    assert any(r.getMessage().startswith("resolved: cannot create 2 /dev/char links")
               for r in caplog.records)


def test_permission_denied_is_a_problem_too(tree, monkeypatch):
    host(tree, [("/dev/nvidia0", 195, 0)])

    def denied(src, dst, *args, **kwargs):
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), dst)

    monkeypatch.setattr(os, "symlink", denied)
    links = tree.links()
    assert links.sync() == []
    assert links.status()["problems"] == [
        f"cannot create 1 /dev/char links ({tree.char('195:0')} -> "
        f"{tree.path('/dev/nvidia0')}): Operation not permitted"]


# -- the watch ---------------------------------------------------------------------------------


def test_a_node_that_appears_later_gets_its_link_and_the_status_is_published(tree, started):
    host(tree, [("/dev/nvidiactl", 195, 255), ("/dev/nvidia0", 195, 0)])
    published = []
    # made before it starts: its watch thread may publish before started() returns
    links = tree.links(on_change=lambda: published.append(links.status()["created"]))
    started(links)
    assert set(tree.entries()) == {"195:255", "195:0"}
    assert wait_for(lambda: links.status()["watching"] == [tree.path("/dev")])
    assert wait_for(lambda: published == [2])  # the watch started: status() changed
    tree.node("/dev/nvidia1", 195, 1)
    tree.node("/dev/nvidia-uvm", 508, 0)
    assert wait_for(lambda: set(tree.entries()) == {"195:255", "195:0", "195:1", "508:0"})
    assert tree.entries()["195:1"] == tree.path("/dev/nvidia1")
    assert wait_for(lambda: links.status()["created"] == 4)
    assert wait_for(lambda: published[-1:] == [4])
    os.mkfifo(tree.path("/dev/not-nvidia"))  # nothing of ours: no pass, nothing published
    count = len(published)
    time.sleep(0.05)
    assert len(published) == count


def test_a_node_moved_in_gets_its_link(tree, started):
    host(tree, [("/dev/nvidia0", 195, 0)])
    links = started(tree.links())
    assert wait_for(lambda: links.status()["watching"] == [tree.path("/dev")])
    staged = tree.node("/dev/.staging-nvidia1", 195, 1)  # not an NVIDIA name: ignored
    tree.numbers[os.path.realpath(tree.path("/dev/nvidia1"))] = (195, 1)
    os.rename(staged, tree.path("/dev/nvidia1"))
    assert wait_for(lambda: "195:1" in tree.entries())


def test_nvidia_caps_appearing_later_is_watched_too(tree, started):
    host(tree, [("/dev/nvidia0", 195, 0)])
    links = started(tree.links())
    assert wait_for(lambda: links.status()["watching"] == [tree.path("/dev")])
    os.mkdir(tree.path("/dev/nvidia-caps"))
    assert wait_for(lambda: tree.path("/dev/nvidia-caps") in links.status()["watching"])
    tree.node("/dev/nvidia-caps/nvidia-cap1", 509, 1)
    assert wait_for(lambda: "509:1" in tree.entries())
    tree.node("/dev/nvidia-caps/nvidia-cap2", 509, 2)
    assert wait_for(lambda: "509:2" in tree.entries())
    assert tree.entries()["509:2"] == tree.path("/dev/nvidia-caps/nvidia-cap2")


def test_a_dev_that_appears_later_is_watched_once_there(tmp_path, mknod_works, started,
                                                        monkeypatch):
    monkeypatch.setattr(devchar, "RETRY_S", 0.05)
    tree = Tree(str(tmp_path / "root"), real=mknod_works, make_dev=False)
    links = started(tree.links())
    assert wait_for(lambda: any("cannot watch" in p for p in links.status()["problems"]))
    os.makedirs(tree.path("/dev/char"))
    tree.node("/dev/nvidia0", 195, 0)
    assert wait_for(lambda: os.path.islink(tree.char("195:0")))
    assert wait_for(lambda: links.status()["problems"] == [])


def test_stop_ends_the_thread_and_leaves_the_links(tree):
    host(tree, [("/dev/nvidia0", 195, 0)])
    links = tree.links()
    links.start()
    thread = links._thread
    assert thread is not None and thread.is_alive()
    links.stop()
    assert not thread.is_alive() and not links.running
    assert links.status()["watching"] == []
    assert tree.entries() == {"195:0": tree.path("/dev/nvidia0")}
    tree.node("/dev/nvidia1", 195, 1)  # no one watches now
    time.sleep(0.1)
    assert "195:1" not in tree.entries()
    links.stop()  # twice is fine


# -- the config --------------------------------------------------------------------------------


def test_the_option_is_on_by_default_and_from_config_follows_it():
    opt = OPTIONS_BY_NAME["dev_char_symlinks"]
    assert (opt.flag, opt.env, opt.key) == ("--dev-char-symlinks", "GPU_AGENT_DEV_CHAR_SYMLINKS",
                                           "agent.devCharSymlinks")
    assert opt.default is DEFAULT_DEV_CHAR_SYMLINKS is True
    on = SimpleNamespace(dev_char_symlinks=True, dev_root="/run/nvidia/driver")
    off = SimpleNamespace(dev_char_symlinks=False, dev_root="/run/nvidia/driver")
    links = devchar.from_config(on)
    assert links is not None and links.dev_char == "/run/nvidia/driver/dev/char"
    assert devchar.from_config(off) is None
    assert devchar.from_config(SimpleNamespace(dev_char_symlinks=True, dev_root="/")).dev_char \
        == "/dev/char"
    assert devchar.changed(on, off) and not devchar.changed(on, SimpleNamespace(**vars(on)))
    assert devchar.changed(on, SimpleNamespace(dev_char_symlinks=True, dev_root="/"))


# -- the daemon ---------------------------------------------------------------------------------


def test_the_agent_links_its_dev_root_nodes_and_those_that_appear(mknod_works):
    """`gpu-agent run` with the option on (the default): the links of the nodes under its dev
    root at start, then of a node created while it runs, in status.json; off: none."""
    from tests.daemon_harness import Node

    if not mknod_works:
        pytest.skip("character devices cannot be made here (not root): covered above by FIFOs")
    with Node() as node:
        tree = Tree(node.path("devroot"), real=True)
        host(tree, HOST_NODES[:4])
        agent = node.agent("--dev-root", tree.root)
        agent.wait_registered()
        doc = node.status_when(lambda d: d["devChar"] and d["devChar"]["linked"] == 4,
                               "4 /dev/char links")
        assert tree.entries() == {"195:0": tree.path("/dev/nvidia0"),
                                  "195:1": tree.path("/dev/nvidia1"),
                                  "195:254": tree.path("/dev/nvidia-modeset"),
                                  "195:255": tree.path("/dev/nvidiactl")}
        assert doc["devChar"]["problems"] == []
        tree.node("/dev/nvidia-uvm", 508, 0)  # the uvm module loaded later
        node.status_when(lambda d: d["devChar"]["linked"] == 5, "the new node's link")
        assert os.readlink(tree.char("508:0")) == tree.path("/dev/nvidia-uvm")
        assert agent.stop() == 0
        assert len(tree.entries()) == 5  # the links stay after the agent stops

        off = Tree(node.path("devroot-off"), real=True)
        host(off, HOST_NODES[:2])
        agent = node.agent("--dev-root", off.root, "--dev-char-symlinks=false")
        agent.wait_registered(2)
        node.status_when(lambda d: d["pid"] == agent.pid, "the second agent's status")
        assert off.entries() == {} and agent.stop() == 0
