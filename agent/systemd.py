"""systemd's notify protocol (sd_notify) for a `Type=notify` service, without libsystemd.

Owns: reading NOTIFY_SOCKET (a path, or `@name` for an abstract socket), WATCHDOG_USEC and
WATCHDOG_PID, and sending `KEY=VALUE` datagrams (READY=1, RELOADING=1 with MONOTONIC_USEC,
STOPPING=1, STATUS=..., WATCHDOG=1). A module of its own, beside `daemon`, because it is a
protocol with no knowledge of the agent: it imports nothing of `agent` and decides nothing
(the daemon says when to send what). Sending never raises: a service must not fail because
the manager went away; the first failure is logged once.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)


def _address(raw: str) -> str | None:
    if not raw:
        return None
    if raw.startswith("@"):
        return "\0" + raw[1:]  # abstract namespace
    if raw.startswith("/"):
        return raw
    return None  # vsock: and other forms are not for a host service


class Notifier:
    """Talks to the service manager named by `environ` (default os.environ); a no-op when
    NOTIFY_SOCKET is unset, so the daemon calls it unconditionally."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.address = _address(env.get("NOTIFY_SOCKET", ""))
        self._sock: socket.socket | None = None
        self._failed = False
        self.watchdog_usec = 0
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_usec = int(usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings (half the manager's timeout), or None."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def send(self, *fields: str) -> bool:
        """Send one datagram of `KEY=VALUE` lines; True when it went out."""
        if self.address is None or not fields:
            return False
        message = "\n".join(fields).encode("utf-8", "replace")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message, self.address)
        except OSError as exc:
            if not self._failed:
                log.warning("cannot notify the service manager at %s: %s",
                            self.address.replace("\0", "@"), exc)
                self._failed = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def reloading(self) -> bool:
        return self.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={' '.join(text.split())}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
