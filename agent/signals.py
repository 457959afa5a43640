"""The main loop's way of waiting: for a signal, for another thread's wake-up, or a timeout.

Owns: turning SIGTERM, SIGINT and SIGHUP into numbers read from a pipe (signal.set_wakeup_fd:
the handlers do nothing, so no Python code runs inside a signal), the wake pipe any thread may
write to (`wake()`, safe after `close()`), and `wait(timeout)`, which returns the signals that
arrived. Must not decide what a signal means: the daemon does.
"""

from __future__ import annotations

import os
import selectors
import signal
import threading

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Waiter:
    """Install with `Waiter()` (in the main thread), then `wait()`; `close()` at the end."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._sig_r, self._sig_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()
        signal.set_wakeup_fd(self._sig_w, warn_on_full_buffer=False)
        for signum in HANDLED:
            signal.signal(signum, lambda s, f: None)  # the wakeup fd carries the number
        self._selector.register(self._sig_r, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)

    def wait(self, timeout: float) -> list[int]:
        """Sleep until a signal, a wake() or `timeout` s; the signals that arrived, in order."""
        signals: list[int] = []
        for key, _ in self._selector.select(timeout):
            data = drain(key.fd)
            if key.fd == self._sig_r:
                signals += list(data)
        return signals

    def wake(self) -> None:
        """From any thread: end the current (or the next) wait."""
        with self._lock:
            if self._wake_w < 0:
                return  # closed: nobody waits any more
            try:
                os.write(self._wake_w, b"w")
            except BlockingIOError:
                pass  # the pipe is full: the loop is awake anyway

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        with self._lock:
            for fd in (self._sig_r, self._sig_w, self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_w = -1
        self._selector.close()


def drain(fd: int) -> bytes:
    """What a non-blocking pipe holds now (up to 4 KiB), without blocking."""
    try:
        return os.read(fd, 4096)  # more waiting: select() reports the pipe again
    except BlockingIOError:
        return b""
