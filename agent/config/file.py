"""Reading and checking a `version: v1` config file: NVIDIA k8s-device-plugin's schema as is,
plus gpu-agent's `agent:` section.

Owns: reading the file (unreadable files, YAML syntax errors with line and column, duplicate
keys), the schema of every section (which keys exist, their types and values; unknown keys are
refused with their key path), the frozen structures of the sections only the file can set
(`resources`, `sharing`, `imex`) and the NVIDIA keys we accept but do not use, and writing a
document back in the same schema. Must not read the environment or the command line (that is
agent.config), and must not import anything of `agent` but errors and the modules of agent.config.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable, NamedTuple, Union

from agent.config.kinds import (
    BoolKind,
    ChoiceKind,
    DurationKind,
    Kind,
    PathKind,
    StringListKind,
    describe,
    expect_int,
    expect_str,
)
from agent.config.options import OPTIONS_BY_KEY
from agent.constants import VCUDA_CORE, VCUDA_CORE_UNITS, VCUDA_MEMORY
from agent.errors import ConfigError, InvalidValue

VERSION = "v1"
RESOURCE_PREFIX = "nvidia.com"
log = logging.getLogger(__name__)
MAX_RESOURCE_NAME = 63  # NVIDIA's limit on the full name, prefix included
# A config file is a page or two: larger ones (or ones whose aliases expand past this many
# values) are refused at once instead of parsed for seconds or until memory runs out.
MAX_FILE_BYTES = 1 << 20
MAX_NODES = 100_000


# ---------------------------------------------------------------------------------------------
# The sections only the file can set.


class ResourcePattern(NamedTuple):
    """`resources.gpus[]` / `resources.mig[]`: devices whose model matches `pattern` (with `*`
    wildcards) are advertised as resource `name` (always in full, e.g. nvidia.com/a100)."""

    pattern: str
    name: str


class Resources(NamedTuple):
    gpus: tuple[ResourcePattern, ...] = ()
    mig: tuple[ResourcePattern, ...] = ()


class DeviceReplicas(NamedTuple):
    """An entry of `devices` with its own replica count (gpu-agent's per-GPU counts):
    `{device: 2, replicas: 8}`. NVIDIA's files never hold one, so they read the same."""

    device: str  # a GPU index, a MIG index (GPU:MIG) or a GPU / MIG UUID
    replicas: int


# "all", a count, or GPU/MIG indexes and UUIDs, each optionally with its own replica count
Devices = Union[str, int, tuple[Union[str, DeviceReplicas], ...]]


class ReplicatedResource(NamedTuple):
    """One entry of `sharing.<strategy>.resources`."""

    name: str
    replicas: int
    devices: Devices = "all"
    rename: str | None = None  # as written; None: not given (renameByDefault may apply)


class ReplicatedResources(NamedTuple):
    """`sharing.timeSlicing` or `sharing.mps`."""

    resources: tuple[ReplicatedResource, ...]
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False


class Sharing(NamedTuple):
    time_slicing: ReplicatedResources | None = None
    mps: ReplicatedResources | None = None

    @property
    def strategy(self) -> str:
        """"none", "time-slicing" or "mps" (the two are mutually exclusive)."""
        if self.mps is not None:
            return "mps"
        if self.time_slicing is not None:
            return "time-slicing"
        return "none"


class Imex(NamedTuple):
    channel_ids: tuple[int, ...] = ()
    required: bool = False


class FileLayer(NamedTuple):
    """What one config file sets. Only keys present (and not null) appear in the mappings;
    a section is None when the file does not have it."""

    path: str
    options: Mapping[str, Any]  # option key (e.g. "flags.migStrategy") -> parsed value
    compat: Mapping[str, Any]  # NVIDIA key we accept but do not use -> parsed value
    resources: Resources | None = None
    sharing: Sharing | None = None
    imex: Imex | None = None


# ---------------------------------------------------------------------------------------------
# The schema. Leaves are OPTION (an option of agent.config.options, looked up by key path),
# Compat(kind) (an NVIDIA key gpu-agent accepts, checks and keeps, but does not use), or a
# Section (a structure of its own). Mappings nest. Order here is the order of written documents.

OPTION = "option"


class Compat:
    def __init__(self, kind: Kind):
        self.kind = kind


class Section:
    def __init__(self, parse: str, dump: Callable[[Any], Any]):
        self.parse = parse  # name of the _Reader method
        self.dump = dump


def _dump_patterns(patterns: tuple[ResourcePattern, ...]) -> list:
    return [{"pattern": p.pattern, "name": p.name} for p in patterns]


def _dump_resources(resources: Resources) -> dict:
    out = {}
    if resources.gpus:
        out["gpus"] = _dump_patterns(resources.gpus)
    if resources.mig:
        out["mig"] = _dump_patterns(resources.mig)
    return out


def _dump_replicated(shared: ReplicatedResources) -> dict:
    items = []
    for r in shared.resources:
        item: dict[str, Any] = {"name": r.name}
        if r.rename is not None:
            item["rename"] = r.rename
        item["devices"] = [
            {"device": d.device, "replicas": d.replicas} if isinstance(d, DeviceReplicas) else d
            for d in r.devices] if isinstance(r.devices, tuple) else r.devices
        item["replicas"] = r.replicas
        items.append(item)
    return {
        "renameByDefault": shared.rename_by_default,
        "failRequestsGreaterThanOne": shared.fail_requests_greater_than_one,
        "resources": items,
    }


def _dump_sharing(sharing: Sharing) -> dict:
    out = {}
    if sharing.time_slicing is not None:
        out["timeSlicing"] = _dump_replicated(sharing.time_slicing)
    if sharing.mps is not None:
        out["mps"] = _dump_replicated(sharing.mps)
    return out


def _dump_imex(imex: Imex) -> dict:
    return {"channelIDs": list(imex.channel_ids), "required": imex.required}


SCHEMA: dict = {
    "version": "version",
    "flags": {
        "migStrategy": OPTION,
        "failOnInitError": OPTION,
        "nvidiaDriverRoot": OPTION,
        "nvidiaDevRoot": OPTION,
        "mpsRoot": OPTION,
        "gdrcopyEnabled": Compat(BoolKind()),
        "gdsEnabled": Compat(BoolKind()),
        "mofedEnabled": Compat(BoolKind()),
        "useNodeFeatureAPI": Compat(BoolKind()),
        "deviceDiscoveryStrategy": Compat(ChoiceKind("auto", "nvml", "tegra")),
        "restartOnDeviceUnhealthy": Compat(BoolKind()),
        "plugin": {
            "passDeviceSpecs": OPTION,
            "deviceListStrategy": OPTION,
            "deviceIDStrategy": OPTION,
            "cdiAnnotationPrefix": OPTION,
            "kubeletSocket": OPTION,
            "nvidiaCTKPath": Compat(PathKind()),
            "containerDriverRoot": Compat(PathKind()),
            "cdiFeatureFlags": Compat(StringListKind()),
            "sharedDevicesAllocationPolicy": OPTION,
        },
        "gfd": {
            "oneshot": Compat(BoolKind()),
            "noTimestamp": Compat(BoolKind()),
            "sleepInterval": Compat(DurationKind()),
            "outputFile": Compat(PathKind()),
            "machineTypeFile": Compat(PathKind()),
        },
    },
    # gpu-agent's own settings. Later sections (health / XID actions, allocation policy, the
    # unhealthy-devices file) are added here as they are implemented; until then they are
    # refused as unknown keys rather than silently ignored.
    "agent": {
        "stateDir": OPTION,
        "nvmlLibrary": OPTION,
        "mode": OPTION,
        "kubeletDir": OPTION,
        "draRebootTaint": OPTION,
        "draSharedGpus": OPTION,
        "draDynamicMig": OPTION,
        "mpsControl": OPTION,
        "cdiSpecDirs": OPTION,
        "devCharSymlinks": OPTION,
        "metricsAddress": OPTION,
        "nfdFeaturesFile": OPTION,
        "checkpointDeviceIDStrategy": OPTION,
        "podResourcesSocket": OPTION,
        "reconcileInterval": OPTION,
        "endedPodGrace": OPTION,
        "journalSyncInterval": OPTION,
        "migCheckInterval": OPTION,
        "nvmlCallTimeout": OPTION,
        "allocationPolicy": OPTION,
        "kubeconfig": OPTION,
        "nodeName": OPTION,
        "faultEvents": OPTION,
        "nodeCondition": OPTION,
        "configDir": OPTION,
        "nodeLabel": OPTION,
        "defaultConfig": OPTION,
        "fallbackStrategies": OPTION,
        "health": {
            "disableHealthchecks": OPTION,
            "enableHealthchecks": OPTION,
            "xidPolicy": OPTION,
            "xidActions": OPTION,
            "recoveryQuietPeriod": OPTION,
            "unhealthyDevicesFile": OPTION,
        },
    },
    "resources": Section("resources", _dump_resources),
    "sharing": Section("sharing", _dump_sharing),
    "imex": Section("imex", _dump_imex),
}

# Mappings that only group keys (each key below them has its own value and source).
GROUPS = ("flags", "flags.plugin", "flags.gfd", "agent", "agent.health")


def _schema_leaves(schema: dict, prefix: str = ""):
    for name, spec in schema.items():
        key = f"{prefix}.{name}" if prefix else name
        if isinstance(spec, dict):
            yield from _schema_leaves(spec, key)
        else:
            yield key, spec


_OPTION_KEYS = {key for key, spec in _schema_leaves(SCHEMA) if spec is OPTION}
if _OPTION_KEYS != set(OPTIONS_BY_KEY):  # a programming error, caught by any test run
    raise RuntimeError(f"config schema and option table disagree: {_OPTION_KEYS ^ set(OPTIONS_BY_KEY)}")
COMPAT_KEYS = tuple(key for key, spec in _schema_leaves(SCHEMA) if isinstance(spec, Compat))


# ---------------------------------------------------------------------------------------------
# Resource names and device references, as NVIDIA checks them.

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$"
_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_GPU_UUID = rf"^GPU-{_UUID}$"
_MIG_UUID = rf"^MIG-({_UUID}|GPU-{_UUID}/\d+/\d+)$"
_GPU_INDEX = r"^\d+$"
_MIG_INDEX = r"^\d+:\d+$"


def resource_name(value: Any) -> str:
    """The full resource name ("gpu" -> "nvidia.com/gpu"), checked as NVIDIA does."""
    name = expect_str(value, "a resource name")
    if not name:
        raise InvalidValue("must not be empty")
    full = name if name.startswith(f"{RESOURCE_PREFIX}/") else f"{RESOURCE_PREFIX}/{name}"
    short = full.split("/", 1)[1]
    if "/" in short:
        raise InvalidValue(f"{name!r} is not a valid resource name: only names in "
                           f"{RESOURCE_PREFIX}/ are supported")
    if len(full) > MAX_RESOURCE_NAME:
        raise InvalidValue(f"{full!r} is longer than {MAX_RESOURCE_NAME} characters")
    if not re.match(_DNS_SUBDOMAIN, short):
        raise InvalidValue(f"{name!r} is not a valid resource name: after {RESOURCE_PREFIX}/ use "
                           f"lower-case letters, digits, '-' and '.', starting and ending with a "
                           f"letter or digit")
    return full


def _rename(value: Any) -> str:
    """A `rename`: a resource name as NVIDIA checks it, or gpu-manager's vcuda-core."""
    if value == VCUDA_CORE:
        return value
    if value == VCUDA_MEMORY:
        raise InvalidValue(f"{VCUDA_MEMORY} is not supported: as a second resource beside "
                           f"{VCUDA_CORE} it needs gpu-manager's scheduler extender to put a "
                           f"pod's cores and memory on one GPU, which kubelet alone cannot; "
                           f"{VCUDA_CORE} limits memory in proportion (docs/sharing.md)")
    return resource_name(value)


def device_ref(value: Any) -> str:
    """A GPU index, a MIG index (GPU:MIG), or a GPU / MIG UUID, as a string."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InvalidValue(f"{value} is not a GPU index (must be >= 0)")
        return str(value)
    if isinstance(value, str) and (
        re.match(_GPU_INDEX, value) or re.match(_MIG_INDEX, value)
        or re.match(_GPU_UUID, value) or re.match(_MIG_UUID, value)
    ):
        return value
    raise InvalidValue(f"{describe(value)} is not a GPU index, a MIG index (GPU:MIG) or a "
                       f"GPU-/MIG- UUID")


# ---------------------------------------------------------------------------------------------
# Reading.


def _mark(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _check_expansion(root, source: str) -> None:
    """Refuse a document whose aliases would expand past MAX_NODES nodes (a "billion laughs"
    file: a few hundred bytes that decode into gigabytes). Each node's expanded size is
    counted once, so this costs the size of the file, not of its expansion."""
    import yaml

    sizes: dict[int, int] = {}

    def size(node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        sizes[id(node)] = MAX_NODES + 1  # a cycle (recursive alias) counts as too big
        if isinstance(node, yaml.MappingNode):
            n = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n = 1 + sum(size(item) for item in node.value)
        else:
            n = 1
        sizes[id(node)] = n = min(n, MAX_NODES + 1)
        return n

    if size(root) > MAX_NODES:
        raise ConfigError(source, f"invalid YAML: its aliases expand to more than {MAX_NODES} "
                                  f"values; a config file needs no such nesting")


def _find_duplicates(node, path: str, source: str) -> None:
    """Refuse a key given twice in one mapping (PyYAML would silently keep the last)."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        seen: dict[tuple, Any] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value == "<<":  # merge key: may legitimately repeat
                    continue
                ident = (key_node.tag, key_node.value)
                child = f"{path}.{key_node.value}" if path else key_node.value
                if ident in seen:
                    raise ConfigError(
                        child,
                        f"duplicate key (first at line {seen[ident].line + 1}, "
                        f"again at line {key_node.start_mark.line + 1})",
                        source,
                    )
                seen[ident] = key_node.start_mark
            else:
                child = path
            _find_duplicates(value_node, child, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _find_duplicates(item, f"{path}[{i}]", source)


def _join_surrogates(data: Any, source: str) -> Any:
    """Strings with \\uD83D\\uDE00-style escapes hold surrogate pairs after PyYAML decodes
    them (JSON writers escape characters beyond U+FFFF that way); join each pair into its
    character, as JSON and Go do, and refuse unpaired ones."""

    def fix(value: Any) -> Any:
        if isinstance(value, str):
            if not any("\ud800" <= ch <= "\udfff" for ch in value):
                return value
            try:
                return value.encode("utf-16", "surrogatepass").decode("utf-16")
            except UnicodeDecodeError:
                raise ConfigError(source, f"invalid YAML: {value!r} holds an unpaired "
                                          f"surrogate escape") from None
        if isinstance(value, list):
            return [fix(item) for item in value]
        if isinstance(value, dict):
            return {fix(k): fix(v) for k, v in value.items()}
        return value

    return fix(data)


def load_yaml(text: str, source: str) -> Any:
    """Decode YAML (JSON is YAML too); ConfigError(source, ...) with line and column if broken.
    PyYAML is imported here, when there is a file to read: an agent without one starts
    without it."""
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            _check_expansion(node, source)
            _find_duplicates(node, "", source)
        return _join_surrogates(yaml.safe_load(text), source)
    except yaml.MarkedYAMLError as exc:
        where = f" at {_mark(exc.problem_mark)}" if exc.problem_mark else ""
        problem = exc.problem or "syntax error"
        if exc.context:
            ctx_where = f" at line {exc.context_mark.line + 1}" if exc.context_mark else ""
            problem = f"{problem} ({exc.context}{ctx_where})"
        raise ConfigError(source, f"invalid YAML{where}: {problem}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(source, f"invalid YAML: {exc}") from exc


def read_file(path: str, given_by: str = "") -> FileLayer:
    """Read and check the config file at `path`. `given_by` says where the path came from
    (e.g. "from --config"), for the error if the file cannot be read."""
    try:
        # O_NONBLOCK: a FIFO opens at once (to be refused below) instead of waiting for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(path, f"cannot read the config file: not a regular file "
                                        f"({_file_kind(st.st_mode)})", given_by)
            if st.st_size > MAX_FILE_BYTES:
                raise ConfigError(path, f"the config file is {st.st_size} bytes; at most "
                                        f"{MAX_FILE_BYTES} (1 MiB) is read", given_by)
            raw = f.read(MAX_FILE_BYTES + 1)  # a file that grew meanwhile is cut here
        if len(raw) > MAX_FILE_BYTES:
            raise ConfigError(path, f"the config file is over {MAX_FILE_BYTES} bytes (1 MiB)",
                              given_by)
        text = raw.decode("utf-8")
    except OSError as exc:
        raise ConfigError(path, f"cannot read the config file: {exc.strerror or exc}",
                          given_by) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(path, f"cannot read the config file: not UTF-8 text "
                                f"(byte {exc.start})", given_by) from exc
    return parse_document(load_yaml(text, path), path)


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a pipe"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


def parse_document(data: Any, source: str) -> FileLayer:
    """Check decoded config data against the schema; ConfigError(key path, problem, source)."""
    return _Reader(source).document(data)


class _Reader:
    def __init__(self, source: str):
        self.source = source
        self.options: dict[str, Any] = {}
        self.compat: dict[str, Any] = {}
        self.sections: dict[str, Any] = {}

    # -- helpers --------------------------------------------------------------------------

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(key, problem, self.source)

    def parse(self, key: str, parse: Callable[[Any], Any], value: Any) -> Any:
        try:
            return parse(value)
        except InvalidValue as exc:
            raise self.fail(key + exc.subkey, exc.problem) from None

    def mapping(self, value: Any, key: str, known) -> dict:
        if not isinstance(value, dict):
            raise self.fail(key or "(top level)", f"expected a mapping, got {describe(value)}")
        known = list(known)
        for name in value:
            if isinstance(name, str) and name in known:
                continue
            # a key that does not print as itself (a control character, a line break) is
            # shown quoted and escaped: the message must name it on one readable line
            shown = name if isinstance(name, str) and name.isprintable() else repr(name)
            child = f"{key}.{shown}" if key else shown
            if not isinstance(name, str):
                raise self.fail(child, f"unknown key {name!r} (a {describe(name)}; keys are "
                                       f"strings: quote it if it should be one)")
            import difflib  # only for the error

            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            if close:
                raise self.fail(child, f"unknown key (did you mean {close[0]!r}?)")
            raise self.fail(child, f"unknown key; expected one of: {', '.join(known)}")
        return value

    def list(self, value: Any, key: str) -> list:
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list, got {describe(value)}")
        return value

    def required(self, m: dict, name: str, key: str, parse: Callable[[Any], Any]) -> Any:
        if m.get(name) is None:
            raise self.fail(f"{key}.{name}", "missing (required)")
        return self.parse(f"{key}.{name}", parse, m[name])

    def optional(self, m: dict, name: str, key: str, parse: Callable[[Any], Any],
                 default: Any) -> Any:
        if m.get(name) is None:
            return default
        return self.parse(f"{key}.{name}", parse, m[name])

    # -- the document ---------------------------------------------------------------------

    def document(self, data: Any) -> FileLayer:
        # NVIDIA's parseConfigFrom (api/config/v1/config.go) reads an empty file, or one
        # without `version`, as version v1 ("Allow an empty config file and default to
        # 'version: v1'", its CHANGELOG): so does this, saying so in the log.
        said = ""  # logged once the file is read: an error is its one line
        if data is None:
            said, data = "is empty: read as 'version: {}' with nothing set", {}
        if not isinstance(data, dict):
            raise self.fail("(top level)", f"expected a mapping, got {describe(data)}")
        version = data.get("version")
        if version is None and data:
            said = "has no version: read as 'version: {}'"
        if version is not None and version != VERSION:
            shown = repr(version) if isinstance(version, str) else describe(version)
            raise self.fail("version", f"unsupported version {shown}; this agent reads "
                                       f"'version: {VERSION}'")
        self.walk(data, SCHEMA, "")
        if said:
            log.info("config file %s %s, as NVIDIA's plugin reads it", self.source,
                     said.format(VERSION))
        return FileLayer(
            path=self.source,
            options=MappingProxyType(self.options),
            compat=MappingProxyType(self.compat),
            resources=self.sections.get("resources"),
            sharing=self.sections.get("sharing"),
            imex=self.sections.get("imex"),
        )

    def walk(self, data: Any, schema: dict, prefix: str) -> None:
        m = self.mapping(data, prefix, schema)
        for name, spec in schema.items():
            value = m.get(name)
            if value is None or spec == "version":  # null: not set
                continue
            key = f"{prefix}.{name}" if prefix else name
            if isinstance(spec, dict):
                self.walk(value, spec, key)
            elif spec is OPTION:
                self.options[key] = self.parse(key, OPTIONS_BY_KEY[key].kind.from_data, value)
            elif isinstance(spec, Compat):
                self.compat[key] = self.parse(key, spec.kind.from_data, value)
            else:
                self.sections[name] = getattr(self, spec.parse)(value, key)

    # -- sections -------------------------------------------------------------------------

    def resources(self, value: Any, key: str) -> Resources:
        m = self.mapping(value, key, ("gpus", "mig"))
        return Resources(
            gpus=self.patterns(m.get("gpus"), f"{key}.gpus"),
            mig=self.patterns(m.get("mig"), f"{key}.mig"),
        )

    def patterns(self, value: Any, key: str) -> tuple[ResourcePattern, ...]:
        if value is None:
            return ()
        out = []
        for i, item in enumerate(self.list(value, key)):
            ikey = f"{key}[{i}]"
            m = self.mapping(item, ikey, ("pattern", "name"))
            pattern = self.required(m, "pattern", ikey, _nonempty_str)
            name = self.required(m, "name", ikey, resource_name)
            out.append(ResourcePattern(pattern, name))
        return tuple(out)

    def sharing(self, value: Any, key: str) -> Sharing:
        m = self.mapping(value, key, ("timeSlicing", "mps"))
        ts = m.get("timeSlicing")
        mps = m.get("mps")
        if ts is not None and mps is not None:
            raise self.fail(key, "timeSlicing and mps are mutually exclusive; keep one")
        return Sharing(
            time_slicing=None if ts is None else self.replicated(ts, f"{key}.timeSlicing", False),
            # NVIDIA keeps MPS's historical behaviour: requests for more than one replica fail
            # unless the file says otherwise.
            mps=None if mps is None else self.replicated(mps, f"{key}.mps", True),
        )

    def replicated(self, value: Any, key: str, fail_default: bool) -> ReplicatedResources:
        m = self.mapping(value, key, ("renameByDefault", "failRequestsGreaterThanOne",
                                      "resources"))
        boolean = BoolKind().from_data
        rename_by_default = self.optional(m, "renameByDefault", key, boolean, False)
        fail_gt_one = self.optional(m, "failRequestsGreaterThanOne", key, boolean, fail_default)
        rkey = f"{key}.resources"
        if m.get("resources") is None:
            raise self.fail(rkey, "missing (required): list the resources to share, e.g. "
                                  "[{name: nvidia.com/gpu, replicas: 4}]")
        items = self.list(m["resources"], rkey)
        if not items:
            raise self.fail(rkey, "empty list: list the resources to share, e.g. "
                                  "[{name: nvidia.com/gpu, replicas: 4}]")
        out: list[ReplicatedResource] = []
        first: dict[str, int] = {}
        for i, item in enumerate(items):
            ikey = f"{rkey}[{i}]"
            r = self.mapping(item, ikey, ("name", "rename", "devices", "replicas"))
            name = self.required(r, "name", ikey, resource_name)
            if name in first:
                raise self.fail(f"{ikey}.name", f"{name!r} is already listed at "
                                                f"{rkey}[{first[name]}]")
            first[name] = i
            out.append(ReplicatedResource(
                name=name,
                rename=self.optional(r, "rename", ikey, _rename, None),
                devices=self.optional(r, "devices", ikey, _devices, "all"),
                replicas=self.required(r, "replicas", ikey, _replicas),
            ))
            if out[-1].rename == VCUDA_CORE:
                self._vcuda_core(out[-1], ikey, key, fail_gt_one)
        return ReplicatedResources(tuple(out), rename_by_default, fail_gt_one)

    def _vcuda_core(self, entry: ReplicatedResource, ikey: str, key: str,
                    fail_gt_one: bool) -> None:
        """gpu-manager's vcuda-core preset: units that MPS enforces, 100 a GPU, several a
        container."""
        if not key.endswith(".mps"):
            raise self.fail(f"{ikey}.rename", f"{VCUDA_CORE} needs MPS to enforce its units: "
                                              f"put it under sharing.mps")
        if entry.replicas != VCUDA_CORE_UNITS:
            raise self.fail(f"{ikey}.replicas", f"{VCUDA_CORE} is {VCUDA_CORE_UNITS} units a "
                                                f"GPU, as gpu-manager counts it; got "
                                                f"{entry.replicas}")
        if fail_gt_one:
            raise self.fail(f"{key}.failRequestsGreaterThanOne",
                            f"must be false with {VCUDA_CORE}: a container asks for several "
                            f"units")

    def imex(self, value: Any, key: str) -> Imex:
        m = self.mapping(value, key, ("channelIDs", "required"))
        ids = self.optional(m, "channelIDs", key, _channel_ids, ())
        required = self.optional(m, "required", key, BoolKind().from_data, False)
        return Imex(ids, required)


def _nonempty_str(value: Any) -> str:
    if expect_str(value) == "":
        raise InvalidValue("must not be empty")
    return value


def _replicas(value: Any) -> int:
    n = expect_int(value, "an integer number of replicas")
    if n < 2:
        raise InvalidValue(f"{n} replicas: must be at least 2 (1 would not share the device)")
    return n


def _devices(value: Any) -> Devices:
    if isinstance(value, str) and value == "all":
        return "all"
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise InvalidValue(f"a count of devices must be > 0, got {value}")
        return value
    if isinstance(value, list):
        if not value:
            raise InvalidValue("empty list: use 'all', a count, or a list of devices")
        refs: list[str | DeviceReplicas] = []
        seen: list[str] = []
        for i, item in enumerate(value):
            try:
                ref = _device_entry(item)
            except InvalidValue as exc:
                raise InvalidValue(exc.problem, f"[{i}]{exc.subkey}") from None
            name = ref.device if isinstance(ref, DeviceReplicas) else ref
            if name in seen:
                raise InvalidValue(f"{name!r} is listed twice", f"[{i}]")
            seen.append(name)
            refs.append(ref)
        return tuple(refs)
    raise InvalidValue(f"expected 'all', a count, or a list of GPU indexes, MIG indexes "
                       f"(GPU:MIG) or UUIDs, got {describe(value)}")


def _device_entry(value: Any) -> str | DeviceReplicas:
    """A `devices` entry: a device as NVIDIA takes it, or {device: <that>, replicas: N}."""
    if not isinstance(value, dict):
        return device_ref(value)
    for name in value:
        if name not in ("device", "replicas"):
            raise InvalidValue(f"unknown key {name!r}: an entry with its own count is "
                               f"{{device: <index or UUID>, replicas: <n>}}", f".{name}")
    for name in ("device", "replicas"):
        if value.get(name) is None:
            raise InvalidValue("missing (required)", f".{name}")
    try:
        device = device_ref(value["device"])
    except InvalidValue as exc:
        raise InvalidValue(exc.problem, ".device") from None
    try:
        return DeviceReplicas(device, _replicas(value["replicas"]))
    except InvalidValue as exc:
        raise InvalidValue(exc.problem, ".replicas") from None


def _channel_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise InvalidValue(f"expected a list of channel IDs, got {describe(value)}")
    ids = []
    for i, item in enumerate(value):
        try:
            ids.append(expect_int(item, "an integer channel ID"))
        except InvalidValue as exc:
            raise InvalidValue(exc.problem, f"[{i}]") from None
    if ids not in ([], [0]):
        raise InvalidValue(f"{ids} is not supported: channelIDs must be [] or [0]")
    return tuple(ids)


# ---------------------------------------------------------------------------------------------
# Writing.


def build_document(option_data: Mapping[str, Any], compat: Mapping[str, Any],
                   sections: Mapping[str, Any]) -> dict:
    """A v1 document: every option (its file form, by key), the compat keys given, and the
    sections given (None or absent: left out). Loading it gives back the same values."""

    def fill(schema: dict, prefix: str) -> dict:
        out: dict[str, Any] = {}
        for name, spec in schema.items():
            key = f"{prefix}.{name}" if prefix else name
            if spec == "version":
                out[name] = VERSION
            elif spec is OPTION:
                out[name] = option_data[key]
            elif isinstance(spec, Compat):
                if key in compat:
                    out[name] = spec.kind.to_data(compat[key])
            elif isinstance(spec, dict):
                sub = fill(spec, key)
                if sub:
                    out[name] = sub
            elif sections.get(name) is not None:
                out[name] = spec.dump(sections[name])
        return out

    return fill(SCHEMA, "")
