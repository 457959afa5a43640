"""What an NVML event means for the devices: XID classes, NVIDIA's health-check switches, and
the recovery rule each class gets.

Owns: the XID → action table (defaults from NVIDIA's XID catalog, overridable with
`agent.health.xidActions`), NVIDIA k8s-device-plugin's `DP_DISABLE_HEALTHCHECKS` /
`DP_ENABLE_HEALTHCHECKS` semantics reproduced as its internal/rm/health.go implements them
(quirks included, see docs/health.md), and the resulting `XidPolicy` (which XIDs the C filter
drops, which withdraw a device and how it may come back). Must not call NVML, hold state or touch devices: the monitor applies what this says.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from agent._fast._types import EVENT_DOUBLE_BIT_ECC, EVENT_XID_CRITICAL, XID_FILTER_SIZE
from agent.constants import XID_ACTIONS
from agent.constants import XID_APPLICATION as APPLICATION
from agent.constants import XID_IGNORE as IGNORE
from agent.constants import XID_REBOOT as REBOOT
from agent.constants import XID_RESET as RESET

log = logging.getLogger(__name__)

# The action classes (agent.constants.XID_ACTIONS, from NVIDIA's XID catalog "immediate action"
# buckets) under short names; these two withdraw the GPU.
WITHDRAWING = (RESET, REBOOT)
ACTION_TEXT = {
    IGNORE: "ignored",
    APPLICATION: "application error, the GPU stays in service",
    RESET: "GPU reset required",
    REBOOT: "node reboot required",
}

# XID 154 says the driver's GPU recovery action changed; these actions need the node rebooted
# (NVML_GPU_RECOVERY_ACTION_NODE_REBOOT, _SYSTEM_REBOOT), the others a reset or less.
XID_RECOVERY_ACTION_CHANGED = 154
REBOOT_RECOVERY_ACTIONS = frozenset((2, 7))

# NVIDIA's device plugin ignores these ("application errors: the GPU should still be healthy").
NVIDIA_IGNORED = (13, 31, 43, 45, 68, 109)

# XID -> (action, what the catalog calls it). NVIDIA's six ignored XIDs are application errors;
# every other XID withdraws the GPU, as in NVIDIA's plugin; this table only says how it may
# come back. An XID not listed is reset-class (UNLISTED_ACTION).
DEFAULT_XID_ACTIONS: Mapping[int, tuple[str, str]] = MappingProxyType({
    13: (APPLICATION, "graphics engine exception"),
    31: (APPLICATION, "GPU memory page fault"),
    43: (APPLICATION, "GPU stopped processing"),
    45: (APPLICATION, "preemptive cleanup, due to previous errors"),
    68: (APPLICATION, "video processor exception"),
    109: (APPLICATION, "context switch timeout"),
    48: (RESET, "double-bit ECC error"),
    61: (RESET, "internal micro-controller breakpoint/warning"),
    62: (RESET, "internal micro-controller halt"),
    63: (RESET, "ECC page retirement or row remapping recorded"),
    64: (RESET, "ECC page retirement or row remapper failure"),
    74: (RESET, "NVLink error"),
    79: (REBOOT, "GPU has fallen off the bus"),
    92: (RESET, "high single-bit ECC error rate"),
    94: (RESET, "contained ECC error"),
    95: (RESET, "uncontained ECC error"),
    119: (RESET, "GSP RPC timeout"),
    120: (RESET, "GSP error"),
    140: (RESET, "unrecovered ECC error"),
    154: (REBOOT, "GPU recovery action changed"),
})
UNLISTED_ACTION = RESET

# NVIDIA's key for "all XIDs" in its disabled-XID map (so "0" in the variable means all too).
ALL_XIDS = 0
ENV_DISABLE = "DP_DISABLE_HEALTHCHECKS"
ENV_ENABLE = "DP_ENABLE_HEALTHCHECKS"


def parse_xid_list(text: str, variable: str) -> dict[int, bool]:
    """NVIDIA's newHealthCheckXIDs: lower-cased, split on commas, blanks skipped; `all` or
    `xids` anywhere means every XID ({0: True}); other entries are unsigned decimal XIDs, and a
    malformed one is skipped with a warning naming `variable` (NVIDIA only logs it too)."""
    out: dict[int, bool] = {}
    for raw in (text or "").lower().split(","):
        item = raw.strip()
        if item in ("all", "xids"):
            return {ALL_XIDS: True}
        if not item:
            continue
        if not item.isdigit() or not item.isascii():
            log.warning("%s: ignoring malformed XID %r (not an unsigned decimal number), as "
                        "NVIDIA's device plugin does", variable, item)
            continue
        out[int(item)] = True
    return out


def nvidia_disabled_xids(disable: str, enable: str) -> dict[int, bool]:
    """NVIDIA's getDisabledHealthCheckXids: the disabled list, plus its six ignored XIDs,
    then every enabled XID set to False (`all` enabled: key 0 False)."""
    disabled = parse_xid_list(disable, ENV_DISABLE)
    enabled = parse_xid_list(enable, ENV_ENABLE)
    for xid in NVIDIA_IGNORED:
        disabled[xid] = True
    for xid in enabled:
        disabled[xid] = False
    return disabled


def nvidia_all_disabled(disabled: Mapping[int, bool]) -> bool:
    """NVIDIA's IsAllDisabled: health checking is off altogether."""
    return disabled.get(ALL_XIDS, False)


def nvidia_is_disabled(disabled: Mapping[int, bool], xid: int) -> bool:
    """NVIDIA's IsDisabled: is an XID ignored."""
    if disabled.get(ALL_XIDS) is False:
        return False
    if xid in disabled:
        return disabled[xid]
    return nvidia_all_disabled(disabled)


class XidPolicy:
    """The effective policy. `enabled` False: health checks are off (no event loop). Never
    changed once made; equal when its four settings are."""

    __slots__ = ("enabled", "disable", "enable", "overrides", "_filtered_xids")

    def __init__(self, enabled: bool = True, disable: str = "", enable: str = "",
                 overrides: Mapping[int, str] = MappingProxyType({})):
        self.enabled = enabled
        self.disable = disable
        self.enable = enable
        self.overrides = overrides
        self._filtered_xids: tuple[int, ...] | None = None

    def _key(self) -> tuple:
        return self.enabled, self.disable, self.enable, dict(self.overrides)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, XidPolicy) and self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # holds a mapping

    def __repr__(self) -> str:
        return (f"XidPolicy(enabled={self.enabled!r}, disable={self.disable!r}, "
                f"enable={self.enable!r}, overrides={dict(self.overrides)!r})")

    @classmethod
    def build(cls, disable: str = "", enable: str = "",
              overrides: Iterable[tuple[int, str]] | Mapping[int, str] = ()) -> XidPolicy:
        pairs = overrides.items() if isinstance(overrides, Mapping) else overrides
        table = {}
        for xid, action in pairs:
            if action not in XID_ACTIONS:
                raise ValueError(f"XID {xid}: unknown action {action!r}; use one of "
                                 f"{', '.join(XID_ACTIONS)}")
            table[int(xid)] = action
        on = not nvidia_all_disabled(nvidia_disabled_xids(disable, enable))
        return cls(on, disable or "", enable or "", MappingProxyType(table))

    def _nvidia(self) -> tuple[dict[int, bool], dict[int, bool]]:
        return (parse_xid_list(self.disable, ENV_DISABLE), parse_xid_list(self.enable, ENV_ENABLE))

    def base_action(self, xid: int) -> str:
        """The class before DP_DISABLE/ENABLE_HEALTHCHECKS: config, else catalog, else reset."""
        if xid in self.overrides:
            return self.overrides[xid]
        return DEFAULT_XID_ACTIONS.get(xid, (UNLISTED_ACTION, ""))[0]

    def action(self, xid: int) -> str:
        """What XID `xid` does. DP_ENABLE_HEALTHCHECKS forces it to withdraw (an ignore- or
        application-class XID becomes reset-class), DP_DISABLE_HEALTHCHECKS forces it to be
        ignored, in NVIDIA's order (enabled beats disabled)."""
        return self._action(xid, *self._nvidia())

    def _action(self, xid: int, disabled: dict[int, bool], enabled: dict[int, bool]) -> str:
        base = self.base_action(xid)
        if enabled.get(xid) or enabled.get(ALL_XIDS):
            return base if base in WITHDRAWING else RESET
        if disabled.get(xid) or disabled.get(ALL_XIDS):
            return IGNORE
        return base

    def describe(self, xid: int) -> str:
        """The catalog's name of an XID ("" when it has none)."""
        return DEFAULT_XID_ACTIONS.get(xid, ("", ""))[1]

    def filtered_xids(self) -> tuple[int, ...]:
        """The XIDs (0..1023) that withdraw nothing: dropped by the C filter."""
        if self._filtered_xids is None:  # the policy never changes: worked out once
            self._filtered_xids = self._filtered()
        return self._filtered_xids

    def _filtered(self) -> tuple[int, ...]:
        if not self.enabled:
            return ()
        disabled, enabled = self._nvidia()
        if enabled.get(ALL_XIDS):
            return ()
        return tuple(x for x in range(XID_FILTER_SIZE)
                     if self._action(x, disabled, enabled) not in WITHDRAWING)

    def event_action(self, event_type: int, xid: int,
                     recovery_action: int | None = None) -> tuple[str, str]:
        """(action, reason) for an event the filter let through. For XID 154 (the driver's
        recovery action changed), `recovery_action` is the action the driver reports now
        (NVML_GPU_RECOVERY_ACTION_*; None: not offered or not read): a withdrawing XID 154 is
        reboot-class when the driver asks for a reboot, reset-class otherwise (the recovery
        probe then keeps the GPU out until the action is back to none)."""
        if event_type == EVENT_XID_CRITICAL and xid == XID_RECOVERY_ACTION_CHANGED and \
                recovery_action is not None and self.action(xid) in WITHDRAWING:
            action = REBOOT if recovery_action in REBOOT_RECOVERY_ACTIONS else RESET
            return action, (f"XID {xid} ({self.describe(xid) or 'GPU recovery action changed'}"
                            f", now {recovery_action}): {ACTION_TEXT[action]}")
        if event_type == EVENT_XID_CRITICAL:
            action = self.action(xid)
            name = self.describe(xid)
            return action, f"XID {xid}" + (f" ({name})" if name else "") + f": {ACTION_TEXT[action]}"
        if event_type == EVENT_DOUBLE_BIT_ECC:
            return RESET, f"double-bit ECC error event: {ACTION_TEXT[RESET]}"
        return IGNORE, f"event type {event_type:#x}: not a health event"

    def summary(self) -> str:
        """One line for the log and status."""
        if not self.enabled:
            return (f"health checks disabled ({ENV_DISABLE}={self.disable!r}"
                    + (f", {ENV_ENABLE}={self.enable!r}" if self.enable else "") + ")")
        filtered = self.filtered_xids()
        parts = [f"{len(filtered)} XIDs below {XID_FILTER_SIZE} ignored in the event filter"]
        if len(filtered) <= 16:
            parts[0] += f" ({', '.join(map(str, filtered)) or 'none'})"
        if self.disable:
            parts.append(f"{ENV_DISABLE}={self.disable!r}")
        if self.enable:
            parts.append(f"{ENV_ENABLE}={self.enable!r}")
        if self.overrides:
            parts.append("xidActions " + ", ".join(f"{x}={a}" for x, a in
                                                   sorted(self.overrides.items())))
        return "; ".join(parts)

