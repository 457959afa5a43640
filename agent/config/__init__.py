"""gpu-agent's configuration: NVIDIA k8s-device-plugin's `version: v1` config file (read as is)
plus our `agent:` section, environment variables and command-line flags, layered so that a
flag beats an environment variable beats the file beats the default.

Owns: the effective configuration (`Config`: every value and where it came from),
`load_config`, the option flags (`add_run_options`, for `gpu-agent run` and `config show`;
`add_state_command`, for the commands that read a state directory), and the `gpu-agent config
show|check` commands. The option table is in .options, the value kinds in
.kinds, the file schema in .file, the named configs in .named, the names and defaults in
agent.constants.
Must not act on the configuration (open NVML, touch sockets or the state directory) nor
refuse values it parses that the agent does not implement yet (later layers may, at run
time); must not import anything of `agent` but errors, constants and its own modules.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from agent.config.file import (
    COMPAT_KEYS,
    GROUPS,
    FileLayer,
    Imex,
    Resources,
    Sharing,
    build_document,
    read_file,
)
from agent.config.kinds import BoolKind, ChoiceListKind
from agent.config.named import NONE, Choice, choose
from agent.config.options import (
    OPTIONS,
    OPTIONS_BY_KEY,
    OPTIONS_BY_NAME,
    SELECTION_OPTIONS,
    Option,
)
from agent.constants import DEFAULT_MPS_ROOT, MPS_CONTROL, NVML_SONAME
from agent.errors import ConfigError, InvalidValue

__all__ = [
    "OPTIONS", "Config", "ConfigError", "Source", "add_cli", "add_run_options",
    "add_state_command", "check_config_file", "config_json", "format_config", "load_config",
]

SECTIONS = ("resources", "sharing", "imex")
_SECTION_DEFAULTS = {"resources": Resources(), "sharing": Sharing(), "imex": Imex()}
_UNSET_SECTIONS = {
    "resources": "not set: resources keep their default names (nvidia.com/gpu, MIG by profile)",
    "sharing": "not set: no time-slicing or MPS sharing",
    "imex": "not set: no IMEX channels",
}
PRECEDENCE = "flag > env > file > default"


class Source(NamedTuple):
    """Where a value came from: kind "default", "file" (name: its path), "env" (name: the
    variable), "flag" (name: the flag) or "argument" (`config check FILE`)."""

    kind: str
    name: str = ""
    note: str = ""

    def __str__(self) -> str:
        text = f"{self.kind} {self.name}" if self.name else self.kind
        return f"{text} ({self.note})" if self.note else text


DEFAULT = Source("default")


class Config(NamedTuple):
    """The effective configuration. Option fields hold values already checked; `sources`
    maps each option name, each section name and each compat key to its Source."""

    config_file: str | None
    mode: str
    kubelet_dir: str
    dra_reboot_taint: str
    dra_shared_gpus: tuple[str, ...]
    dra_dynamic_mig: tuple[str, ...]
    mig_strategy: str
    fail_on_init_error: bool
    driver_root: str
    dev_root: str
    pass_device_specs: bool
    device_list_strategy: tuple[str, ...]
    device_id_strategy: str
    cdi_annotation_prefix: str
    kubelet_socket: str  # "": do not connect to kubelet (NVIDIA's meaning)
    state_dir: str
    nvml_library: str
    mps_root: str  # sharing.mps: the daemons' pipe and log directories, the shared /dev/shm
    mps_control: str  # "": nvidia-cuda-mps-control under the driver root
    checkpoint_device_id_strategy: str
    pod_resources_socket: str  # "": do not ask kubelet's podresources
    reconcile_interval: float  # seconds; 0: only at start and after Allocate
    ended_pod_grace: float  # seconds a pod stays unlisted before its allocations are dropped
    journal_sync_interval: float  # seconds; 0: fdatasync before each Allocate answers
    mig_check_interval: float  # seconds; 0: the MIG layout is read at start and on SIGHUP
    nvml_call_timeout: float  # seconds (agent.nvml.guard); 0: NVML calls are waited for
    allocation_policy: str  # best-effort | packed (agent.rm.preferred)
    replica_allocation_policy: str  # distributed | packed
    disable_healthchecks: str  # DP_DISABLE_HEALTHCHECKS as written (agent.health.policy)
    enable_healthchecks: str  # DP_ENABLE_HEALTHCHECKS as written
    xid_policy: str  # nvidia | catalog: the default XID table (agent.health.policy)
    xid_actions: tuple[tuple[int, str], ...]  # (xid, action) overrides of that table
    recovery_quiet_period: float  # seconds
    unhealthy_devices_file: str  # "": no isolation file
    cdi_spec_dirs: tuple[str, ...]  # CDI spec directories, lowest precedence first
    dev_char_symlinks: bool  # create missing /dev/char links of the NVIDIA nodes (agent.devchar)
    metrics_address: str  # [host]:port of /metrics (agent.metrics); "": none
    nfd_features_file: str  # NFD features.d file (agent.rm.labels); "": none
    kubeconfig: str  # the Kubernetes API's kubeconfig (agent.kubeapi); "": no API
    node_name: str  # this node's name in Kubernetes; "": the host name
    fault_events: bool  # Events on the Node and the holding pods when a GPU flips
    node_condition: bool  # the Node condition GPUHealthy
    config_dir: str  # named configs (agent.config.named); "": none
    node_label: str  # the Node label naming this node's config
    default_config: str  # the named config without the label; "": the fallbacks choose
    fallback_strategies: tuple[str, ...]  # named | single | empty, in order
    resources: Resources
    sharing: Sharing
    imex: Imex
    # NVIDIA keys the file set that gpu-agent accepts but does not use (yet), by key path,
    # e.g. {"flags.gdsEnabled": True}; later layers may act on them or refuse them.
    compat: Mapping[str, Any]
    sources: Mapping[str, Source]
    choice: Choice = NONE  # the named config in use (its file is config_file), or none

    def source(self, name: str) -> Source:
        """The source of an option (by name or key), a section, or a compat key."""
        if name in OPTIONS_BY_KEY:
            name = OPTIONS_BY_KEY[name].name
        return self.sources.get(name, DEFAULT)

    def values(self) -> dict:
        """Every option (config_file included) and section, by name: the effective values."""
        out = {opt.name: getattr(self, opt.name) for opt in OPTIONS}
        out.update({name: getattr(self, name) for name in SECTIONS})
        out["compat"] = dict(self.compat)
        return out

    @property
    def plugin_socket_dir(self) -> str | None:
        """Where the plugin sockets go: kubelet's socket directory (None: no kubelet)."""
        return os.path.dirname(self.kubelet_socket) if self.kubelet_socket else None

    @property
    def nvml_library_explicit(self) -> str | None:
        """The NVML library path to open as is, or None to look for libnvidia-ml.so.1 under
        the driver root (agent.nvml.library.resolve_library_path's `explicit`)."""
        return None if self.nvml_library == NVML_SONAME else self.nvml_library

    @property
    def mps_root_dir(self) -> str:
        """flags.mpsRoot, "" read as the default (NVIDIA's flag has none; its logged config
        may say "")."""
        return self.mps_root or DEFAULT_MPS_ROOT

    @property
    def mps_control_program(self) -> str:
        """The nvidia-cuda-mps-control the agent runs: agent.mpsControl, else usr/bin's under
        the driver root."""
        return self.mps_control or os.path.join(self.driver_root, "usr/bin", MPS_CONTROL)

    def to_document(self) -> dict:
        """The effective configuration as a v1 config file (JSON-able); loading it as a file
        gives the same values."""
        option_data = {opt.key: opt.kind.to_data(getattr(self, opt.name))
                       for opt in OPTIONS if opt.key}
        sections = {name: getattr(self, name) for name in SECTIONS
                    if getattr(self, name) != _SECTION_DEFAULTS[name]}
        return build_document(option_data, self.compat, sections)


# ---------------------------------------------------------------------------------------------
# Loading.


def _given(args: Any) -> dict:
    if args is None:
        return {}
    if isinstance(args, argparse.Namespace):
        return vars(args)
    if isinstance(args, Mapping):
        return dict(args)
    raise TypeError(f"load_config takes an argparse.Namespace or a mapping, not {type(args)}")


def _from_text(opt: Option, raw: Any, key: str, where: str) -> Any:
    try:
        return opt.kind.from_text(raw)
    except InvalidValue as exc:
        raise ConfigError(key + exc.subkey, exc.problem, where) from None


def load_config(args: Any = None, environ: Mapping[str, str] | None = None,
                label: str | None = None) -> Config:
    """The effective configuration from flags, environment and config file.

    `args`: an argparse.Namespace from a parser given `add_run_options`, or a mapping from
    option names (Config field names, e.g. "mig_strategy") to flag values as text; None or a
    missing name means the flag was not given; other names are ignored. `environ`: the
    environment (default os.environ). The config file is named by --config / CONFIG_FILE.
    Every value given is checked, including ones a higher layer overrides; the first problem
    raises ConfigError naming the flag, the env var or the file's key path.

    When the named-config directory holds configs, the one chosen for a node whose label has
    the value `label` (None: unlabelled, or not known) is read in place of the config file
    (agent.config.named); the options that choose keep their values from the config file.
    """
    given = _given(args)
    environ = os.environ if environ is None else environ
    flags: dict[str, tuple[Any, Source]] = {}
    env: dict[str, tuple[Any, Source]] = {}
    for opt in OPTIONS:
        if given.get(opt.name) is not None:
            flags[opt.name] = (_from_text(opt, given[opt.name], opt.flag, "command line"),
                               Source("flag", opt.flag))
        if opt.env in environ:
            env[opt.name] = (_from_text(opt, environ[opt.env], opt.env, "environment"),
                             Source("env", opt.env))
    path, source = flags.get("config_file") or env.get("config_file") or ("", DEFAULT)
    layer = read_file(path, f"from {source.name}") if path else None
    base = _build(flags, env, layer, source)
    choice = choose(base.config_dir, base.node_label, label, base.default_config,
                    base.fallback_strategies)
    if not choice.path:
        return base._replace(choice=choice)
    named = read_file(choice.path, f"chosen by {choice.why}")
    for name in SELECTION_OPTIONS:
        key = OPTIONS_BY_NAME[name].key
        if key in named.options:
            raise ConfigError(key, "chooses the named config, so it is read from the --config "
                                   "file, the environment or a flag; remove it here",
                              choice.path)
    cfg = _build(flags, env, named, Source("named config", choice.name, choice.why))
    kept = {name: getattr(base, name) for name in SELECTION_OPTIONS}
    sources = {**cfg.sources, **{name: base.sources[name] for name in SELECTION_OPTIONS}}
    return cfg._replace(**kept, choice=choice, sources=MappingProxyType(sources))


def has_named_configs(cfg: Config) -> bool:
    """Whether the named-config directory held configs when `cfg` was loaded (a label then
    chooses one): its choice says so, without listing the directory again."""
    return cfg.choice != NONE


def check_config_file(path: str) -> Config:
    """Check the config file at `path` alone (no flags, no environment): ConfigError if bad,
    or if `run` would refuse it (check_supported)."""
    cfg = _build({}, {}, read_file(path), Source("argument", "FILE"))
    check_supported(cfg)
    return cfg


def check_supported(cfg: Config) -> None:
    """Refuse, with the key and where it was set, settings `run` does not implement yet (the
    schema accepts them, as NVIDIA's has them): `run`, its reload and `config check` refuse
    the same."""
    if cfg.imex.channel_ids:
        raise ConfigError("imex.channelIDs", "IMEX channels are not supported by gpu-agent run "
                                             "yet; remove them", cfg.config_file or "")


def _build(flags: dict, env: dict, layer: FileLayer | None, file_source: Source) -> Config:
    values: dict[str, Any] = {"config_file": layer.path if layer else None}
    sources: dict[str, Source] = {"config_file": file_source}
    for opt in OPTIONS[1:]:
        if opt.name in flags:
            values[opt.name], sources[opt.name] = flags[opt.name]
        elif opt.name in env:
            values[opt.name], sources[opt.name] = env[opt.name]
        elif layer is not None and opt.key in layer.options:
            values[opt.name], sources[opt.name] = layer.options[opt.key], Source("file", layer.path)
        else:
            values[opt.name], sources[opt.name] = opt.default, DEFAULT
    if values["dev_root"] == "":  # NVIDIA: an unset or empty dev root is the driver root
        values["dev_root"] = values["driver_root"]
        sources["dev_root"] = sources["dev_root"]._replace(note="follows the driver root")
    for name in SECTIONS:
        section = getattr(layer, name) if layer is not None else None
        if section is None:
            values[name], sources[name] = _SECTION_DEFAULTS[name], DEFAULT
        else:
            values[name], sources[name] = section, Source("file", layer.path)
    compat = dict(layer.compat) if layer is not None else {}
    for key in compat:
        sources[key] = Source("file", layer.path)
    if values["sharing"].mps is not None and values["mig_strategy"] == "mixed":
        by = sources["mig_strategy"]
        by_text = "flags.migStrategy" if by.kind == "file" else str(by)
        raise ConfigError("sharing.mps", f"MPS sharing does not work with MIG strategy 'mixed' "
                                         f"(set by {by_text})", layer.path)
    return Config(**values, compat=MappingProxyType(compat), sources=MappingProxyType(sources))


# ---------------------------------------------------------------------------------------------
# Showing.


def _dump(value: Any, flow: bool) -> str:
    """YAML for `value`, non-ASCII written as is where that reads back the same. (PyYAML's
    emitter writes NEL, LS and PS raw inside quoted scalars, where a reader takes them for
    line breaks; escape everything then.)"""
    import yaml  # `config show` only

    kwargs = {"default_flow_style": flow, "sort_keys": False, "width": 1 << 30}
    text = yaml.safe_dump(value, allow_unicode=True, **kwargs)
    if any(ch in text for ch in "\x85\u2028\u2029"):
        text = yaml.safe_dump(value, allow_unicode=False, **kwargs)
    return text


def _flow(value: Any) -> str:
    """A value on one line, as YAML writes it (quoted where YAML needs it)."""
    text = _dump(value, flow=True).strip()
    if text.endswith("\n..."):
        text = text[:-4].rstrip()
    return text


def format_config(cfg: Config) -> str:
    """The effective configuration as YAML, each value commented with its source; the text is
    itself a valid v1 config file holding the same values."""
    lines: list[tuple[str, str | None]] = [
        (f"# gpu-agent effective configuration ({PRECEDENCE})", None),
        (f"# config file: {cfg.config_file or 'none'} ({cfg.sources['config_file']})", None),
    ]

    def emit(mapping: dict, prefix: str, indent: int) -> None:
        pad = " " * indent
        for name, value in mapping.items():
            key = f"{prefix}.{name}" if prefix else name
            if key == "version":
                lines.append((f"{pad}{name}: {_flow(value)}", None))
            elif key in GROUPS:
                note = None
                if key == "flags.gfd":
                    note = "gpu-feature-discovery settings: accepted, not used by gpu-agent"
                lines.append((f"{pad}{name}:", note))
                emit(value, key, indent + 2)
            elif key in SECTIONS:
                lines.append((f"{pad}{name}:", str(cfg.source(key))))
                block = _dump(value, flow=False)
                lines.extend((f"{pad}  {line}", None) for line in block.splitlines())
            elif key in OPTIONS_BY_KEY:
                lines.append((f"{pad}{name}: {_flow(value)}", str(cfg.source(key))))
            else:  # a compat key
                lines.append((f"{pad}{name}: {_flow(value)}",
                              f"{cfg.source(key)}; accepted, not used by gpu-agent"))

    doc = cfg.to_document()
    emit(doc, "", 0)
    lines.extend((f"# {name}: {_UNSET_SECTIONS[name]}", None) for name in SECTIONS
                 if name not in doc)
    width = min(max((len(text) for text, note in lines if note), default=0) + 2, 48)
    return "".join(
        f"{text.ljust(max(width, len(text) + 2))}# {note}\n" if note else f"{text}\n"
        for text, note in lines
    )


def config_json(cfg: Config) -> dict:
    """The effective configuration for `config show --json`: `config` is a loadable v1
    document; `sources` gives each key's source; `options` lists each option's names."""
    sources = {opt.key: str(cfg.source(opt.name)) for opt in OPTIONS if opt.key}
    sources.update({key: str(cfg.source(key)) for key in COMPAT_KEYS if key in cfg.compat})
    sources.update({name: str(cfg.source(name)) for name in SECTIONS})
    return {
        "configFile": cfg.config_file,
        "configFileSource": str(cfg.source("config_file")),
        "precedence": PRECEDENCE,
        "config": cfg.to_document(),
        "sources": sources,
        "options": [
            {
                "name": opt.name,
                "flag": opt.flag,
                "env": opt.env,
                "key": opt.key,
                "value": opt.kind.to_data(getattr(cfg, opt.name)),
                "source": str(cfg.source(opt.name)),
            }
            for opt in OPTIONS
        ],
    }


# ---------------------------------------------------------------------------------------------
# Command line.


def add_run_options(parser: argparse.ArgumentParser, shown: tuple[str, ...] | None = None) -> Any:
    """Add every option's flag to `parser` (dest: the option name; None when not given) in an
    argument group, and return the group. load_config(parser.parse_args(...)) reads them.
    `shown`: the options --help lists (the others are taken, as run's are, but not listed)."""
    group = parser.add_argument_group(
        "configuration",
        f"Each option is also an environment variable and a config-file key; {PRECEDENCE}. "
        f"See docs/configuration.md." + ("" if shown is None else
                                        " The command takes run's other options too (to read "
                                        "the same configuration); `gpu-agent run --help` "
                                        "lists them."),
    )
    for opt in OPTIONS:
        where = f"env {opt.env}" + (f", key {opt.key}" if opt.key else "")
        kwargs: dict[str, Any] = {
            "dest": opt.name,
            "default": None,
            "metavar": opt.kind.metavar,
            "help": f"{opt.help} ({where}; default {opt.describe_default()})".replace("%", "%%")
            if shown is None or opt.name in shown else argparse.SUPPRESS,
        }
        if isinstance(opt.kind, BoolKind):
            kwargs.update(nargs="?", const="true")  # --flag alone, --flag=false, --flag false
        elif isinstance(opt.kind, ChoiceListKind):
            kwargs["action"] = "append"  # repeated and/or comma-separated
        group.add_argument(opt.flag, *opt.aliases, **kwargs)
    return group


def add_state_command(sub: Any, name: str, func: Any, *, help: str,
                      description: str) -> argparse.ArgumentParser:
    """Register command `name`, which reads what an agent left in its state directory: it takes
    run's options (to find that directory) and --json, and runs `func(args)`."""
    p = sub.add_parser(
        name, allow_abbrev=False, help=help,
        description=f"{description} Takes run's options to find the state directory "
                    f"(--state-dir, GPU_AGENT_STATE_DIR, agent.stateDir).")
    add_run_options(p, shown=("config_file", "state_dir"))
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=func)
    return p


def _cmd_show(args: argparse.Namespace) -> int:
    cfg = load_config(args, os.environ)
    if args.json:
        print(json.dumps(config_json(cfg), indent=2))
    else:
        print(format_config(cfg), end="")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    check_config_file(args.file)
    print(f"{args.file}: ok")
    return 0


def add_cli(sub: Any) -> None:
    """Register `gpu-agent config show|check` on the top-level sub-parsers."""
    p = sub.add_parser(
        "config",
        help="show the effective configuration or check a config file",
        description=f"Configuration: NVIDIA's version: v1 file plus an agent: section; "
                    f"{PRECEDENCE}.",
    )
    csub = p.add_subparsers(dest="config_command", metavar="CONFIG_COMMAND")
    csub.required = True

    show = csub.add_parser(
        "show",
        allow_abbrev=False,
        help="print the effective configuration and where each value comes from",
        description="Print the effective configuration (flags given here, the environment, "
                    "the config file, defaults) with each value's source. The text output is "
                    "itself a valid config file.",
    )
    add_run_options(show)
    show.add_argument("--json", action="store_true",
                      help="print JSON: the config as a v1 document, and each value's source")
    show.set_defaults(func=_cmd_show)

    check = csub.add_parser(
        "check",
        allow_abbrev=False,
        help="check a config file: print 'FILE: ok', or the error and exit 2",
        description="Check FILE alone (the environment and flags are not read).",
    )
    check.add_argument("file", metavar="FILE", help="the config file to check")
    check.set_defaults(func=_cmd_check)
