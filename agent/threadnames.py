"""The agent's threads under their own names in the kernel, so that `top -H`, `ps -L`,
`pidstat -t` and /proc/PID/task/TID/comm tell them apart (Python before 3.14 leaves every
thread it starts named as the process: "python").

Owns: `install()`, which gives each running thread its Python name as its kernel name (cut to
the kernel's 15 bytes) and has every thread started later do the same as it begins, through
threading.setprofile with a hook that removes itself at once: nothing stays on any thread's
calls. A name Python made up, "Thread-3 (_serve)" (or "Thread-3" before Python 3.10), is
written as the function it runs, "_serve". The main thread keeps the process's name. Must not import anything of `agent`.
"""

from __future__ import annotations

import re
import sys
import threading
from typing import Any

COMM_BYTES = 15  # TASK_COMM_LEN less its NUL
_MADE_UP = re.compile(r"Thread-\d+( \((?P<target>.+)\))?")


def install() -> None:
    """Name the threads running now, and every thread started from now on."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            _name(thread)
    threading.setprofile(_first_call)


def kernel_name(name: str, target: str = "") -> str:
    """What thread name `name` (running function `target`) becomes in /proc/PID/task/TID/comm."""
    made_up = _MADE_UP.fullmatch(name)
    text = (made_up["target"] or target or name) if made_up else name
    return text.encode(errors="replace")[:COMM_BYTES].decode(errors="ignore")


def _first_call(frame: Any, event: str, arg: Any) -> None:
    """The new thread's first profile event: name it, and profile nothing more."""
    sys.setprofile(None)
    _name(threading.current_thread())


def _name(thread: threading.Thread) -> None:
    if thread.native_id is None:
        return
    try:
        with open(f"/proc/self/task/{thread.native_id}/comm", "w") as f:
            f.write(kernel_name(thread.name, getattr(getattr(thread, "_target", None),
                                                     "__name__", "")))
    except OSError:
        pass  # not Linux, or the thread is gone: the name is for people, nothing depends on it
