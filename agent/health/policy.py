"""What an NVML event means for the devices: XID classes, NVIDIA's health-check switches, and
the recovery rule each class gets.

Owns: the two default XID → action tables (`agent.health.xidPolicy`: `nvidia`, NVIDIA's
device plugin's choice of what withdraws a GPU with the catalog's classes for how it returns;
`catalog`, the XID catalog's immediate action for each XID), overridable per XID with
`agent.health.xidActions`, NVIDIA k8s-device-plugin's `DP_DISABLE_HEALTHCHECKS` /
`DP_ENABLE_HEALTHCHECKS` semantics reproduced as its internal/rm/health.go implements them
(quirks included, see docs/health.md), and the resulting `XidPolicy` (which XIDs the C filter
drops, which withdraw a device and how it may come back). Must not call NVML, hold state or touch devices: the monitor applies what this says.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from agent._fast._types import EVENT_DOUBLE_BIT_ECC, EVENT_XID_CRITICAL, XID_FILTER_SIZE
from agent.constants import XID_ACTIONS, XID_POLICY_CATALOG, XID_POLICY_NVIDIA
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

# xidPolicy nvidia, the default: XID -> (action, what the catalog calls it). NVIDIA's six
# ignored XIDs are application errors; every other XID withdraws the GPU, as in NVIDIA's
# plugin; this table only says how it may come back. An XID not listed is reset-class
# (UNLISTED_ACTION).
NVIDIA_XID_ACTIONS: Mapping[int, tuple[str, str]] = MappingProxyType({
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

# xidPolicy catalog: NVIDIA's XID catalog's "Resolution Bucket (Immediate Action)" for each XID
# 1..161 (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html; 162 and later have
# none yet), as (first, last) XID ranges per bucket, and the class each bucket gets here. XID
# 154 ("follow XID 154 reported guidance") is reset-class: the driver's recovery action read on
# the event decides (event_action), and the recovery probe keeps the GPU out until the action
# is back to none. CONTACT_SUPPORT (unused XIDs, and 142) withdraws the GPU, as an XID the
# catalog does not list does.
CATALOG_BUCKETS: Mapping[str, tuple[tuple[int, int], ...]] = MappingProxyType({
    "IGNORE": ((14, 14), (37, 38), (43, 44), (63, 63), (66, 67), (92, 93), (106, 108),
               (121, 121), (137, 137), (141, 141), (152, 153), (157, 157), (160, 161)),
    "RESTART_APP": ((8, 8), (11, 11), (13, 13), (25, 25), (31, 32), (39, 41), (60, 60),
                    (68, 72), (75, 77), (80, 80), (82, 86), (88, 89), (94, 94), (96, 105),
                    (126, 135), (139, 139)),
    "WORKFLOW_XID_45": ((45, 45),),  # preemptive cleanup: the XID before it is what counts
    "UPDATE_SWFW": ((78, 78),),  # vGPU start error: software, not the GPU
    "CHECK_UVM": ((159, 159),),
    "RESET_GPU": ((46, 46), (62, 62), (64, 64), (95, 95), (109, 110), (119, 120), (136, 136),
                  (140, 140), (143, 143), (155, 156), (158, 158)),
    "WORKFLOW_XID_48": ((48, 48),),  # double-bit ECC: a reset applies the row remap
    "WORKFLOW_NVLINK_ERR": ((74, 74),),
    "WORKFLOW_NVLINK5_ERR": ((144, 150),),
    "CHECK_MECHANICALS": ((54, 54),),
    "XID_154": ((154, 154),),
    "CONTACT_SUPPORT": ((1, 7), (9, 10), (12, 12), (15, 24), (26, 30), (33, 36), (42, 42),
                        (47, 47), (49, 53), (55, 59), (61, 61), (65, 65), (73, 73), (81, 81),
                        (87, 87), (90, 91), (111, 118), (122, 125), (138, 138), (142, 142)),
    "RESTART_BM": ((79, 79),),
    "RESTART_VM": ((151, 151),),  # the VM is the node here
})
CATALOG_CLASSES: Mapping[str, str] = MappingProxyType({
    "IGNORE": IGNORE, "RESTART_APP": APPLICATION, "WORKFLOW_XID_45": APPLICATION,
    "UPDATE_SWFW": APPLICATION, "CHECK_UVM": APPLICATION, "RESET_GPU": RESET,
    "WORKFLOW_XID_48": RESET, "WORKFLOW_NVLINK_ERR": RESET, "WORKFLOW_NVLINK5_ERR": RESET,
    "CHECK_MECHANICALS": RESET, "XID_154": RESET, "CONTACT_SUPPORT": RESET,
    "RESTART_BM": REBOOT, "RESTART_VM": REBOOT,
})
# XID -> (action, "catalog: BUCKET").
CATALOG_XID_ACTIONS: Mapping[int, tuple[str, str]] = MappingProxyType({
    xid: (CATALOG_CLASSES[bucket], f"catalog: {bucket}")
    for bucket, spans in CATALOG_BUCKETS.items()
    for first, last in spans for xid in range(first, last + 1)})
TABLES = {XID_POLICY_NVIDIA: NVIDIA_XID_ACTIONS, XID_POLICY_CATALOG: CATALOG_XID_ACTIONS}

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

    __slots__ = ("enabled", "disable", "enable", "overrides", "table", "_filtered_xids")

    def __init__(self, enabled: bool = True, disable: str = "", enable: str = "",
                 overrides: Mapping[int, str] = MappingProxyType({}),
                 table: str = XID_POLICY_NVIDIA):
        self.enabled = enabled
        self.disable = disable
        self.enable = enable
        self.overrides = overrides
        self.table = table  # the name of the default table: a key of TABLES
        self._filtered_xids: tuple[int, ...] | None = None

    def _key(self) -> tuple:
        return self.enabled, self.disable, self.enable, dict(self.overrides), self.table

    def __eq__(self, other: object) -> bool:
        return isinstance(other, XidPolicy) and self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # holds a mapping

    def __repr__(self) -> str:
        return (f"XidPolicy(enabled={self.enabled!r}, disable={self.disable!r}, "
                f"enable={self.enable!r}, overrides={dict(self.overrides)!r}, "
                f"table={self.table!r})")

    @classmethod
    def build(cls, disable: str = "", enable: str = "",
              overrides: Iterable[tuple[int, str]] | Mapping[int, str] = (),
              table: str = XID_POLICY_NVIDIA) -> XidPolicy:
        if table not in TABLES:
            raise ValueError(f"unknown XID table {table!r}; use one of {', '.join(TABLES)}")
        pairs = overrides.items() if isinstance(overrides, Mapping) else overrides
        actions = {}
        for xid, action in pairs:
            if action not in XID_ACTIONS:
                raise ValueError(f"XID {xid}: unknown action {action!r}; use one of "
                                 f"{', '.join(XID_ACTIONS)}")
            actions[int(xid)] = action
        on = not nvidia_all_disabled(nvidia_disabled_xids(disable, enable))
        return cls(on, disable or "", enable or "", MappingProxyType(actions), table)

    def _nvidia(self) -> tuple[dict[int, bool], dict[int, bool]]:
        return (parse_xid_list(self.disable, ENV_DISABLE), parse_xid_list(self.enable, ENV_ENABLE))

    def base_action(self, xid: int) -> str:
        """The class before DP_DISABLE/ENABLE_HEALTHCHECKS: xidActions, else the default table,
        else reset."""
        if xid in self.overrides:
            return self.overrides[xid]
        return TABLES[self.table].get(xid, (UNLISTED_ACTION, ""))[0]

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
        """What an XID is ("" when the tables do not say): its name, and under the catalog
        table its immediate-action bucket."""
        name = NVIDIA_XID_ACTIONS.get(xid, ("", ""))[1]
        if self.table == XID_POLICY_NVIDIA:
            return name
        bucket = CATALOG_XID_ACTIONS.get(xid, ("", ""))[1]
        return ", ".join(part for part in (name, bucket) if part)

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
        parts = [f"{self.table} XID table",
                 f"{len(filtered)} XIDs below {XID_FILTER_SIZE} ignored in the event filter"]
        if len(filtered) <= 16:
            parts[1] += f" ({', '.join(map(str, filtered)) or 'none'})"
        if self.disable:
            parts.append(f"{ENV_DISABLE}={self.disable!r}")
        if self.enable:
            parts.append(f"{ENV_ENABLE}={self.enable!r}")
        if self.overrides:
            parts.append("xidActions " + ", ".join(f"{x}={a}" for x, a in
                                                   sorted(self.overrides.items())))
        return "; ".join(parts)

