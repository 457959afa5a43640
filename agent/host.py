"""Facts about the host the agent runs on that outlive the agent: today, the boot ID.

Owns: reading the kernel's boot ID (a random UUID the kernel draws at every boot), which the
health module uses to tell that a reboot-class error has been cleared and the state module
uses to tell a checkpoint written before the last reboot. `GPU_AGENT_BOOT_ID_FILE` points it
at another file (tests, or a host whose /proc is elsewhere). Must not import anything of
`agent` but errors.
"""

from __future__ import annotations

import os
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
