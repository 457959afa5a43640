"""agent.config: NVIDIA's `version: v1` config file plus our `agent:` section, layered
flag > env > file > default, with precise errors, and `gpu-agent config show|check`.

In-process tests call load_config with explicit flag mappings and environments (never the
test runner's own environment); the CLI tests run `python -m agent config ...` as a process
with the config variables removed from its environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from conftest import DATA, ROOT, gpu_agent_cmd, run_gpu_agent
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.config import (
    OPTIONS,
    ConfigError,
    Source,
    add_run_options,
    check_config_file,
    config_json,
    format_config,
    load_config,
)
from agent.config.file import (
    SCHEMA,
    DeviceReplicas,
    Imex,
    ReplicatedResource,
    ReplicatedResources,
    ResourcePattern,
    Resources,
    Sharing,
)
from agent.config.kinds import FALSE_TEXT, TRUE_TEXT
from agent.constants import (
    DEFAULT_KUBELET_SOCKET,
    DEVICE_ID_STRATEGIES,
    DEVICE_LIST_STRATEGIES,
    MIG_STRATEGIES,
    NVML_SONAME,
    XID_ACTIONS,
)

CONFIGS = DATA / "configs"
ENV_VARS = [opt.env for opt in OPTIONS]
OPTION = {opt.name: opt for opt in OPTIONS}


def write(tmp_path: Path, data, name: str = "config.yaml") -> str:
    """Write `data` (text as is, anything else as YAML) and return the path."""
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return str(path)


def v1(**sections) -> dict:
    return {"version": "v1", **sections}


def from_file(tmp_path: Path, data):
    return load_config({"config_file": write(tmp_path, data)}, {})


def file_error(tmp_path: Path, data) -> tuple[str, str]:
    """The message of the ConfigError that loading `data` raises, and the file's path."""
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config({"config_file": path}, {})
    return str(info.value), path


def clean_env(**extra: str) -> dict:
    """This process's environment without any config variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------------
# Defaults and precedence.


def test_defaults_follow_nvidia():
    cfg = load_config({}, {})
    assert cfg.config_file is None
    assert cfg.mig_strategy == "none"
    assert cfg.fail_on_init_error is True
    assert cfg.driver_root == "/"
    assert cfg.dev_root == "/"
    assert cfg.pass_device_specs is False
    assert cfg.device_list_strategy == ("envvar",)
    assert cfg.device_id_strategy == "uuid"
    assert cfg.cdi_annotation_prefix == "cdi.k8s.io/"
    assert cfg.kubelet_socket == "/var/lib/kubelet/device-plugins/kubelet.sock"
    assert cfg.plugin_socket_dir == "/var/lib/kubelet/device-plugins"
    assert cfg.state_dir == "/var/lib/gpu-agent"
    assert cfg.nvml_library == "libnvidia-ml.so.1"
    assert cfg.nvml_library_explicit is None
    assert cfg.checkpoint_device_id_strategy == "uuid"
    assert cfg.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert cfg.reconcile_interval == 60.0
    assert cfg.resources == Resources() and cfg.sharing == Sharing() and cfg.imex == Imex()
    assert dict(cfg.compat) == {}
    assert all(cfg.source(opt.name).kind == "default" for opt in OPTIONS)


# name: (file value as written in YAML, env text, flag text, and the values they give).
# Each layer's value differs from the one below it, so the winner is always visible.
PRECEDENCE = {
    "mode": ("dra", "device-plugin", "dra", ("dra", "device-plugin", "dra")),
    "dra_reboot_taint": ("NoSchedule", "NoExecute", "NoSchedule",
                         ("NoSchedule", "NoExecute", "NoSchedule")),
    "dra_shared_gpus": (["0", "GPU-1"], "all", "2,3", (("0", "GPU-1"), ("all",), ("2", "3"))),
    "dra_dynamic_mig": ([1], "all", "GPU-2", (("1",), ("all",), ("GPU-2",))),
    "kubelet_dir": ("/srv/kubelet", "/env/kubelet", "/flag/kubelet",
                    ("/srv/kubelet", "/env/kubelet", "/flag/kubelet")),
    "mig_strategy": ("single", "mixed", "single", ("single", "mixed", "single")),
    "fail_on_init_error": (False, "true", "false", (False, True, False)),
    "driver_root": ("/run/nvidia/driver", "/opt/driver", "/srv/driver",
                    ("/run/nvidia/driver", "/opt/driver", "/srv/driver")),
    "dev_root": ("/host", "/env-dev", "/flag-dev", ("/host", "/env-dev", "/flag-dev")),
    "pass_device_specs": (True, "false", "1", (True, False, True)),
    "device_list_strategy": (["volume-mounts", "cdi-annotations"], "cdi-cri", "envvar, cdi-cri",
                             (("volume-mounts", "cdi-annotations"), ("cdi-cri",),
                              ("envvar", "cdi-cri"))),
    "device_id_strategy": ("index", "uuid", "index", ("index", "uuid", "index")),
    "cdi_annotation_prefix": ("file.example.com/", "env.example.com/", "flag.example.com/",
                              ("file.example.com/", "env.example.com/", "flag.example.com/")),
    "kubelet_socket": ("/run/k/kubelet.sock", "/env/kubelet.sock", "/flag/kubelet.sock",
                       ("/run/k/kubelet.sock", "/env/kubelet.sock", "/flag/kubelet.sock")),
    "state_dir": ("/srv/state", "/env/state", "/flag/state",
                  ("/srv/state", "/env/state", "/flag/state")),
    "mps_root": ("/srv/mps", "/env/mps", "/flag/mps", ("/srv/mps", "/env/mps", "/flag/mps")),
    "mps_control": ("/srv/mpsc", "", "/flag/mpsc", ("/srv/mpsc", "", "/flag/mpsc")),
    "nvml_library": ("/opt/a/libnvidia-ml.so.1", "/opt/b/libnvidia-ml.so.1", NVML_SONAME,
                     ("/opt/a/libnvidia-ml.so.1", "/opt/b/libnvidia-ml.so.1", NVML_SONAME)),
    "checkpoint_device_id_strategy": ("index", "uuid", "index", ("index", "uuid", "index")),
    "pod_resources_socket": ("/run/pr/kubelet.sock", "", "/flag/pr.sock",
                             ("/run/pr/kubelet.sock", "", "/flag/pr.sock")),
    "reconcile_interval": ("5m", "90s", "1m30s", (300.0, 90.0, 90.0)),
    "ended_pod_grace": ("2m", "45s", "0", (120.0, 45.0, 0.0)),
    "journal_sync_interval": ("2s", "0", "250ms", (2.0, 0.0, 0.25)),
    "mig_check_interval": ("10s", "0", "1s500ms", (10.0, 0.0, 1.5)),
    "nvml_call_timeout": ("2s", "0", "500ms", (2.0, 0.0, 0.5)),
    "allocation_policy": ("packed", "best-effort", "packed", ("packed", "best-effort", "packed")),
    "replica_allocation_policy": ("packed", "distributed", "packed",
                                  ("packed", "distributed", "packed")),
    "disable_healthchecks": ("48,63", "all", "xids", ("48,63", "all", "xids")),
    "enable_healthchecks": ([13, 31], "all", "43", ("13,31", "all", "43")),
    "xid_policy": ("catalog", "nvidia", "catalog", ("catalog", "nvidia", "catalog")),
    "xid_actions": ({79: "reset"}, "48=ignore", "13=reboot,79=reset",
                    (((79, "reset"),), ((48, "ignore"),), ((13, "reboot"), (79, "reset")))),
    "recovery_quiet_period": ("2m", "30s", "0", (120.0, 30.0, 0.0)),
    "unhealthy_devices_file": ("/srv/iso.json", "", "/flag/iso.json",
                               ("/srv/iso.json", "", "/flag/iso.json")),
    "cdi_spec_dirs": (["/etc/cdi"], "/env/cdi,/run/cdi", "/flag/cdi",
                      (("/etc/cdi",), ("/env/cdi", "/run/cdi"), ("/flag/cdi",))),
    "dev_char_symlinks": (False, "true", "false", (False, True, False)),
    "metrics_address": ("127.0.0.1:9445", "", "[::1]:9500",
                        ("127.0.0.1:9445", "", "[::1]:9500")),
    "nfd_features_file": ("/etc/nfd/gpu", "", "/flag/gpu", ("/etc/nfd/gpu", "", "/flag/gpu")),
    "kubeconfig": ("/etc/gpu-agent/kubeconfig", "", "/flag/kubeconfig",
                   ("/etc/gpu-agent/kubeconfig", "", "/flag/kubeconfig")),
    "node_name": ("gpu-node-7", "env-node", "flag.node-1", ("gpu-node-7", "env-node", "flag.node-1")),
    "fault_events": (False, "true", "false", (False, True, False)),
    "node_condition": (False, "true", "false", (False, True, False)),
    "config_dir": ("/srv/gpu-configs", "", "/flag/configs",
                   ("/srv/gpu-configs", "", "/flag/configs")),
    "node_label": ("example.com/gpu-config", "env.example/cfg", "flag-label",
                   ("example.com/gpu-config", "env.example/cfg", "flag-label")),
    "default_config": ("a100", "h100-80gb", "", ("a100", "h100-80gb", "")),
    "fallback_strategies": (["empty"], "single,named", "named",
                            (("empty",), ("single", "named"), ("named",))),
}


def test_precedence_table_covers_every_option():
    assert set(PRECEDENCE) == {opt.name for opt in OPTIONS} - {"config_file"}


def _nest(key: str, value) -> dict:
    out = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


@pytest.mark.parametrize("name", sorted(PRECEDENCE))
def test_flag_beats_env_beats_file_beats_default(tmp_path, name):
    opt = OPTION[name]
    file_value, env_text, flag_text, (from_file_, from_env, from_flag) = PRECEDENCE[name]
    path = write(tmp_path, v1(**_nest(opt.key, file_value)))
    default = load_config({}, {})
    assert default.source(name).kind == "default"

    cfg = load_config({"config_file": path}, {})
    assert getattr(cfg, name) == from_file_ != getattr(default, name)
    assert cfg.source(name) == Source("file", path)

    cfg = load_config({"config_file": path}, {opt.env: env_text})
    assert getattr(cfg, name) == from_env
    assert cfg.source(name) == Source("env", opt.env)

    cfg = load_config({"config_file": path, name: flag_text}, {opt.env: env_text})
    assert getattr(cfg, name) == from_flag
    assert cfg.source(name) == Source("flag", opt.flag)


def test_config_file_flag_beats_config_file_env(tmp_path):
    by_env = write(tmp_path, v1(flags={"migStrategy": "single"}), "env.yaml")
    by_flag = write(tmp_path, v1(flags={"migStrategy": "mixed"}), "flag.yaml")
    cfg = load_config({}, {"CONFIG_FILE": by_env})
    assert (cfg.config_file, cfg.mig_strategy) == (by_env, "single")
    assert cfg.source("config_file") == Source("env", "CONFIG_FILE")
    cfg = load_config({"config_file": by_flag}, {"CONFIG_FILE": by_env})
    assert (cfg.config_file, cfg.mig_strategy) == (by_flag, "mixed")
    assert cfg.source("config_file") == Source("flag", "--config")
    cfg = load_config({"config_file": ""}, {"CONFIG_FILE": by_env})  # --config= : no file
    assert (cfg.config_file, cfg.mig_strategy) == (None, "none")


def test_dev_root_follows_the_driver_root_wherever_it_comes_from(tmp_path):
    assert load_config({"driver_root": "/d"}, {}).dev_root == "/d"
    cfg = load_config({}, {"NVIDIA_DRIVER_ROOT": "/e"})
    assert cfg.dev_root == "/e"
    assert str(cfg.source("dev_root")) == "default (follows the driver root)"
    # An empty dev root, at any layer, means the driver root (as in NVIDIA's plugin).
    path = write(tmp_path, v1(flags={"nvidiaDriverRoot": "/f", "nvidiaDevRoot": "/dev-root"}))
    cfg = load_config({"config_file": path}, {"NVIDIA_DEV_ROOT": ""})
    assert cfg.dev_root == "/f"
    assert str(cfg.source("dev_root")) == "env NVIDIA_DEV_ROOT (follows the driver root)"


def test_empty_kubelet_socket_means_no_kubelet():
    cfg = load_config({"kubelet_socket": ""}, {})
    assert cfg.kubelet_socket == "" and cfg.plugin_socket_dir is None


def test_explicit_nvml_library_is_passed_through():
    cfg = load_config({}, {"GPU_AGENT_NVML_LIBRARY": "/opt/nvml/libnvidia-ml.so.1"})
    assert cfg.nvml_library_explicit == "/opt/nvml/libnvidia-ml.so.1"


@pytest.mark.parametrize("text", TRUE_TEXT + FALSE_TEXT)
def test_booleans_take_urfave_cli_spellings(text):
    expected = text in TRUE_TEXT
    assert load_config({}, {"FAIL_ON_INIT_ERROR": text}).fail_on_init_error is expected
    assert load_config({"pass_device_specs": text}, {}).pass_device_specs is expected


def test_device_list_strategy_from_repeated_and_comma_separated_flags():
    cfg = load_config({"device_list_strategy": ["envvar", "cdi-annotations,cdi-cri"]}, {})
    assert cfg.device_list_strategy == ("envvar", "cdi-annotations", "cdi-cri")


def test_every_value_given_is_checked_even_when_overridden(tmp_path):
    with pytest.raises(ConfigError, match=r"^MIG_STRATEGY: "):
        load_config({"mig_strategy": "none"}, {"MIG_STRATEGY": "bogus"})
    path = write(tmp_path, v1(flags={"migStrategy": "bogus"}))
    with pytest.raises(ConfigError, match=r"^flags\.migStrategy: "):
        load_config({"config_file": path, "mig_strategy": "none"}, {})


def test_null_in_the_file_means_not_set(tmp_path):
    cfg = from_file(tmp_path, "version: v1\nflags:\n  migStrategy:\n  plugin: ~\nsharing:\n")
    assert cfg.mig_strategy == "none" and cfg.source("mig_strategy").kind == "default"
    assert cfg.source("sharing").kind == "default"


def test_load_config_reads_an_argparse_namespace_and_ignores_other_attributes():
    ns = argparse.Namespace(mig_strategy="mixed", func=print, command="run", verbose=True)
    assert load_config(ns, {}).mig_strategy == "mixed"


# ---------------------------------------------------------------------------------------------
# Bad values: each names the key (or env var, or flag) and where it came from.


def test_bad_choice_in_the_file_names_key_and_file(tmp_path):
    message, path = file_error(tmp_path, v1(flags={"migStrategy": "bogus"}))
    assert message == f"flags.migStrategy: 'bogus' is not one of none, single, mixed ({path})"


def test_bad_choice_in_the_environment_names_the_variable():
    with pytest.raises(ConfigError) as info:
        load_config({}, {"MIG_STRATEGY": "bogus"})
    assert str(info.value) == "MIG_STRATEGY: 'bogus' is not one of none, single, mixed (environment)"
    assert info.value.exit_code == 2


def test_bad_choice_on_the_command_line_names_the_flag():
    with pytest.raises(ConfigError) as info:
        load_config({"device_id_strategy": "serial"}, {})
    assert str(info.value) == "--device-id-strategy: 'serial' is not one of uuid, index (command line)"


NOT_A_BOOLEAN = ("is not a boolean; use true or false (also accepted: 1, t, T, 0, f, F, TRUE, "
                 "FALSE, True, False)")
# (where: an environment variable or the file key the error names, the value set there, the
# problem); an item suffix such as "[1]" is only named.
BAD_VALUES = [
    ("FAIL_ON_INIT_ERROR", "maybe", f"'maybe' {NOT_A_BOOLEAN}"),
    ("FAIL_ON_INIT_ERROR", "", f"'' {NOT_A_BOOLEAN}"),
    ("PASS_DEVICE_SPECS", "yes", f"'yes' {NOT_A_BOOLEAN}"),
    ("DEVICE_LIST_STRATEGY", "envvar,bogus",
     "'bogus' is not one of envvar, volume-mounts, cdi-annotations, cdi-cri"),
    ("DEVICE_LIST_STRATEGY", "envvar,,cdi-cri",
     "'envvar,,cdi-cri' has an empty item; separate the values with single commas"),
    ("DEVICE_LIST_STRATEGY", "envvar,envvar", "'envvar' is listed twice"),
    ("NVIDIA_DRIVER_ROOT", "run/nvidia", "'run/nvidia' is not an absolute path"),
    ("GPU_AGENT_STATE_DIR", "", "must not be empty"),
    ("GPU_AGENT_NVML_LIBRARY", "nvml.so",
     "'nvml.so' is neither libnvidia-ml.so.1 (looked up under the driver root) nor an "
     "absolute path"),
    ("KUBELET_SOCKET", "kubelet.sock", "'kubelet.sock' is not an absolute path"),
    ("CDI_ANNOTATION_PREFIX", "", "must not be empty"),
    ("DEVICE_ID_STRATEGY", "UUID", "'UUID' is not one of uuid, index"),
    ("CHECKPOINT_DEVICE_ID_STRATEGY", "gpu", "'gpu' is not one of uuid, index"),
    ("GPU_AGENT_RECONCILE_INTERVAL", "60", "'60' is not a duration such as \"60s\" or \"1m30s\""),
    ("flags.migStrategy", 3, "expected one of none, single, mixed, got integer 3"),
    ("flags.failOnInitError", "yes please",
     "expected a boolean (true or false), got string 'yes please'"),
    ("flags.failOnInitError", "true", "expected a boolean (true or false), got string 'true'"),
    ("flags.nvidiaDriverRoot", ["/"], "expected a string, got a list"),
    ("flags.nvidiaDriverRoot", "run/nvidia/driver", "'run/nvidia/driver' is not an absolute path"),
    ("flags.nvidiaDriverRoot", "", "must not be empty"),
    ("flags.nvidiaDevRoot", "dev", "'dev' is not an absolute path"),
    ("flags.plugin.deviceListStrategy[1]", ["envvar", "bogus"],
     "'bogus' is not one of envvar, volume-mounts, cdi-annotations, cdi-cri"),
    ("flags.plugin.deviceListStrategy", "envvar,cdi-cri",
     "'envvar,cdi-cri' is not one of envvar, volume-mounts, cdi-annotations, cdi-cri; in the "
     "file, give several as a YAML list, e.g. [envvar, cdi-cri]"),
    ("flags.plugin.deviceListStrategy", [],
     "empty list; give at least one of envvar, volume-mounts, cdi-annotations, cdi-cri"),
    ("flags.plugin.deviceListStrategy[1]", ["envvar", "envvar"], "'envvar' is listed twice"),
    ("flags.plugin.deviceListStrategy", {"envvar": True},
     "expected a string or a list of strings, got a mapping"),
    ("flags.plugin.deviceListStrategy[0]", [1],
     "expected one of envvar, volume-mounts, cdi-annotations, cdi-cri, got integer 1"),
    ("flags.plugin.cdiAnnotationPrefix", "cdi k8s/",
     "'cdi k8s/' contains whitespace or control characters"),
    ("flags.plugin.kubeletSocket", "kubelet.sock", "'kubelet.sock' is not an absolute path"),
    ("flags.plugin.passDeviceSpecs", 1, "expected a boolean (true or false), got integer 1"),
    ("flags.gfd.sleepInterval", "sixty seconds",
     "'sixty seconds' is not a duration such as \"60s\" or \"1m30s\""),
    ("flags.gfd.oneshot", "no", "expected a boolean (true or false), got string 'no'"),
    ("flags.deviceDiscoveryStrategy", "cuda", "'cuda' is not one of auto, nvml, tegra"),
    ("flags.plugin", "envvar", "expected a mapping, got string 'envvar'"),
    ("agent.stateDir", "", "must not be empty"),
    ("agent.stateDir", "state", "'state' is not an absolute path"),
    ("agent.stateDir", 7, "expected a string, got integer 7"),
    ("agent.nvmlLibrary", "libnvidia-ml.so",
     "'libnvidia-ml.so' is neither libnvidia-ml.so.1 (looked up under the driver root) "
     "nor an absolute path"),
    ("agent.nvmlLibrary", "lib/libnvidia-ml.so.1",
     "'lib/libnvidia-ml.so.1' is not an absolute path"),
    ("agent.checkpointDeviceIDStrategy", "UUID", "'UUID' is not one of uuid, index"),
    ("agent.podResourcesSocket", "kubelet.sock", "'kubelet.sock' is not an absolute path"),
    ("agent.reconcileInterval", 60,
     'expected a duration such as "60s" or "1m30s", got integer 60'),
    ("agent.reconcileInterval", "-5s",
     "'-5s' is not a duration such as \"60s\" or \"1m30s\"; it must not be negative"),
    ("agent.reconcileInterval", "1ms", "'1ms' is too short: use 0 (off) or at least 0.1s"),
]


def at_key(key: str, value) -> dict:
    """A v1 document with `value` at the dotted `key` (without its item suffix)."""
    *parents, last = key.split("[")[0].split(".")
    doc: dict = {}
    node = doc
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return v1(**doc)


def bad_value(tmp_path: Path, where: str, value) -> tuple[str, str]:
    """The message of the ConfigError for `value` set at `where` (an environment variable, in
    capitals, or a file key), and the source the message should name."""
    if where.isupper():
        with pytest.raises(ConfigError) as info:
            load_config({}, {where: value})
        return str(info.value), "environment"
    return file_error(tmp_path, at_key(where, value))


@pytest.mark.parametrize("where, value, problem", BAD_VALUES,
                         ids=[where for where, _, _ in BAD_VALUES])
def test_bad_values_name_where_they_came_from(tmp_path, where, value, problem):
    message, source = bad_value(tmp_path, where, value)
    assert message == f"{where}: {problem} ({source})"


def test_undecodable_bytes_in_the_environment_are_refused():
    # os.environ holds bytes that are not UTF-8 as lone surrogates (surrogateescape).
    with pytest.raises(ConfigError) as info:
        load_config({}, {"GPU_AGENT_STATE_DIR": "/srv/\udcff"})
    assert str(info.value) == ("GPU_AGENT_STATE_DIR: '/srv/\\udcff' is not valid UTF-8 text "
                               "(environment)")


@pytest.mark.parametrize("name, value, problem", [
    ("fail_on_init_error", "maybe", "--fail-on-init-error: 'maybe' is not a boolean"),
    ("driver_root", "relative", "--driver-root: 'relative' is not an absolute path"),
    ("device_list_strategy", ["envvar", "nope"], "--device-list-strategy: 'nope' is not one of"),
])
def test_bad_flag_values_name_the_flag(name, value, problem):
    with pytest.raises(ConfigError) as info:
        load_config({name: value}, {})
    assert str(info.value).startswith(problem)
    assert str(info.value).endswith(" (command line)")


# ---------------------------------------------------------------------------------------------
# The file itself: version, syntax, duplicates, unreadable files, unknown keys.


@pytest.mark.parametrize("text, message", [
    ("version: v2\n", "version: unsupported version 'v2'; this agent reads 'version: v1'"),
    ("version: 1\n", "version: unsupported version integer 1; this agent reads 'version: v1'"),
    ("- version: v1\n", "(top level): expected a mapping, got a list"),
])
def test_a_version_given_must_be_v1(tmp_path, text, message):
    got, path = file_error(tmp_path, text)
    assert got == f"{message} ({path})"


@pytest.mark.parametrize("text, said", [
    ("", "is empty: read as 'version: v1' with nothing set"),
    ("# only comments\n", "is empty: read as 'version: v1' with nothing set"),
    ("flags:\n  migStrategy: single\n", "has no version: read as 'version: v1'"),
], ids=["empty", "comments", "no-version"])
def test_an_empty_file_or_one_without_version_is_v1_as_nvidia_reads_it(tmp_path, caplog, text,
                                                                        said):
    # NVIDIA's parseConfigFrom defaults the version to v1 (its CHANGELOG: "Allow an empty
    # config file and default to 'version: v1'"), so a file its DaemonSet loads loads here
    path = str(tmp_path / "config.yaml")
    (tmp_path / "config.yaml").write_text(text)
    with caplog.at_level("INFO"):
        cfg = load_config({"config_file": path}, {})
    assert cfg.mig_strategy == ("single" if "single" in text else "none")
    assert f"config file {path} {said}" in caplog.text


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    got, path = file_error(tmp_path, "version: v1\nflags:\n  migStrategy: none\n plugin: {\n")
    assert got.startswith(f"{path}: invalid YAML at line ")
    assert "line 4" in got or "line 5" in got


def test_yaml_syntax_error_with_a_bad_indent(tmp_path):
    got, path = file_error(tmp_path, "version: v1\nflags:\n  migStrategy: none\n   bad: x: y\n")
    assert got == (f"{path}: invalid YAML at line 4, column 7: mapping values are not "
                   f"allowed here")


def test_json_escapes_beyond_the_basic_plane_are_read_as_json_means_them(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(v1(agent={"stateDir": "/srv/\U0001f600"})))  # "\ud83d\ude00"
    assert load_config({"config_file": str(path)}, {}).state_dir == "/srv/\U0001f600"
    path.write_text('{"version": "v1", "agent": {"stateDir": "/srv/\\ud83d"}}')
    with pytest.raises(ConfigError, match=r"holds an unpaired surrogate escape"):
        load_config({"config_file": str(path)}, {})


def test_a_file_saved_on_windows_loads(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"\xef\xbb\xbfversion: v1\r\nflags:\r\n  migStrategy: mixed\r\n")
    assert load_config({"config_file": str(path)}, {}).mig_strategy == "mixed"


def test_more_than_one_yaml_document_is_refused(tmp_path):
    got, path = file_error(tmp_path, "version: v1\n---\nversion: v1\n")
    assert got == (f"{path}: invalid YAML at line 2, column 1: but found another document "
                   f"(expected a single document in the stream at line 1)")


def test_duplicate_keys_are_refused_with_both_lines(tmp_path):
    text = "version: v1\nflags:\n  migStrategy: none\n  failOnInitError: true\n  migStrategy: mixed\n"
    got, path = file_error(tmp_path, text)
    assert got == f"flags.migStrategy: duplicate key (first at line 3, again at line 5) ({path})"


def test_unreadable_file_names_the_file_and_who_named_it(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as info:
        load_config({}, {"CONFIG_FILE": missing})
    assert str(info.value) == (f"{missing}: cannot read the config file: No such file or "
                               f"directory (from CONFIG_FILE)")
    with pytest.raises(ConfigError) as info:
        load_config({"config_file": str(tmp_path)}, {})
    assert str(info.value) == (f"{tmp_path}: cannot read the config file: Is a directory "
                               f"(from --config)")


def test_a_file_that_is_not_text_is_refused(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"version: v1\n\xff\xfe\n")
    with pytest.raises(ConfigError, match=r"cannot read the config file: not UTF-8 text"):
        load_config({"config_file": str(path)}, {})


def test_a_file_without_read_permission_is_refused():
    """Root reads any file through its capabilities to override file permissions, so as root
    the check runs without them (setpriv drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from
    the bounding set): still root, so the interpreter and the checkout are readable wherever
    they live (a 0700 home, pyenv's libpython), and only the file's own mode (0) stands in
    the way, as for the agent's unit run as any user without those capabilities."""
    with tempfile.TemporaryDirectory(prefix="gacfg") as tmp:
        path = Path(write(Path(tmp), v1()))
        path.chmod(0)
        drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
        cmd = (drop if os.geteuid() == 0 else []) + gpu_agent_cmd("config", "check", str(path))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"{path}: cannot read the config file: Permission denied" in proc.stderr


_TS = {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}


@pytest.mark.parametrize("data, key", [
    (v1(bogus=1), "bogus"),
    (v1(flags={"bogus": 1}), "flags.bogus"),
    (v1(flags={"plugin": {"bogus": 1}}), "flags.plugin.bogus"),
    (v1(flags={"gfd": {"bogus": 1}}), "flags.gfd.bogus"),
    (v1(agent={"bogus": 1}), "agent.bogus"),
    (v1(resources={"bogus": []}), "resources.bogus"),
    (v1(resources={"gpus": [{"pattern": "*", "name": "gpu", "bogus": 1}]}),
     "resources.gpus[0].bogus"),
    (v1(sharing={"bogus": {}}), "sharing.bogus"),
    (v1(sharing={"timeSlicing": {**_TS, "bogus": 1}}), "sharing.timeSlicing.bogus"),
    (v1(sharing={"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2, "memoryGB": 2}]}}),
     "sharing.timeSlicing.resources[0].memoryGB"),
    (v1(sharing={"mps": {**_TS, "bogus": 1}}), "sharing.mps.bogus"),
    (v1(imex={"bogus": 1}), "imex.bogus"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unknown_keys_are_refused_at_every_level(tmp_path, data, key):
    message, path = file_error(tmp_path, data)
    assert message.startswith(f"{key}: unknown key")
    assert message.endswith(f" ({path})")


def test_unknown_key_suggests_the_close_one(tmp_path):
    message, path = file_error(tmp_path, v1(flags={"migStrateg": "none"}))
    assert message == f"flags.migStrateg: unknown key (did you mean 'migStrategy'?) ({path})"


def test_agent_section_accepts_only_the_keys_defined_now(tmp_path):
    message, path = file_error(tmp_path, v1(agent={"xidActions": {"48": "isolate"}}))
    assert message == (f"agent.xidActions: unknown key; expected one of: "
                       f"{', '.join(SCHEMA['agent'])} ({path})")
    assert list(SCHEMA["agent"])[:2] == ["stateDir", "nvmlLibrary"]


def test_a_yaml_key_that_is_not_a_string_is_refused(tmp_path):
    # YAML 1.1 reads an unquoted `on` as the boolean true.
    message, path = file_error(tmp_path, "version: v1\nflags:\n  on: true\n")
    assert message.startswith("flags.True: unknown key True (a boolean true; keys are strings")


# ---------------------------------------------------------------------------------------------
# resources, sharing, imex.


def test_resources_names_are_completed_with_the_nvidia_prefix(tmp_path):
    cfg = from_file(tmp_path, v1(resources={
        "gpus": [{"pattern": "*A100*", "name": "a100"}, {"pattern": "*", "name": "nvidia.com/gpu"}],
        "mig": [{"pattern": "1g.5gb", "name": "mig-1g.5gb"}],
    }))
    assert cfg.resources == Resources(
        gpus=(ResourcePattern("*A100*", "nvidia.com/a100"), ResourcePattern("*", "nvidia.com/gpu")),
        mig=(ResourcePattern("1g.5gb", "nvidia.com/mig-1g.5gb"),),
    )


def _ts(**resource) -> dict:
    return v1(sharing={"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2, **resource}]}})


_R0 = "sharing.timeSlicing.resources[0]"


@pytest.mark.parametrize("data, key, problem", [
    (_ts(replicas=1), f"{_R0}.replicas",
     "1 replicas: must be at least 2 (1 would not share the device)"),
    (_ts(replicas="4"), f"{_R0}.replicas",
     "expected an integer number of replicas, got string '4'"),
    (_ts(replicas=True), f"{_R0}.replicas",
     "expected an integer number of replicas, got boolean true"),
    (v1(sharing={"timeSlicing": {"resources": [{"name": "gpu"}]}}), f"{_R0}.replicas",
     "missing (required)"),
    (v1(sharing={"timeSlicing": {"resources": [{"replicas": 2}]}}), f"{_R0}.name",
     "missing (required)"),
    (_ts(name="GPU"), f"{_R0}.name",
     "'GPU' is not a valid resource name: after nvidia.com/ use lower-case letters, digits, "
     "'-' and '.', starting and ending with a letter or digit"),
    (_ts(name="example.com/gpu"), f"{_R0}.name",
     "'example.com/gpu' is not a valid resource name: only names in nvidia.com/ are supported"),
    (_ts(name="g" * 60), f"{_R0}.name",
     f"'nvidia.com/{'g' * 60}' is longer than 63 characters"),
    (_ts(rename="Shared GPU"), f"{_R0}.rename",
     "'Shared GPU' is not a valid resource name: after nvidia.com/ use lower-case letters, "
     "digits, '-' and '.', starting and ending with a letter or digit"),
    (_ts(devices="some"), f"{_R0}.devices",
     "expected 'all', a count, or a list of GPU indexes, MIG indexes (GPU:MIG) or UUIDs, got "
     "string 'some'"),
    (_ts(devices=0), f"{_R0}.devices", "a count of devices must be > 0, got 0"),
    (_ts(devices=[]), f"{_R0}.devices",
     "empty list: use 'all', a count, or a list of devices"),
    (_ts(devices=[0, "GPU-xyz"]), f"{_R0}.devices[1]",
     "string 'GPU-xyz' is not a GPU index, a MIG index (GPU:MIG) or a GPU-/MIG- UUID"),
    (_ts(devices=[0, "0"]), f"{_R0}.devices[1]", "'0' is listed twice"),
    (_ts(devices=[-1]), f"{_R0}.devices[0]", "-1 is not a GPU index (must be >= 0)"),
    # gpu-agent's per-GPU counts: {device: <ref>, replicas: <n>}
    (_ts(devices=[{"device": 0, "replicas": 1}]), f"{_R0}.devices[0].replicas",
     "1 replicas: must be at least 2 (1 would not share the device)"),
    (_ts(devices=[{"device": "x", "replicas": 2}]), f"{_R0}.devices[0].device",
     "string 'x' is not a GPU index, a MIG index (GPU:MIG) or a GPU-/MIG- UUID"),
    (_ts(devices=[0, {"replicas": 4}]), f"{_R0}.devices[1].device", "missing (required)"),
    (_ts(devices=[{"device": 0, "count": 4}]), f"{_R0}.devices[0].count",
     "unknown key 'count': an entry with its own count is {device: <index or UUID>, "
     "replicas: <n>}"),
    (_ts(devices=["1", {"device": 1, "replicas": 4}]), f"{_R0}.devices[1]",
     "'1' is listed twice"),
    # gpu-manager's names (docs/sharing.md): vcuda-core is a preset of MPS, vcuda-memory refused
    (v1(sharing={"mps": {"failRequestsGreaterThanOne": False, "resources": [
        {"name": "gpu", "replicas": 100, "rename": "tencent.com/vcuda-memory"}]}}),
     "sharing.mps.resources[0].rename",
     "tencent.com/vcuda-memory is not supported: as a second resource beside "
     "tencent.com/vcuda-core it needs gpu-manager's scheduler extender to put a pod's cores and "
     "memory on one GPU, which kubelet alone cannot; tencent.com/vcuda-core limits memory in "
     "proportion (docs/sharing.md)"),
    (_ts(replicas=100, rename="tencent.com/vcuda-core"), f"{_R0}.rename",
     "tencent.com/vcuda-core needs MPS to enforce its units: put it under sharing.mps"),
    (v1(sharing={"mps": {"failRequestsGreaterThanOne": False, "resources": [
        {"name": "gpu", "replicas": 10, "rename": "tencent.com/vcuda-core"}]}}),
     "sharing.mps.resources[0].replicas",
     "tencent.com/vcuda-core is 100 units a GPU, as gpu-manager counts it; got 10"),
    (v1(sharing={"mps": {"resources": [
        {"name": "gpu", "replicas": 100, "rename": "tencent.com/vcuda-core"}]}}),
     "sharing.mps.failRequestsGreaterThanOne",
     "must be false with tencent.com/vcuda-core: a container asks for several units"),
    (v1(sharing={"timeSlicing": {"renameByDefault": True}}), "sharing.timeSlicing.resources",
     "missing (required): list the resources to share, e.g. [{name: nvidia.com/gpu, "
     "replicas: 4}]"),
    (v1(sharing={"timeSlicing": {"resources": []}}), "sharing.timeSlicing.resources",
     "empty list: list the resources to share, e.g. [{name: nvidia.com/gpu, replicas: 4}]"),
    (v1(sharing={"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2},
                                               {"name": "nvidia.com/gpu", "replicas": 3}]}}),
     "sharing.timeSlicing.resources[1].name",
     "'nvidia.com/gpu' is already listed at sharing.timeSlicing.resources[0]"),
    (v1(sharing={"timeSlicing": _TS, "mps": _TS}), "sharing",
     "timeSlicing and mps are mutually exclusive; keep one"),
    (v1(sharing={"mps": {**_TS, "failRequestsGreaterThanOne": "no"}}),
     "sharing.mps.failRequestsGreaterThanOne",
     "expected a boolean (true or false), got string 'no'"),
    (v1(sharing={"timeSlicing": [_TS]}), "sharing.timeSlicing", "expected a mapping, got a list"),
    (v1(resources={"gpus": [{"name": "gpu"}]}), "resources.gpus[0].pattern", "missing (required)"),
    (v1(resources={"gpus": {"pattern": "*"}}), "resources.gpus", "expected a list, got a mapping"),
    (v1(resources={"mig": [{"pattern": "", "name": "m"}]}), "resources.mig[0].pattern",
     "must not be empty"),
    (v1(imex={"channelIDs": [1]}), "imex.channelIDs",
     "[1] is not supported: channelIDs must be [] or [0]"),
    (v1(imex={"channelIDs": "0"}), "imex.channelIDs",
     "expected a list of channel IDs, got string '0'"),
    (v1(imex={"channelIDs": ["0"]}), "imex.channelIDs[0]",
     "expected an integer channel ID, got string '0'"),
    (v1(imex={"required": "yes"}), "imex.required",
     "expected a boolean (true or false), got string 'yes'"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else None)
def test_bad_sections(tmp_path, data, key, problem):
    message, path = file_error(tmp_path, data)
    assert message == f"{key}: {problem} ({path})"


def test_sharing_values_and_defaults(tmp_path):
    cfg = from_file(tmp_path, v1(sharing={"timeSlicing": {"resources": [
        {"name": "gpu", "replicas": 4, "devices": [0, "1", "2:1",
                                                   "GPU-8b2c7e8e-6d31-4f2a-9a1e-2c5a4b0d9f11",
                                                   "MIG-GPU-8b2c7e8e-6d31-4f2a-9a1e-2c5a4b0d9f11/3/0"]},
        {"name": "nvidia.com/mig-1g.5gb", "rename": "small", "devices": 2, "replicas": 3},
    ]}}))
    assert cfg.sharing.strategy == "time-slicing"
    assert cfg.sharing.time_slicing == ReplicatedResources(
        resources=(
            ReplicatedResource("nvidia.com/gpu", 4, ("0", "1", "2:1",
                                                     "GPU-8b2c7e8e-6d31-4f2a-9a1e-2c5a4b0d9f11",
                                                     "MIG-GPU-8b2c7e8e-6d31-4f2a-9a1e-2c5a4b0d9f11/3/0")),
            ReplicatedResource("nvidia.com/mig-1g.5gb", 3, 2, "nvidia.com/small"),
        ),
        rename_by_default=False,
        fail_requests_greater_than_one=False,
    )


def test_a_devices_entry_may_carry_its_own_replica_count_and_reads_back(tmp_path):
    cfg = from_file(tmp_path, v1(sharing={"timeSlicing": {"resources": [
        {"name": "gpu", "replicas": 2, "devices": [0, {"device": 3, "replicas": 8},
                                                   {"device": "1:2", "replicas": 3}]}]}}))
    entry = cfg.sharing.time_slicing.resources[0]
    assert entry.devices == ("0", DeviceReplicas("3", 8), DeviceReplicas("1:2", 3))
    again = from_file(tmp_path, cfg.to_document())
    assert again.sharing == cfg.sharing


def test_mps_fails_requests_for_more_than_one_unless_told_otherwise(tmp_path):
    assert from_file(tmp_path, v1(sharing={"mps": _TS})).sharing.mps.fail_requests_greater_than_one
    relaxed = from_file(tmp_path, v1(sharing={"mps": {**_TS, "failRequestsGreaterThanOne": False}}))
    assert relaxed.sharing.mps.fail_requests_greater_than_one is False


def test_mps_with_mig_mixed_is_refused_naming_where_mixed_came_from(tmp_path):
    path = write(tmp_path, v1(sharing={"mps": _TS}))
    with pytest.raises(ConfigError) as info:
        load_config({"config_file": path}, {"MIG_STRATEGY": "mixed"})
    assert str(info.value) == (f"sharing.mps: MPS sharing does not work with MIG strategy "
                               f"'mixed' (set by env MIG_STRATEGY) ({path})")


def test_mps_with_mig_mixed_in_the_same_file(tmp_path):
    message, path = file_error(tmp_path, v1(flags={"migStrategy": "mixed"}, sharing={"mps": _TS}))
    assert message == (f"sharing.mps: MPS sharing does not work with MIG strategy 'mixed' "
                       f"(set by flags.migStrategy) ({path})")


def test_imex(tmp_path):
    assert from_file(tmp_path, v1(imex={"channelIDs": [0], "required": True})).imex == Imex((0,), True)
    assert from_file(tmp_path, v1(imex={})).imex == Imex()


def test_gfd_durations_as_nvidia_takes_them(tmp_path):
    assert from_file(tmp_path, v1(flags={"gfd": {"sleepInterval": "1m30s"}})).compat == {
        "flags.gfd.sleepInterval": "1m30s"}
    # A bare number is nanoseconds (Go's time.Duration in JSON).
    assert from_file(tmp_path, v1(flags={"gfd": {"sleepInterval": 60}})).compat == {
        "flags.gfd.sleepInterval": "60ns"}


# ---------------------------------------------------------------------------------------------
# NVIDIA's sample configs load unchanged.


def test_nvidia_documented_config_with_gfd_section():
    cfg = check_config_file(str(CONFIGS / "nvidia-flags-gfd.yaml"))
    assert (cfg.mig_strategy, cfg.fail_on_init_error, cfg.driver_root) == ("none", True, "/")
    assert (cfg.pass_device_specs, cfg.device_list_strategy, cfg.device_id_strategy) == (
        False, ("envvar",), "uuid")
    assert dict(cfg.compat) == {
        "flags.gfd.oneshot": False,
        "flags.gfd.noTimestamp": False,
        "flags.gfd.sleepInterval": "60s",
        "flags.gfd.outputFile": "/etc/kubernetes/node-feature-discovery/features.d/gfd",
    }


def test_nvidia_time_slicing_config():
    cfg = check_config_file(str(CONFIGS / "nvidia-time-slicing.yaml"))
    assert cfg.sharing == Sharing(time_slicing=ReplicatedResources(
        (ReplicatedResource("nvidia.com/gpu", 10),), rename_by_default=True,
        fail_requests_greater_than_one=True))


def test_nvidia_mps_config():
    cfg = check_config_file(str(CONFIGS / "nvidia-mps.yaml"))
    assert cfg.sharing.strategy == "mps"
    assert cfg.sharing.mps == ReplicatedResources(
        (ReplicatedResource("nvidia.com/gpu", 10),), fail_requests_greater_than_one=True)


def test_nvidia_mig_mixed_config():
    cfg = check_config_file(str(CONFIGS / "nvidia-mig-mixed.yaml"))
    assert cfg.mig_strategy == "mixed"
    assert [(r.name, r.replicas) for r in cfg.sharing.time_slicing.resources] == [
        ("nvidia.com/gpu", 2), ("nvidia.com/mig-1g.5gb", 2), ("nvidia.com/mig-2g.10gb", 2),
        ("nvidia.com/mig-3g.20gb", 3), ("nvidia.com/mig-7g.40gb", 7)]


def test_nvidia_running_config_json_as_the_plugin_logs_it():
    cfg = check_config_file(str(CONFIGS / "nvidia-running-config.json"))
    assert (cfg.mig_strategy, cfg.driver_root, cfg.dev_root) == ("single", "/run/nvidia/driver", "/")
    assert cfg.device_list_strategy == ("envvar", "cdi-annotations")
    assert cfg.resources.gpus == (ResourcePattern("*", "nvidia.com/gpu"),)
    assert cfg.imex == Imex()
    assert cfg.mps_root == "/run/nvidia/mps"
    assert dict(cfg.compat) == {
        "flags.gdsEnabled": False,
        "flags.mofedEnabled": False,
        "flags.deviceDiscoveryStrategy": "auto",
        "flags.plugin.nvidiaCTKPath": "/usr/bin/nvidia-ctk",
        "flags.plugin.containerDriverRoot": "/driver-root",
    }


def test_nvidia_resources_and_devices_config():
    cfg = check_config_file(str(CONFIGS / "nvidia-resources-devices.yaml"))
    first, second = cfg.sharing.time_slicing.resources
    assert first == ReplicatedResource("nvidia.com/a100", 4,
                                       ("0", "1", "2:0", "GPU-8b2c7e8e-6d31-4f2a-9a1e-2c5a4b0d9f11"),
                                       "nvidia.com/a100-shared")
    assert second == ReplicatedResource("nvidia.com/gpu", 2, 2)
    assert cfg.resources.mig == (ResourcePattern("1g.5gb", "nvidia.com/mig-small"),)


def test_gpu_agent_config_with_agent_section():
    cfg = check_config_file(str(CONFIGS / "gpu-agent.yaml"))
    assert cfg.state_dir == "/var/lib/gpu-agent"
    assert cfg.nvml_library == "/run/nvidia/driver/usr/lib64/libnvidia-ml.so.1"
    assert (cfg.driver_root, cfg.dev_root) == ("/run/nvidia/driver", "/")
    assert cfg.device_list_strategy == ("envvar", "cdi-annotations")


@pytest.mark.parametrize("path", sorted(CONFIGS.iterdir()), ids=lambda p: p.name)
def test_every_sample_round_trips_through_its_document(tmp_path, path):
    cfg = check_config_file(str(path))
    again = from_file(tmp_path, cfg.to_document())
    assert _values(again) == _values(cfg)


# ---------------------------------------------------------------------------------------------
# Showing: text and JSON.


def test_show_text_names_each_source_and_is_itself_a_config_file(tmp_path):
    path = write(tmp_path, v1(flags={"migStrategy": "single", "gdsEnabled": True},
                              sharing={"timeSlicing": _TS}))
    cfg = load_config({"config_file": path, "state_dir": "/flag/state"},
                      {"FAIL_ON_INIT_ERROR": "false"})
    text = format_config(cfg)
    lines = {line.split(":")[0].strip(): line for line in text.splitlines()}
    assert lines["migStrategy"].endswith(f"# file {path}")
    assert lines["failOnInitError"].endswith("# env FAIL_ON_INIT_ERROR")
    assert lines["stateDir"].endswith("# flag --state-dir")
    assert lines["deviceIDStrategy"].endswith("# default")
    assert lines["gdsEnabled"].endswith(f"# file {path}; accepted, not used by gpu-agent")
    assert lines["sharing"].endswith(f"# file {path}")
    assert f"# config file: {path} (flag --config)" in text
    assert "# imex: not set: no IMEX channels" in text
    again = from_file(tmp_path, text)
    assert _values(again) == _values(cfg)


def test_show_text_escapes_characters_yaml_reads_as_line_breaks(tmp_path):
    cfg = load_config({"state_dir": "/srv/caf\u00e9\x85\u2028"}, {})
    text = format_config(cfg)
    assert "\x85" not in text and "\u2028" not in text
    assert from_file(tmp_path, text).state_dir == "/srv/caf\u00e9\x85\u2028"
    assert "/srv/café" in format_config(load_config({"state_dir": "/srv/café"}, {}))


def test_show_json_has_the_document_sources_and_names():
    cfg = load_config({"mig_strategy": "mixed"}, {"KUBELET_SOCKET": "/k/kubelet.sock"})
    out = json.loads(json.dumps(config_json(cfg)))
    assert out["config"]["flags"]["migStrategy"] == "mixed"
    assert out["sources"]["flags.migStrategy"] == "flag --mig-strategy"
    assert out["sources"]["flags.plugin.kubeletSocket"] == "env KUBELET_SOCKET"
    assert out["sources"]["agent.stateDir"] == "default"
    assert out["sources"]["sharing"] == "default"
    assert out["configFile"] is None and out["configFileSource"] == "default"
    by_name = {o["name"]: o for o in out["options"]}
    assert by_name["mig_strategy"] == {"name": "mig_strategy", "flag": "--mig-strategy",
                                       "env": "MIG_STRATEGY", "key": "flags.migStrategy",
                                       "value": "mixed", "source": "flag --mig-strategy"}


# ---------------------------------------------------------------------------------------------
# add_run_options: the flags on another command's parser (`gpu-agent run` will use it).


def test_add_run_options_on_a_parser():
    parser = argparse.ArgumentParser(prog="gpu-agent run")
    add_run_options(parser)
    args = parser.parse_args([
        "--mig-strategy", "single", "--fail-on-init-error=false", "--pass-device-specs",
        "--device-list-strategy", "envvar", "--device-list-strategy=cdi-cri",
        "--nvidia-driver-root", "/run/nvidia/driver", "--config-file=",
    ])
    cfg = load_config(args, {})
    assert cfg.mig_strategy == "single"
    assert cfg.fail_on_init_error is False
    assert cfg.pass_device_specs is True
    assert cfg.device_list_strategy == ("envvar", "cdi-cri")
    assert cfg.driver_root == "/run/nvidia/driver"
    assert cfg.source("driver_root") == Source("flag", "--driver-root")
    assert cfg.config_file is None
    text = parser.format_help()
    for opt in OPTIONS:
        assert opt.flag in text and opt.env in text


def test_bool_flag_takes_a_separate_value_too():
    parser = argparse.ArgumentParser()
    add_run_options(parser)
    assert load_config(parser.parse_args(["--fail-on-init-error", "false"]), {}).fail_on_init_error is False
    assert load_config(parser.parse_args(["--fail-on-init-error"]), {}).fail_on_init_error is True


# ---------------------------------------------------------------------------------------------
# The CLI, as a process.


def test_cli_check_ok(tmp_path):
    path = str(CONFIGS / "nvidia-time-slicing.yaml")
    proc = run_gpu_agent("config", "check", path, env=clean_env(MIG_STRATEGY="bogus"))
    assert proc.stdout == f"{path}: ok\n"  # the environment is not read by check


def test_cli_check_bad_value_exits_2(tmp_path):
    path = write(tmp_path, v1(flags={"migStrategy": "bogus"}))
    proc = run_gpu_agent("config", "check", path, env=clean_env(), check=False)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (f"gpu-agent: error: flags.migStrategy: 'bogus' is not one of none, "
                           f"single, mixed ({path})\n")


def test_cli_check_missing_file_exits_2(tmp_path):
    path = str(tmp_path / "missing.yaml")
    proc = run_gpu_agent("config", "check", path, env=clean_env(), check=False)
    assert proc.returncode == 2
    assert proc.stderr == (f"gpu-agent: error: {path}: cannot read the config file: No such "
                           f"file or directory\n")


def test_cli_show_layers_flags_env_and_file(tmp_path):
    path = write(tmp_path, v1(flags={"migStrategy": "single", "plugin": {"deviceIDStrategy": "index"}}))
    proc = run_gpu_agent("config", "show", "--config", path, "--fail-on-init-error=false",
                         env=clean_env(MIG_STRATEGY="mixed"))
    lines = {line.split(":")[0].strip(): line for line in proc.stdout.splitlines()}
    assert lines["migStrategy"].startswith("  migStrategy: mixed ")
    assert lines["migStrategy"].endswith("# env MIG_STRATEGY")
    assert lines["failOnInitError"].startswith("  failOnInitError: false ")
    assert lines["failOnInitError"].endswith("# flag --fail-on-init-error")
    assert lines["deviceIDStrategy"].endswith(f"# file {path}")
    assert lines["deviceListStrategy"].endswith("# default")


def test_cli_show_bad_env_exits_2_naming_the_variable():
    proc = run_gpu_agent("config", "show", env=clean_env(DEVICE_ID_STRATEGY="serial"), check=False)
    assert proc.returncode == 2
    assert proc.stderr == ("gpu-agent: error: DEVICE_ID_STRATEGY: 'serial' is not one of uuid, "
                           "index (environment)\n")


def test_cli_show_json_round_trips_through_a_file(tmp_path):
    source = str(CONFIGS / "nvidia-resources-devices.yaml")
    first = run_gpu_agent("config", "show", "--json", "--pass-device-specs",
                          "--device-list-strategy=envvar,cdi-cri",
                          env=clean_env(CONFIG_FILE=source, GPU_AGENT_STATE_DIR="/srv/gpu-agent"))
    shown = json.loads(first.stdout)
    assert shown["configFileSource"] == "env CONFIG_FILE"
    assert shown["sources"]["flags.plugin.passDeviceSpecs"] == "flag --pass-device-specs"
    saved = tmp_path / "effective.json"
    saved.write_text(json.dumps(shown["config"]))
    again = json.loads(run_gpu_agent("config", "show", "--json", "--config", str(saved),
                                     env=clean_env()).stdout)
    assert again["config"] == shown["config"]
    assert set(again["sources"].values()) <= {"default", f"file {saved}",
                                              f"file {saved} (follows the driver root)"}


def test_cli_show_text_output_passes_check(tmp_path):
    shown = run_gpu_agent("config", "show", "--mig-strategy=mixed",
                          env=clean_env(CONFIG_FILE=str(CONFIGS / "nvidia-mig-mixed.yaml")))
    saved = write(tmp_path, shown.stdout, "shown.yaml")
    proc = run_gpu_agent("config", "check", saved, env=clean_env())
    assert proc.stdout == f"{saved}: ok\n"


def test_cli_help_lists_the_options():
    proc = run_gpu_agent("config", "show", "--help", env=clean_env())
    for opt in OPTIONS:
        assert opt.flag in proc.stdout


# ---------------------------------------------------------------------------------------------
# Properties.


def _values(cfg) -> dict:
    values = cfg.values()
    del values["config_file"]
    return values


_segment = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"),
    min_size=1, max_size=8,
)
ABS_PATH = st.one_of(st.just("/"), st.lists(_segment, min_size=1, max_size=3).map(
    lambda parts: "/" + "/".join(parts)))
_label = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,6}[a-z0-9])?\Z")

VALUES = {
    "mig_strategy": st.sampled_from(MIG_STRATEGIES),
    "fail_on_init_error": st.booleans(),
    "driver_root": ABS_PATH,
    "dev_root": st.one_of(st.just(""), ABS_PATH),
    "pass_device_specs": st.booleans(),
    "device_list_strategy": st.lists(st.sampled_from(DEVICE_LIST_STRATEGIES), min_size=1,
                                     max_size=4, unique=True).map(tuple),
    "device_id_strategy": st.sampled_from(DEVICE_ID_STRATEGIES),
    "cdi_annotation_prefix": st.lists(_label, min_size=1, max_size=3).map(
        lambda labels: ".".join(labels) + "/"),
    "kubelet_socket": st.one_of(st.just(""), st.just(DEFAULT_KUBELET_SOCKET), ABS_PATH),
    "state_dir": ABS_PATH,
    "nvml_library": st.one_of(st.just(NVML_SONAME), ABS_PATH),
    "checkpoint_device_id_strategy": st.sampled_from(DEVICE_ID_STRATEGIES),
    "pod_resources_socket": st.one_of(st.just(""), ABS_PATH),
    "reconcile_interval": st.one_of(st.just(0.0), st.integers(1, 86400).map(float),
                                    st.sampled_from([0.1, 0.25, 1.5, 2.75])),
    "ended_pod_grace": st.sampled_from((0.0, 0.5, 30.0, 300.0)),
    "journal_sync_interval": st.sampled_from((0.0, 0.05, 1.0, 2.5)),
    "mig_check_interval": st.sampled_from((0.0, 0.5, 5.0, 60.0)),
    "nvml_call_timeout": st.sampled_from((0.0, 0.5, 5.0, 30.0)),
    "allocation_policy": st.sampled_from(("best-effort", "packed")),
    "replica_allocation_policy": st.sampled_from(("distributed", "packed")),
    "disable_healthchecks": st.sampled_from(("", "all", "xids", "48", "13,31,79")),
    "xid_policy": st.sampled_from(("nvidia", "catalog")),
    "xid_actions": st.dictionaries(st.integers(0, 2000), st.sampled_from(XID_ACTIONS),
                                   max_size=3).map(lambda d: tuple(sorted(d.items()))),
    "recovery_quiet_period": st.sampled_from((0.0, 1.0, 60.0, 90.5)),
    "unhealthy_devices_file": st.one_of(st.just(""), ABS_PATH),
    "dev_char_symlinks": st.booleans(),
    "metrics_address": st.sampled_from(("", ":9445", "0.0.0.0:0", "[::]:9500", "node-1:65535")),
    "nfd_features_file": st.one_of(st.just(""), ABS_PATH),
    "kubeconfig": st.one_of(st.just(""), ABS_PATH),
    "node_name": st.sampled_from(("", "node-1", "gpu.rack-3.example")),
    "fault_events": st.booleans(),
    "node_condition": st.booleans(),
    # a directory that is not there: "/" or "/etc" would hold files, which named configs choose
    "config_dir": st.one_of(st.just(""), ABS_PATH.map(lambda p: "/nonexistent" + p.rstrip("/"))),
    "node_label": st.sampled_from(("nvidia.com/device-plugin.config", "example.com/gpu")),
    "default_config": st.sampled_from(("", "a100", "h100_80gb.v2")),
    "fallback_strategies": st.permutations(("named", "single", "empty")).flatmap(
        lambda p: st.integers(1, 3).map(lambda n: tuple(p[:n]))),
}
LAYERS = ("file", "env", "flag")


def _text(name: str, value, draw) -> str:
    """The flag / env form of `value`, in any spelling the parser accepts."""
    if isinstance(value, bool):
        return draw(st.sampled_from(TRUE_TEXT if value else FALSE_TEXT))
    return OPTION[name].kind.to_text(value)


@st.composite
def layered(draw):
    """For some options, values at some layers: {name: {layer: value}}."""
    plan = {}
    for name in draw(st.sets(st.sampled_from(sorted(VALUES)))):
        layers = draw(st.sets(st.sampled_from(LAYERS), min_size=1))
        plan[name] = {layer: draw(VALUES[name]) for layer in layers}
    flags, env, doc = {}, {}, {"version": "v1"}
    for name, at in plan.items():
        opt = OPTION[name]
        if "flag" in at:
            flags[name] = _text(name, at["flag"], draw)
        if "env" in at:
            env[opt.env] = _text(name, at["env"], draw)
        if "file" in at:
            node = doc
            *parents, leaf = opt.key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = opt.kind.to_data(at["file"])
    return plan, flags, env, doc


_SETTINGS = settings(max_examples=150, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(layered())
def test_property_the_highest_layer_wins(tmp_path, case):
    plan, flags, env, doc = case
    path = write(tmp_path, doc)
    cfg = load_config({**flags, "config_file": path}, env)
    for name in VALUES:
        at = plan.get(name, {})
        winner = next((layer for layer in reversed(LAYERS) if layer in at), "default")
        expected = at[winner] if winner != "default" else OPTION[name].default
        if name == "dev_root" and expected == "":
            expected = cfg.driver_root
        assert getattr(cfg, name) == expected, name
        assert cfg.source(name).kind == winner, name


resource_names = st.lists(_label, min_size=1, max_size=2).map(".".join).flatmap(
    lambda short: st.sampled_from([short, f"nvidia.com/{short}"]))
device_refs = st.one_of(
    st.integers(0, 15).map(str),
    st.tuples(st.integers(0, 7), st.integers(0, 6)).map(lambda t: f"{t[0]}:{t[1]}"),
    st.uuids().map(lambda u: f"GPU-{u}"),
    st.uuids().map(lambda u: f"MIG-{u}"),
    st.tuples(st.uuids(), st.integers(0, 14), st.integers(0, 7)).map(
        lambda t: f"MIG-GPU-{t[0]}/{t[1]}/{t[2]}"),
)
replicated_items = st.lists(
    st.fixed_dictionaries(
        {"name": resource_names, "replicas": st.integers(2, 64)},
        optional={
            "rename": resource_names,
            "devices": st.one_of(st.just("all"), st.integers(1, 16),
                                 st.lists(device_refs, min_size=1, max_size=4, unique=True)),
        },
    ),
    min_size=1, max_size=4,
    unique_by=lambda item: item["name"].split("/")[-1],
)
replicated = st.fixed_dictionaries(
    {"resources": replicated_items},
    optional={"renameByDefault": st.booleans(), "failRequestsGreaterThanOne": st.booleans()},
)
patterns = st.lists(st.fixed_dictionaries({
    "pattern": st.text(min_size=1, max_size=12), "name": resource_names}), max_size=3)
sections = st.fixed_dictionaries({}, optional={
    "resources": st.fixed_dictionaries({}, optional={"gpus": patterns, "mig": patterns}),
    "sharing": st.one_of(st.fixed_dictionaries({"timeSlicing": replicated}),
                         st.fixed_dictionaries({"mps": replicated})),
    "imex": st.fixed_dictionaries({}, optional={
        "channelIDs": st.sampled_from([[], [0]]), "required": st.booleans()}),
})


@_SETTINGS
@given(layered(), sections, st.sampled_from(["yaml", "json", "show"]))
def test_property_effective_config_round_trips_through_a_file(tmp_path, case, extra, form):
    """Any valid combination -> the effective config written out (the v1 document as YAML,
    as JSON as `config show --json` prints it, or `config show`'s text) -> loaded from that
    file alone -> the same effective values."""
    _, flags, env, doc = case
    doc.update(extra)
    if extra.get("sharing", {}).get("mps") is not None:
        env.pop("MIG_STRATEGY", None)
        flags.pop("mig_strategy", None)
        doc.get("flags", {}).pop("migStrategy", None)  # MPS refuses MIG strategy mixed
    cfg = load_config({**flags, "config_file": write(tmp_path, doc)}, env)
    if form == "yaml":
        text = yaml.safe_dump(cfg.to_document())
    elif form == "json":
        text = json.dumps(config_json(cfg)["config"])
    else:
        text = format_config(cfg)
    again = load_config({"config_file": write(tmp_path, text, "effective")}, {})
    assert _values(again) == _values(cfg)
    assert again.to_document() == cfg.to_document()


@_SETTINGS
@given(st.sampled_from([opt for opt in OPTIONS if opt.name in ("mig_strategy", "device_id_strategy")]),
       st.text(min_size=1, max_size=12))
def test_property_any_other_choice_is_refused_naming_the_variable(opt, text):
    if text in opt.kind.choices or "\x00" in text:
        return
    with pytest.raises(ConfigError) as info:
        load_config({}, {opt.env: text})
    assert info.value.key == opt.env and info.value.source == "environment"
    assert info.value.problem == f"{text!r} is not one of {', '.join(opt.kind.choices)}"


_KNOWN = {
    "": set(SCHEMA),
    "flags": set(SCHEMA["flags"]),
    "flags.plugin": set(SCHEMA["flags"]["plugin"]),
    "flags.gfd": set(SCHEMA["flags"]["gfd"]),
    "agent": set(SCHEMA["agent"]),
    "sharing.timeSlicing": {"renameByDefault", "failRequestsGreaterThanOne", "resources"},
    "imex": {"channelIDs", "required"},
}
_MAPPINGS = {
    "": v1(),
    "flags": v1(flags={}),
    "flags.plugin": v1(flags={"plugin": {}}),
    "flags.gfd": v1(flags={"gfd": {}}),
    "agent": v1(agent={}),
    "sharing.timeSlicing": v1(sharing={"timeSlicing": dict(_TS)}),
    "imex": v1(imex={}),
}


@_SETTINGS
@given(st.sampled_from(sorted(_MAPPINGS)), st.text(min_size=1, max_size=16))
def test_property_unknown_keys_are_refused_with_their_path(tmp_path, where, name):
    data = json.loads(json.dumps(_MAPPINGS[where]))
    node = data
    for part in where.split(".") if where else []:
        node = node[part]
    if name in _KNOWN[where] or name == "<<" or "\x00" in name:  # "<<" is YAML's merge key
        return
    node[name] = 1
    with pytest.raises(ConfigError) as info:
        load_config({"config_file": write(tmp_path, data)}, {})
    shown = name if name.isprintable() else repr(name)  # a control character: escaped
    assert info.value.key == (f"{where}.{shown}" if where else shown)
    assert info.value.problem.startswith("unknown key")


def test_an_unknown_key_with_a_control_character_is_named_escaped_on_one_line(tmp_path):
    # found by tests/test_fuzz_config.py: a key "\r" went into the message as it was, and the
    # terminal (or a reader with universal newlines) showed a broken line instead of the key
    message, path = file_error(tmp_path, v1(sharing={"\r": None}))
    assert message == (f"sharing.'\\r': unknown key; expected one of: timeSlicing, mps "
                       f"({path})")
    assert "\r" not in message and "\n" not in message


def test_nvidias_v020_shared_devices_allocation_policy_is_read_from_its_key(tmp_path):
    """NVIDIA v0.20.0 api/config/v1/flags.go PluginCommandLineFlags: the key is
    flags.plugin.sharedDevicesAllocationPolicy; cmd/nvidia-device-plugin/main.go: the flag
    --shared-devices-allocation-policy, env SHARED_DEVICES_ALLOCATION_POLICY, default
    distributed, values distributed and packed."""
    cfg = from_file(tmp_path, v1(flags={"plugin": {"sharedDevicesAllocationPolicy": "packed"}}))
    assert cfg.replica_allocation_policy == "packed"
    message, path = file_error(tmp_path, v1(flags={"plugin": {
        "sharedDevicesAllocationPolicy": "spread"}}))
    assert message.startswith("flags.plugin.sharedDevicesAllocationPolicy: 'spread' is not one "
                              "of distributed, packed")


def test_the_docs_name_every_option_with_its_flag_env_key_and_default():
    docs = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    table = [line.replace("`", "") for line in docs.splitlines() if line.startswith("| ")]
    for opt in OPTIONS:
        names = (opt.flag, *opt.aliases, opt.env, opt.key or "—", opt.describe_default())
        assert any(all(f" {name} " in f" {row} " or f" {name})" in row for name in names)
                   for row in table), (opt.name, names)


# -- files that are not config files ------------------------------------------------------------

BOMB = "version: v1\na: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))


@pytest.mark.parametrize("make, problem", [
    (lambda d: _file(d, BOMB), "invalid YAML: its aliases expand to more than 100000 values; "
                               "a config file needs no such nesting"),
    (lambda d: _file(d, "version: v1\n" + "#" * (1 << 20) + "\n"),
     "the config file is 1048589 bytes; at most 1048576 (1 MiB) is read"),
    (lambda d: "/dev/zero", "cannot read the config file: not a regular file (a character "
                            "device)"),
    (lambda d: _fifo(d), "cannot read the config file: not a regular file (a pipe)"),
], ids=["alias-bomb", "over-1-MiB", "dev-zero", "fifo"])
def test_what_is_not_a_config_file_is_refused_at_once_in_one_line(tmp_path, make, problem):
    # the PyYAML of a billion laughs, 2 MB of comments or /dev/zero took seconds or all memory
    path = make(tmp_path)
    proc = run_gpu_agent("config", "check", path, env=clean_env(), check=False, timeout=20)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"gpu-agent: error: {path}: {problem}\n"


def _file(directory, text: str) -> str:
    path = directory / "config.yaml"
    path.write_text(text)
    return str(path)


def _fifo(directory) -> str:
    path = directory / "config.fifo"
    os.mkfifo(path)
    return str(path)


@pytest.mark.parametrize("command", [["status"], ["state", "show"]], ids=["status", "state-show"])
def test_a_state_commands_help_lists_its_own_options_and_still_takes_runs(tmp_path, command):
    # 38 options of run's drowned the two that find the state directory
    text = run_gpu_agent(*command, "--help", env=clean_env()).stdout
    flags = set(re.findall(r"^  (--[a-z-]+)", text, re.M))
    assert flags == {"--json", "--config", "--state-dir"}, flags  # and -h, --help
    proc = run_gpu_agent(*command, "--state-dir", str(tmp_path), "--mig-strategy", "mixed",
                         env=clean_env(), check=False)
    assert "unrecognized arguments" not in proc.stderr and proc.returncode in (0, 1, 3)


# what makes each error line docs/configuration.md shows: (file text or None, env, flags)
DOC_ERRORS = [
    ("version: v1\nflags:\n  migStrategy: bogus\n", {}, []),
    (None, {"MIG_STRATEGY": "bogus"}, []),
    (None, {}, ["--fail-on-init-error", "maybe"]),
    ("version: v1\nflags:\n  plugin:\n    deviceListStrategy: [envvar, bogus]\n", {}, []),
    ("version: v1\nflags:\n  migStrateg: none\n", {}, []),
    ("version: v1\nagent:\n  health:\n    xidAction: {48: reset}\n", {}, []),
    ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
     "      replicas: 1\n", {}, []),
    ("version: v2\n", {}, []),
    ("version: v1\nflags:\n  migStrategy: none\n  failOnInitError: true\n  migStrategy: single\n",
     {}, []),
    ("version: v1\nflags:\n  migStrategy: none\n  bad: x: y\n", {}, []),
    (None, {"CONFIG_FILE": "/etc/gpu-agent/config.yaml"}, []),
]


def test_every_error_line_configuration_md_shows_is_what_the_code_says(tmp_path):
    # the docs once showed an unknown-key message the code no longer wrote
    if os.path.exists("/etc/gpu-agent/config.yaml"):
        pytest.skip("this machine has /etc/gpu-agent/config.yaml: the last example needs none")
    docs = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    shown = [line for line in docs.splitlines() if line.startswith("gpu-agent: error: ")]
    made = []
    for text, env, flags in DOC_ERRORS:
        args = list(flags)
        if text is not None:
            (tmp_path / "config.yaml").write_text(text)
            args += ["--config", "config.yaml"]
        proc = subprocess.run([sys.executable, "-m", "agent", "config", "show", *args],
                              cwd=tmp_path, env={**clean_env(), **env,
                                                 "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc
        made.append(proc.stderr.strip())
    assert made == shown


def test_every_key_of_the_schema_is_in_the_every_key_table():
    # the table once lacked cdiSpecDirs, devCharSymlinks, metricsAddress, nfdFeaturesFile and
    # nvmlCallTimeout; rows name keys in full or as `.name` after a full one of the same parent
    from agent.config.file import SCHEMA, _schema_leaves

    docs = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    table = docs.split("### Every key", 1)[1].lstrip("\n").split("\n\n", 1)[0]
    listed = set()
    for row in table.splitlines()[2:]:
        parent = ""
        for key in re.findall(r"`([.\w]+)(?:\[\])?`", row.split("|")[1]):
            if key.startswith("."):
                listed.add(parent + key)
            else:
                listed.add(key)
                parent = key.rsplit(".", 1)[0] if "." in key else key
    leaves = {key for key, _ in _schema_leaves(SCHEMA)}
    sections = {"resources", "sharing", "imex"}  # rows by their sub-keys
    missing = {k for k in leaves - listed if k not in sections}
    assert missing == set(), sorted(missing)
