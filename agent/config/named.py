"""Named configs: a directory of config files, one of which a node label chooses for this node,
as NVIDIA's config-manager chooses (cmd/config-manager/main.go of k8s-device-plugin v0.19.1:
`updateConfigName`, `getConfigFileNameMap`).

Owns: listing the directory (regular files; names starting with '.' are skipped, as a
ConfigMap volume's `..data` entries; `NAME.yaml`, `NAME.yml` and `NAME` all name NAME, so a
directory a ConfigMap is copied into works as it is) and the choice: the label's value when
the node has the label, else the default config, else the fallback strategies in order, else
the --config file. Must not read the label (agent.kubeapi.nodelabel does) nor load the chosen
file (agent.config does); must not import anything of `agent` but errors, constants and the
modules of agent.config.

Where gpu-agent differs from NVIDIA's config-manager, which stops (and so stops the plugin):
a label naming a config that is not there keeps this node on the config it would have without
the label and says why (`Choice.problem`), so that one mistyped label does not take a node's
GPUs away; all fallbacks failing is the --config file.
"""

from __future__ import annotations

import os
import stat
from typing import NamedTuple

from agent.config.kinds import CONFIG_NAME
from agent.constants import NAMED_CONFIG_FALLBACK
from agent.errors import ConfigError

SUFFIXES = (".yaml", ".yml")


class Choice(NamedTuple):
    """The config chosen for this node: `name` "" is none (the --config file is used)."""

    name: str
    path: str
    why: str  # how it was chosen, e.g. "node label nvidia.com/device-plugin.config=a100"
    problem: str = ""  # the label names no config here: said, and the label's absence chose


NONE = Choice("", "", "no named configs")


def named_configs(directory: str) -> dict[str, str]:
    """{name: path} of the configs in `directory`; {} when it is not there. ConfigError when it
    cannot be read or two files give one name."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError("agent.configDir", f"cannot read the named-config directory: "
                                             f"{exc.strerror or exc}", directory) from None
    found: dict[str, str] = {}
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            if not stat.S_ISREG(os.stat(entry.path).st_mode):  # links followed, as a ConfigMap's
                continue
        except OSError:
            continue  # a dangling link: not a config
        name = next((entry.name[:-len(s)] for s in SUFFIXES if entry.name.endswith(s)),
                    entry.name)
        if not CONFIG_NAME.fullmatch(name):
            continue  # no label value can name it (an editor's backup, a README.txt~ ...)
        if name in found:
            raise ConfigError("agent.configDir", f"{os.path.basename(found[name])} and "
                                                 f"{entry.name} both name the config {name!r}; "
                                                 f"keep one", directory)
        found[name] = entry.path
    return found


def choose(directory: str, label: str, value: str | None, default: str,
           fallbacks: tuple[str, ...]) -> Choice:
    """The config for a node whose label `label` has `value` (None or "": no such label, or
    not known). ConfigError when `default` names no config in `directory`."""
    configs = named_configs(directory) if directory else {}
    if not configs:
        return NONE
    problem = ""
    if value:
        if value in configs:
            return Choice(value, configs[value], f"node label {label}={value}")
        problem = (f"node label {label}={value} names no config in {directory} (there: "
                   f"{', '.join(sorted(configs))}); using the config of a node without it")
    if default:
        if default not in configs:
            raise ConfigError("agent.defaultConfig", f"{default!r} names no config in "
                                                     f"{directory} (there: "
                                                     f"{', '.join(sorted(configs))})")
        return Choice(default, configs[default], "the default config", problem)
    for strategy in fallbacks:
        if strategy == "named" and NAMED_CONFIG_FALLBACK in configs:
            return Choice(NAMED_CONFIG_FALLBACK, configs[NAMED_CONFIG_FALLBACK],
                          f"fallback named: the config {NAMED_CONFIG_FALLBACK!r}", problem)
        if strategy == "single" and len(configs) == 1:
            (name, path), = configs.items()
            return Choice(name, path, "fallback single: the only config", problem)
        if strategy == "empty":
            return Choice("", "", "fallback empty: the --config file", problem)
    return Choice("", "", f"no label, no default config, fallbacks {','.join(fallbacks)} "
                          f"found none: the --config file", problem)
