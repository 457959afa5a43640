"""Value kinds of gpu-agent's configuration: how one value is read from text (a command-line
flag or an environment variable) and from YAML/JSON data (the config file), and checked.

Owns: parsing and checking single values (booleans with urfave/cli's spellings, choices, lists
of choices, absolute paths, Go durations) and the wording of their problems. Must not know
about layers, sources, keys or files, and must not import anything of `agent` but `errors`
and `constants`: callers turn `InvalidValue` into a ConfigError that names the key and where
the value came from.
"""

from __future__ import annotations

import re
from typing import Any

from agent.constants import NVML_SONAME, XID_ACTIONS
from agent.errors import InvalidValue

# strconv.ParseBool, which urfave/cli (NVIDIA's flag library) uses for flags and env vars.
TRUE_TEXT = ("1", "t", "T", "true", "TRUE", "True")
FALSE_TEXT = ("0", "f", "F", "false", "FALSE", "False")


def describe(value: Any) -> str:
    """The type and value of `value`, as a config author would call them."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {'true' if value else 'false'}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"number {value}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"{type(value).__name__} {value!r}"


def expect_str(value: Any, what: str = "a string") -> str:
    if not isinstance(value, str):
        raise InvalidValue(f"expected {what}, got {describe(value)}")
    if any("\ud800" <= ch <= "\udfff" for ch in value):  # undecodable bytes in the environment
        raise InvalidValue(f"{value!r} is not valid UTF-8 text")
    return value


def expect_int(value: Any, what: str = "an integer") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidValue(f"expected {what}, got {describe(value)}")
    return value


class Kind:
    """How one setting is read (from text and from data), checked and written back."""

    metavar = "VALUE"
    text_form = "text"  # how the value is written in a flag or an env var, for docs and help

    def from_text(self, text: Any) -> Any:
        """Parse the value of a flag or an environment variable (a str, or a list of them)."""
        return self.check(expect_str(text))

    def from_data(self, value: Any) -> Any:
        """Parse a value of the config file (already decoded from YAML/JSON)."""
        return self.check(expect_str(value))

    def check(self, value: Any) -> Any:
        return value

    def to_data(self, value: Any) -> Any:
        """The file form of a parsed value: from_data(to_data(v)) == v."""
        return value

    def to_text(self, value: Any) -> str:
        """The flag / env form of a parsed value: from_text(to_text(v)) == v."""
        return str(value)


class BoolKind(Kind):
    metavar = "BOOL"
    text_form = "true|false"

    def from_text(self, text: Any) -> bool:
        if isinstance(text, bool):
            return text
        text = expect_str(text)
        if text in TRUE_TEXT:
            return True
        if text in FALSE_TEXT:
            return False
        raise InvalidValue(
            f"{text!r} is not a boolean; use true or false "
            f"(also accepted: {', '.join(TRUE_TEXT[:3] + FALSE_TEXT[:3])}, TRUE, FALSE, True, False)"
        )

    def from_data(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise InvalidValue(f"expected a boolean (true or false), got {describe(value)}")
        return value

    def to_text(self, value: Any) -> str:
        return "true" if value else "false"


class ChoiceKind(Kind):
    def __init__(self, *choices: str):
        self.choices = choices
        self.metavar = "{" + ",".join(choices) + "}"
        self.text_form = "|".join(choices)

    def from_data(self, value: Any) -> str:
        return self.check(expect_str(value, f"one of {', '.join(self.choices)}"))

    def check(self, value: str) -> str:
        if value not in self.choices:
            raise InvalidValue(f"{value!r} is not one of {', '.join(self.choices)}")
        return value


class ChoiceListKind(Kind):
    """One or more distinct choices: comma-separated as text, a string or a list in the file."""

    def __init__(self, *choices: str):
        self.choices = choices
        self.metavar = "STRATEGY,..."
        self.text_form = "comma-separated list"

    def _check_item(self, item: str, subkey: str = "") -> str:
        if item not in self.choices:
            raise InvalidValue(f"{item!r} is not one of {', '.join(self.choices)}", subkey)
        return item

    def _check_list(self, items: list[str], subkeys: list[str]) -> tuple[str, ...]:
        if not items:
            raise InvalidValue(f"empty list; give at least one of {', '.join(self.choices)}")
        seen: set[str] = set()
        for item, subkey in zip(items, subkeys):
            self._check_item(item, subkey)
            if item in seen:
                raise InvalidValue(f"{item!r} is listed twice", subkey)
            seen.add(item)
        return tuple(items)

    def from_text(self, text: Any) -> tuple[str, ...]:
        # A list comes from a repeated flag (argparse "append"); each entry may hold commas.
        parts = text if isinstance(text, (list, tuple)) else [text]
        items: list[str] = []
        for part in parts:
            for item in expect_str(part).split(","):
                item = item.strip()
                if not item:
                    raise InvalidValue(f"{','.join(parts)!r} has an empty item; "
                                       f"separate the values with single commas")
                items.append(item)
        return self._check_list(items, [""] * len(items))

    def from_data(self, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            if "," in value:
                raise InvalidValue(f"{value!r} is not one of {', '.join(self.choices)}; in the "
                                   f"file, give several as a YAML list, e.g. "
                                   f"[{value.replace(',', ', ')}]")
            return self._check_list([value], [""])
        if not isinstance(value, list):
            raise InvalidValue(f"expected a string or a list of strings, got {describe(value)}")
        items = []
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise InvalidValue(
                    f"expected one of {', '.join(self.choices)}, got {describe(item)}", f"[{i}]")
            items.append(item)
        return self._check_list(items, [f"[{i}]" for i in range(len(items))])

    def to_data(self, value: Any) -> list[str]:
        return list(value)

    def to_text(self, value: Any) -> str:
        return ",".join(value)


class PathKind(Kind):
    """An absolute path; `empty` (if set) is what an empty string means, else it is refused."""

    metavar = "PATH"
    text_form = "absolute path"

    def __init__(self, empty: str | None = None):
        self.empty = empty

    def check(self, value: str) -> str:
        if value == "":
            if self.empty is None:
                raise InvalidValue("must not be empty")
            return value
        if "\0" in value:
            raise InvalidValue(f"{value!r} contains a NUL byte")
        if not value.startswith("/"):
            raise InvalidValue(f"{value!r} is not an absolute path")
        return value


class NvmlLibraryKind(PathKind):
    """libnvidia-ml.so.1 (found under the driver root) or an absolute path to the library."""

    metavar = "PATH"
    text_form = f"{NVML_SONAME} or absolute path"

    def check(self, value: str) -> str:
        if value == NVML_SONAME:
            return value
        if value and "/" not in value:
            raise InvalidValue(f"{value!r} is neither {NVML_SONAME} (looked up under the driver "
                               f"root) nor an absolute path")
        return super().check(value)


class TextKind(Kind):
    """A non-empty string without whitespace or control characters."""

    metavar = "TEXT"

    def check(self, value: str) -> str:
        if value == "":
            raise InvalidValue("must not be empty")
        if any(ch.isspace() or ord(ch) < 32 for ch in value):
            raise InvalidValue(f"{value!r} contains whitespace or control characters")
        return value


class NodeNameKind(Kind):
    """A Kubernetes node name (a DNS subdomain: lowercase letters, digits, '-' and '.', at
    most 253 characters), or "" for the host name as kubelet takes it by default."""

    metavar = "NAME"
    text_form = "node name, empty for the host name"

    def check(self, value: str) -> str:
        if value and (len(value) > 253 or not _NODE_NAME.fullmatch(value)):
            raise InvalidValue(f"{value!r} is not a node name (lowercase letters, digits, '-' "
                               f"and '.', starting and ending with a letter or digit)")
        return value


_NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class ListenAddressKind(Kind):
    """`[HOST]:PORT` to listen on (no host: every address; IPv6 in brackets; port 0: one the
    kernel picks, which `gpu-agent status` shows), or "" for off."""

    metavar = "[HOST]:PORT"
    text_form = "[host]:port, empty for off"

    def check(self, value: str) -> str:
        if value == "":
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
            raise InvalidValue(f"{value!r} is not [host]:port with a port from 0 to 65535 "
                               f"(empty turns it off)")
        if any(ch.isspace() or ord(ch) < 32 for ch in host) or (
                ":" in host and not (host.startswith("[") and host.endswith("]"))):
            raise InvalidValue(f"{value!r}: the host must be a name or an address (IPv6 in "
                               f"brackets)")
        return value


class ConfigFileKind(Kind):
    """The config file path given by --config / CONFIG_FILE; empty means no file."""

    metavar = "FILE"
    text_form = "path (empty: none)"

    def check(self, value: str) -> str:
        if "\0" in value:
            raise InvalidValue(f"{value!r} contains a NUL byte")
        return value


class ConfigNameKind(Kind):
    """The name of a config in the named-config directory, as a node label value may hold it
    (at most 63 letters, digits, '-', '_' and '.', starting and ending with a letter or digit),
    or "" for none."""

    metavar = "NAME"
    text_form = "config name, empty for none"

    def check(self, value: str) -> str:
        if value and not CONFIG_NAME.fullmatch(value):
            raise InvalidValue(f"{value!r} is not a config name (a node label value: at most 63 "
                               f"letters, digits, '-', '_' and '.', starting and ending with a "
                               f"letter or digit)")
        return value


# A Kubernetes label value (k8s.io/apimachinery validation.IsValidLabelValue), non-empty.
CONFIG_NAME = re.compile(r"(?=.{1,63}$)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


class StringListKind(Kind):
    """A string or a list of non-empty strings (NVIDIA's cdiFeatureFlags)."""

    def from_data(self, value: Any) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise InvalidValue(f"expected a string or a list of strings, got {describe(value)}")
        out = []
        for i, item in enumerate(items):
            subkey = f"[{i}]" if isinstance(value, list) else ""
            if not isinstance(item, str):
                raise InvalidValue(f"expected a string, got {describe(item)}", subkey)
            if not item:
                raise InvalidValue("must not be empty", subkey)
            out.append(item)
        return tuple(out)

    def to_data(self, value: Any) -> list[str]:
        return list(value)


# Go's time.ParseDuration: a sequence of decimal numbers with units, e.g. "60s", "1m30s".
_GO_DURATION = r"^[+]?((\d+(\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h))+$"


class DurationKind(Kind):
    """A Go duration as NVIDIA's config takes it: a string like "60s", or integer nanoseconds."""

    def from_data(self, value: Any) -> str:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise InvalidValue(
                f"expected a duration such as \"60s\" or \"1m30s\", got {describe(value)}")
        if isinstance(value, int):
            if value < 0:
                raise InvalidValue(f"{value} is negative; a duration must be >= 0")
            return f"{value}ns"
        if value != "0" and not re.match(_GO_DURATION, value):
            hint = "; it must not be negative" if value.startswith("-") else ""
            raise InvalidValue(f"{value!r} is not a duration such as \"60s\" or \"1m30s\"{hint}")
        return value


_DURATION_PART = r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)"
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
                 "m": 60.0, "h": 3600.0}


class IntervalKind(Kind):
    """An interval written as a Go duration ("60s", "1m30s", "500ms"), held in seconds (a
    float). "0" (or any zero duration) means off; anything else must be at least `minimum` s."""

    metavar = "DURATION"
    text_form = "duration"

    def __init__(self, minimum: float = 0.1):
        self.minimum = minimum

    def from_data(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, str):
            raise InvalidValue(
                f"expected a duration such as \"60s\" or \"1m30s\", got {describe(value)}")
        return self.from_text(value)

    def from_text(self, text: Any) -> float:
        text = expect_str(text)
        if text != "0" and not re.match(_GO_DURATION, text):
            hint = "; it must not be negative" if text.startswith("-") else ""
            raise InvalidValue(f"{text!r} is not a duration such as \"60s\" or \"1m30s\"{hint}")
        seconds = float(sum(float(n) * _UNIT_SECONDS[u] for n, u in re.findall(_DURATION_PART, text)))
        if 0 < seconds < self.minimum:
            raise InvalidValue(f"{text!r} is too short: use 0 (off) or at least {self.minimum:g}s")
        return seconds

    def to_text(self, value: Any) -> str:
        if not value:
            return "0"
        # to the nanosecond, a duration's resolution; no exponent ("1e-05"), no trailing zeros
        digits = format(float(value), ".9f").rstrip("0").rstrip(".")
        return f"{digits}s"

    def to_data(self, value: Any) -> str:
        return self.to_text(value)


class XidListKind(Kind):
    """NVIDIA's DP_DISABLE_HEALTHCHECKS / DP_ENABLE_HEALTHCHECKS value: `all`, `xids`, or
    comma-separated XIDs, kept as written (empty: none). Malformed XIDs are not refused here:
    NVIDIA's plugin skips them with a log line, and so does agent.health.policy. In the file
    also an integer or a list of XIDs."""

    metavar = "XIDS"
    text_form = "all, xids or comma-separated XIDs"

    def from_text(self, text: Any) -> str:
        return self.check(expect_str(text))

    def from_data(self, value: Any) -> str:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, list):
            items = []
            for i, item in enumerate(value):
                if isinstance(item, bool) or not isinstance(item, (int, str)):
                    raise InvalidValue(f"expected an XID, got {describe(item)}", f"[{i}]")
                items.append(str(item))
            return self.check(",".join(items))
        return self.check(expect_str(value, "all, xids, or comma-separated XIDs"))

    def check(self, value: str) -> str:
        if any(ord(ch) < 32 for ch in value):
            raise InvalidValue(f"{value!r} contains control characters")
        return value


class XidActionsKind(Kind):
    """XID -> action class overrides: `48=reset,79=reboot` as text, a mapping {48: reset} in
    the file; held as a sorted tuple of (xid, action) pairs (empty: the xidPolicy table as
    it is)."""

    metavar = "XID=ACTION,..."
    text_form = "comma-separated XID=ACTION"

    @staticmethod
    def _pair(xid: Any, action: Any, subkey: str) -> tuple[int, str]:
        if isinstance(xid, str) and xid.strip().isdigit() and xid.strip().isascii():
            xid = int(xid.strip())
        if isinstance(xid, bool) or not isinstance(xid, int) or not 0 <= xid < 2**64:
            raise InvalidValue(f"{describe(xid)} is not an XID (an unsigned integer)", subkey)
        if not isinstance(action, str) or action not in XID_ACTIONS:
            raise InvalidValue(f"{describe(action)} is not one of {', '.join(XID_ACTIONS)}", subkey)
        return xid, action

    def from_text(self, text: Any) -> tuple[tuple[int, str], ...]:
        text = expect_str(text)
        out = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            if "=" not in item:
                raise InvalidValue(f"{item!r} is not XID=ACTION (e.g. 48=reset)")
            xid, action = (s.strip() for s in item.split("=", 1))
            xid, action = self._pair(xid, action, "")
            out[xid] = action
        return tuple(sorted(out.items()))

    def from_data(self, value: Any) -> tuple[tuple[int, str], ...]:
        if not isinstance(value, dict):
            raise InvalidValue(f"expected a mapping of XID to action, e.g. {{48: reset}}, got "
                               f"{describe(value)}")
        out = {}
        for xid, action in value.items():
            xid_n, action = self._pair(xid, action, f".{xid}")
            if xid_n in out:
                raise InvalidValue(f"XID {xid_n} is given twice", f".{xid}")
            out[xid_n] = action
        return tuple(sorted(out.items()))

    def to_data(self, value: Any) -> dict:
        return {xid: action for xid, action in value}

    def to_text(self, value: Any) -> str:
        return ",".join(f"{xid}={action}" for xid, action in value)


class PathListKind(Kind):
    """One or more distinct absolute paths: comma-separated as text, a path or a list of paths
    in the file (agent.cdiSpecDirs)."""

    metavar = "PATH,..."
    text_form = "comma-separated absolute paths"

    def _check_list(self, items: list[str], subkeys: list[str]) -> tuple[str, ...]:
        if not items:
            raise InvalidValue("empty list; give at least one absolute path")
        seen: set[str] = set()
        for item, subkey in zip(items, subkeys):
            try:
                PathKind().check(item)
            except InvalidValue as exc:
                raise InvalidValue(exc.problem, subkey) from None
            if item in seen:
                raise InvalidValue(f"{item!r} is listed twice", subkey)
            seen.add(item)
        return tuple(items)

    def from_text(self, text: Any) -> tuple[str, ...]:
        text = expect_str(text)
        items = [item.strip() for item in text.split(",")]
        if any(not item for item in items):
            raise InvalidValue(f"{text!r} has an empty item; separate the paths with single commas")
        return self._check_list(items, [""] * len(items))

    def from_data(self, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            return self._check_list([value], [""])
        if not isinstance(value, list):
            raise InvalidValue(f"expected a path or a list of paths, got {describe(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise InvalidValue(f"expected an absolute path, got {describe(item)}", f"[{i}]")
        return self._check_list(list(value), [f"[{i}]" for i in range(len(value))])

    def to_data(self, value: Any) -> list[str]:
        return list(value)

    def to_text(self, value: Any) -> str:
        return ",".join(value)


class GpuListKind(Kind):
    """GPUs by index or UUID, or `all`: comma-separated as text (empty: none), a list in the
    file (agent.draSharedGpus, agent.draDynamicMig)."""

    metavar = "GPU,..."
    text_form = "comma-separated GPU indexes or UUIDs, or all"

    def _check_list(self, items: list[Any], subkeys: list[str]) -> tuple[str, ...]:
        for item, subkey in zip(items, subkeys):
            if not isinstance(item, (str, int)) or isinstance(item, bool) or not (
                    item == "all" or str(item).isdigit() or str(item).startswith("GPU-")):
                raise InvalidValue(f"expected a GPU index, a GPU UUID (GPU-...) or all, got "
                                   f"{describe(item)}", subkey)
        return tuple(str(i) for i in items)

    def from_text(self, text: Any) -> tuple[str, ...]:
        text = expect_str(text)
        items = [item.strip() for item in text.split(",")] if text.strip() else []
        return self._check_list(items, [""] * len(items))

    def from_data(self, value: Any) -> tuple[str, ...]:
        items = value if isinstance(value, list) else [value]
        return self._check_list(items, [f"[{i}]" for i in range(len(items))]
                                if isinstance(value, list) else [""])

    def to_data(self, value: Any) -> list[str]:
        return list(value)

    def to_text(self, value: Any) -> str:
        return ",".join(value)
