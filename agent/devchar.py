"""The `/dev/char/<major>:<minor>` links of the NVIDIA device nodes: created where missing, at
start and whenever a node appears, so that GPU containers survive `systemctl daemon-reload`.

Why: with systemd managing the cgroups, runc hands systemd a container's device rules as
/dev/char/<major>:<minor> paths and drops those whose path does not stat (runc,
libcontainer/cgroups/devices/systemd.go); `systemctl daemon-reload` makes systemd re-apply
every scope's device policy from what it knows, so a GPU container loses its NVIDIA devices and
prints "Failed to initialize NVML: Unknown Error" (nvidia-container-toolkit issues #48, #251,
#1227). The driver's nodes made by nvidia-modprobe have no udev entry, so nothing else makes
their links.

What it does is what nvidia-container-toolkit's `nvidia-ctk system create-dev-char-symlinks`
does (NVIDIA/nvidia-container-toolkit, cmd/nvidia-ctk/system/create-dev-char-symlinks/,
create-dev-char-symlinks.go and existing.go, with internal/devices/devices.go's
AssertCharDevice; read at d34b304): the nodes are the character devices (lstat: a symlink to
one is not one) named `<root>/dev/nvidia*` and
`<root>/dev/nvidia-caps/nvidia-*`, except names starting `nvidia-fs`, `nvidia-nvswitch` or
`nvidia-nvlink`; so nvidiactl, nvidia<N>, nvidia-uvm, nvidia-uvm-tools, nvidia-modeset and the
MIG capability nodes. Each gets `<dev char>/<major>:<minor>` -> the node's absolute path under
the root (the toolkit links to the path it located, root included); the directory is made 0755
when missing and there are nodes; an existing entry makes symlink() fail and is left as it is.
Beyond the toolkit: we watch `<root>/dev` and `<root>/dev/nvidia-caps` with inotify for the
life of the agent (its `--watch`, since removed, re-ran on any nvidia* created in /dev), and we tell an
existing entry that works (it resolves to a character device with the node's numbers: udev's
relative `../nvidia0` and the toolkit's absolute link alike) from a foreign one, reported at
WARNING.

A simulated driver tree (agent.sim.driver_tree) has regular files where the nodes are and
records their numbers in `<root>/dev/.gpu-agent-sim-nodes.json` (SIM_RECORD): an entry that is
not a character device counts as a node with the recorded numbers (a real character device's
own numbers always win), so that on such a tree the agent and `gpu-agent doctor` (which lists
the nodes with `list_nodes`) see the same nodes.

Owns: `DevCharLinks` (one pass, the watch thread, its status), `list_nodes`, and `from_config`.
Must not replace, remove or change any existing entry, create device nodes, load modules, or
stop the agent: every error is logged once per change and shown in `status()`. Imports nothing
of `agent` but dirwatch (errors and constants would be allowed).
"""

from __future__ import annotations

import logging
import os
import select
import stat
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from agent.dirwatch import CREATED, DIR_GONE, MOVED_IN, DirWatch

log = logging.getLogger(__name__)

DEV = "dev"
DEV_CHAR = "char"
CAPS_DIR = "nvidia-caps"
NODE_PREFIX = "nvidia"
CAPS_NODE_PREFIX = "nvidia-"
# Not container devices (GPUDirect Storage, NVSwitch / NVLink management): the toolkit's
# nodeIsBlocked list, applied as it applies it.
SKIPPED_PREFIXES = ("nvidia-fs", "nvidia-nvswitch", "nvidia-nvlink")
# How often the thread looks again for a directory it cannot watch (seconds).
RETRY_S = 5.0
# What the watch of /dev and nvidia-caps wakes for: new names only. Not writes: every write to
# /dev/null by any process on the node is one, and it made an idle agent busy.
NEW_ENTRIES = frozenset((CREATED, MOVED_IN))
# The config options a running DevCharLinks is built from (a reload that changes one of them
# rebuilds it).
SETTINGS = ("dev_char_symlinks", "dev_root")

# Written by agent.sim.driver_tree in <root>/dev: {"version": 1, "nodes": {"/dev/nvidia0":
# [195, 0], ...}}, the numbers of the regular files standing in for the nodes.
SIM_RECORD = ".gpu-agent-sim-nodes.json"

Numbers = tuple[int, int]
NumberReader = Callable[[str], Optional[Numbers]]


def char_device_numbers(path: str) -> Numbers | None:
    """(major, minor) of the character device at `path` itself (not followed), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISCHR(st.st_mode):
        return None
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def is_node_name(name: str, in_caps: bool = False) -> bool:
    """Whether a name in /dev (or in /dev/nvidia-caps) may be an NVIDIA node to link."""
    prefix = CAPS_NODE_PREFIX if in_caps else NODE_PREFIX
    return name.startswith(prefix) and not name.startswith(SKIPPED_PREFIXES)


def recorded_numbers(dev_dir: str) -> dict[str, Numbers]:
    """{"/dev/nvidia0": (195, 0), ...} from a simulated tree's SIM_RECORD in `dev_dir`; {}
    when there is none (a real host) or it cannot be read."""
    import json

    try:
        with open(os.path.join(dev_dir, SIM_RECORD)) as f:
            nodes = json.load(f).get("nodes")
        return {name: (int(n[0]), int(n[1])) for name, n in nodes.items()}
    except (OSError, ValueError, AttributeError, TypeError, IndexError, KeyError):
        return {}


@dataclass(frozen=True)
class Node:
    """An NVIDIA device node and its numbers (what its /dev/char link is named after); major
    and minor None for an entry with a node's name that is no character device and has no
    recorded numbers (never linked)."""

    path: str  # absolute, under the root
    major: int | None
    minor: int | None
    name: str = ""  # as on the host: /dev/nvidia0
    recorded: bool = False  # the numbers are the simulated tree's record

    @property
    def char_name(self) -> str:
        return f"{self.major}:{self.minor}"


def list_nodes(dev_root: str, read_numbers: NumberReader = char_device_numbers) -> list[Node]:
    """The entries with an NVIDIA device node's name under `dev_root`/dev and /dev/nvidia-caps,
    /dev's first, each list by name, with their numbers (`read_numbers`, default lstat, then a
    simulated tree's record; None when neither has them)."""
    dev_dir = os.path.join(os.path.normpath(dev_root or "/"), DEV)
    record = recorded_numbers(dev_dir)
    found = []
    for directory, in_caps in ((dev_dir, False), (os.path.join(dev_dir, CAPS_DIR), True)):
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue  # no /dev (status says so through the watch) or no MIG caps
        for name in names:
            if not is_node_name(name, in_caps):
                continue
            path = os.path.join(directory, name)
            host = f"/{DEV}/{CAPS_DIR}/{name}" if in_caps else f"/{DEV}/{name}"
            numbers = read_numbers(path)
            if numbers is not None:
                found.append(Node(path, *numbers, name=host))
            elif host in record and os.path.lexists(path):
                found.append(Node(path, *record[host], name=host, recorded=True))
            elif not os.path.isdir(path):  # (/dev/nvidia-caps itself)
                found.append(Node(path, None, None, name=host))
    return found


def from_config(cfg: Any, on_change: Callable[[], None] | None = None) -> DevCharLinks | None:
    """The link manager the config asks for (`dev_char_symlinks`, `dev_root`); None when off.
    `on_change` is called from the watch thread after its status changed (to publish it)."""
    if not cfg.dev_char_symlinks:
        return None
    return DevCharLinks(cfg.dev_root or "/", on_change=on_change)


def changed(old: Any, new: Any) -> bool:
    """Whether a reload from config `old` to `new` must rebuild the link manager."""
    return any(getattr(old, name) != getattr(new, name) for name in SETTINGS)


class DevCharLinks:
    """The missing `/dev/char` links of the NVIDIA nodes under `dev_root`, made by `sync()`
    (one pass) and kept made by `start()` (a pass, then a thread on inotify) until `stop()`.
    `dev_char` is where the links go (default `<dev_root>/dev/char`); `read_numbers` gives a
    path's (major, minor) when it is a character device (default: lstat); `on_change()` is
    called from the watch thread, outside any lock, after `status()` changed."""

    def __init__(self, dev_root: str, *, dev_char: str | None = None,
                 read_numbers: NumberReader = char_device_numbers,
                 on_change: Callable[[], None] | None = None):
        self.dev_root = os.path.normpath(dev_root or "/")
        self.dev_dir = os.path.join(self.dev_root, DEV)
        self.caps_dir = os.path.join(self.dev_dir, CAPS_DIR)
        self.dev_char = os.path.normpath(dev_char or os.path.join(self.dev_dir, DEV_CHAR))
        self._read_numbers = read_numbers
        self._on_change = on_change
        self._lock = threading.Lock()
        self._changes = 0  # bumped by every change status() shows
        self._nodes = 0
        self._linked = 0
        self._created = 0
        self._foreign: dict[str, str] = {}  # link -> what it is instead
        self._problems: dict[str, str] = {}  # key -> message (the pass's)
        self._watch_problems: dict[str, str] = {}  # directory -> message (the thread's)
        self._watching: list[str] = []
        self._stop_r = self._stop_w = -1
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"DevCharLinks({self.dev_root!r})"

    # -- the daemon's side --------------------------------------------------------------------

    def start(self) -> None:
        """One pass now (in the caller's thread), then the watch thread. Never raises."""
        if self._thread is not None:
            return
        self.sync()
        with self._lock:
            log.info("%d NVIDIA device nodes under %s, %d with a link in %s (%d created); "
                     "watching for new ones", self._nodes, self.dev_dir, self._linked,
                     self.dev_char, self._created)
        self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="dev-char", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watch thread (it closes its watches). Links stay: they are the host's."""
        if self._thread is None:
            return
        try:
            os.write(self._stop_w, b"x")
        except OSError:
            pass  # the pipe is full: the thread wakes anyway
        self._thread.join(RETRY_S + 5.0)
        if self._thread.is_alive():  # its pipe stays open: closing it under select() is worse
            log.error("the /dev/char watch thread did not stop")
            self._thread = None
            return
        self._thread = None
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
        self._stop_r = self._stop_w = -1

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def status(self) -> dict:
        """For status.json: where the links go, how many nodes and links the last pass saw,
        how many this agent created, entries left alone, problems, what is watched."""
        with self._lock:
            return {
                "dir": self.dev_char,
                "nodes": self._nodes,
                "linked": self._linked,
                "created": self._created,
                "foreign": dict(sorted(self._foreign.items())),
                "problems": list(self._problems.values()) + list(self._watch_problems.values()),
                "watching": list(self._watching),
            }

    # -- one pass -----------------------------------------------------------------------------

    def nodes(self) -> list[Node]:
        """The NVIDIA device nodes under the root now (list_nodes), those with numbers."""
        return [n for n in list_nodes(self.dev_root, self._read_numbers) if n.major is not None]

    def sync(self) -> list[str]:
        """Create the links that are missing; the links created. Errors are reported (log,
        status), not raised."""
        with self._lock:
            return self._sync()

    def _sync(self) -> list[str]:
        nodes = self.nodes()
        created: list[str] = []
        foreign: dict[str, str] = {}  # link -> what it is instead
        failed: dict[str, list[str]] = {}  # error -> "link -> target"
        problems: dict[str, str] = {}
        linked = 0
        dir_problem = self._make_dir() if nodes and not os.path.isdir(self.dev_char) else ""
        if dir_problem:
            problems["dir"] = dir_problem
            nodes_to_link = []
        else:
            nodes_to_link = nodes
        for node in nodes_to_link:
            link = os.path.join(self.dev_char, node.char_name)
            try:
                os.symlink(node.path, link)  # never over an entry: EEXIST leaves it as it is
            except FileExistsError:
                what = self._foreign_entry(link, node)
                if what:
                    foreign[link] = what
                else:
                    linked += 1
                continue
            except OSError as exc:
                failed.setdefault(exc.strerror or str(exc), []).append(f"{link} -> {node.path}")
                continue
            log.info("created %s -> %s", link, node.path)
            created.append(link)
            linked += 1
        for error, links in failed.items():
            more = f" and {len(links) - 3} more" if len(links) > 3 else ""
            problems[f"create: {error}"] = (f"cannot create {len(links)} /dev/char links "
                                            f"({', '.join(links[:3])}{more}): {error}")
        if created or (self._nodes, self._linked) != (len(nodes), linked):
            self._changes += 1
        self._nodes, self._linked = len(nodes), linked
        self._created += len(created)
        self._changes += _report(self._foreign, foreign, _foreign_left, _foreign_gone)
        self._changes += _report(self._problems, problems, _message, _resolved)
        return created

    def _make_dir(self) -> str:
        try:
            os.mkdir(self.dev_char, 0o755)
            os.chmod(self.dev_char, 0o755)  # whatever the umask (the unit's is 0077)
        except FileExistsError:
            if not os.path.isdir(self.dev_char):
                return f"{self.dev_char} exists and is not a directory; no links made"
        except OSError as exc:
            return f"cannot create {self.dev_char}: {exc.strerror or exc}; no links made"
        log.info("created %s", self.dev_char)
        return ""

    def _foreign_entry(self, link: str, node: Node) -> str:
        """"" when the entry at `link` gives systemd the node's device, else what it is."""
        try:
            target = os.readlink(link)
        except OSError:
            target = None
        try:
            resolved = os.path.realpath(link)
        except OSError:
            resolved = ""
        if resolved and (self._read_numbers(resolved) == (node.major, node.minor)
                         or (node.recorded and resolved == os.path.realpath(node.path))):
            return ""
        if target is None:
            return f"is not a link (want -> {node.path})"
        return f"points to {target} (want -> {node.path})"

    # -- the watch thread ---------------------------------------------------------------------

    def _run(self) -> None:
        watches: dict[str, DirWatch] = {}
        try:
            while True:
                try:
                    if self._step(watches):
                        return
                except Exception:  # the loop boundary: a dead watch would miss every new node
                    log.exception("/dev/char watch: unexpected error; going on in %g s", RETRY_S)
                    if select.select([self._stop_r], [], [], RETRY_S)[0]:
                        return
        finally:
            for watch in watches.values():
                watch.close()
            with self._lock:
                self._watching = []

    def _step(self, watches: dict[str, DirWatch]) -> bool:
        """Watch what is there, wait, act; True when asked to stop."""
        changes = self._changes
        if self._ensure_watches(watches):
            self.sync()  # a directory (re)watched: what appeared before the watch counts
        changes = self._published(changes)
        fds = [self._stop_r] + [w.fileno() for w in watches.values()]
        unwatched = self.dev_dir not in watches or \
            (self.caps_dir not in watches and os.path.isdir(self.caps_dir))
        timeout = RETRY_S if unwatched else None  # None: an idle agent stays idle
        ready, _, _ = select.select(fds, [], [], timeout)
        if self._stop_r in ready:
            return True
        again = False
        for directory, watch in list(watches.items()):
            if watch.fileno() not in ready:
                continue
            for event in watch.read():
                log.debug("%s: %s %s", directory, event.kind, event.name)
                if event.kind == DIR_GONE:
                    watch.close()
                    del watches[directory]
                    again = True
                    break
                if event.kind in (CREATED, MOVED_IN) and \
                        is_node_name(event.name, directory == self.caps_dir):
                    again = True  # a node, or nvidia-caps itself (watched next step)
        if again:
            self.sync()
        self._published(changes)
        return False

    def _published(self, changes: int) -> int:
        """Call on_change if status() changed since `changes`; the count now."""
        now = self._changes
        if now != changes and self._on_change is not None:
            self._on_change()
        return now

    def _ensure_watches(self, watches: dict[str, DirWatch]) -> bool:
        """Watch /dev, and nvidia-caps when it exists; True when a watch was added."""
        added = False
        problems: dict[str, str] = {}
        for directory in (self.dev_dir, self.caps_dir):
            if directory in watches:
                continue
            if directory == self.caps_dir and (self.dev_dir not in watches
                                               or not os.path.isdir(directory)):
                continue
            try:
                watches[directory] = DirWatch(directory, NEW_ENTRIES)
            except OSError as exc:
                problems[directory] = (f"cannot watch {directory} for new NVIDIA device nodes "
                                       f"({exc}); looking again every {RETRY_S:g} s")
                continue
            added = True
        with self._lock:
            if self._watching != sorted(watches):
                self._watching = sorted(watches)
                self._changes += 1
            self._changes += _report(self._watch_problems, problems, _message, _resolved)
        return added


def _foreign_left(link: str, what: str) -> str:
    return (f"left alone: {link} {what}: runc names that device to systemd by this path, so "
            f"after `systemctl daemon-reload` containers may lose it")


def _foreign_gone(link: str, what: str) -> str:
    return f"{link} needs no attention any more (it {what})"


def _message(key: str, message: str) -> str:
    return message


def _resolved(key: str, message: str) -> str:
    return f"resolved: {message}"


def _report(old: dict[str, str], new: dict[str, str], warning: Callable[[str, str], str],
            gone: Callable[[str, str], str]) -> bool:
    """Log what changed from state `old` to `new` ({key: text}): a new or changed entry at
    WARNING, one that went away at INFO; `old` becomes `new`. So each state logs once.
    Whether anything changed."""
    if old == new:
        return False
    for key, text in new.items():
        if old.get(key) != text:
            log.warning("%s", warning(key, text))
    for key in old.keys() - new.keys():
        log.info("%s", gone(key, old[key]))
    old.clear()
    old.update(new)
    return True
