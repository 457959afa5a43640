"""Imported at start by a Python that has tests/inject on its PYTHONPATH (an agent started by
a test that asks for it): with THREAD_DEATH_FILE set, a thread named "doomed" ends by an
exception once that file exists, as a thread of the agent that meets a bug would. Nothing of the
agent is replaced. Must not do anything when the variable is not set.
"""

import os
import threading
import time

_TRIGGER = os.environ.get("THREAD_DEATH_FILE")


def _die_when_asked() -> None:
    while not os.path.exists(_TRIGGER):
        time.sleep(0.05)
    raise RuntimeError("injected by the test")


if _TRIGGER:
    threading.Thread(target=_die_when_asked, name="doomed", daemon=True).start()
