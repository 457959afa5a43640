"""Per-node configs as NVIDIA's plugin selects them: named configs in one directory and the node
label `nvidia.com/device-plugin.config` choosing one, switched live when the label changes
(agent.config.named, agent.kubeapi.nodelabel; tests/e2e/test_node_configs.py does the same on
the real API server).

The rules pinned here are NVIDIA's config-manager's (k8s-device-plugin v0.19.1,
cmd/config-manager/main.go): the label `nvidia.com/device-plugin.config` (DefaultConfigLabel);
its value names the config; an unlabelled node gets `--default-config` (DEFAULT_CONFIG), else
the fallback strategies in order — "named" takes the config called `default`
(NamedConfigFallback), "single" the only config there is, "empty" none; the Helm chart's
default strategies are named,single (deployments/helm/nvidia-device-plugin/values.yaml,
config.fallbackStrategies); a ConfigMap's `..data` entries and directories are not configs
(getConfigFileNameMap). Where gpu-agent differs, on purpose: a label naming no config keeps the
node on the config it has without the label (NVIDIA's config-manager exits), and says so.
"""

from __future__ import annotations

import os
import signal

import pytest

from agent.config import load_config
from agent.config.named import choose, named_configs
from agent.constants import DEFAULT_FALLBACK_STRATEGIES, DEFAULT_NODE_LABEL
from agent.errors import ConfigError
from agent.status import read_status
from tests.daemon_harness import GPU, Node
from tests.kube_api import KubeApi

NODE = "gpu-node-1"
PLAIN = "version: v1\n"
SHARED = ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
          "      replicas: 4\n")


def _configs(root, files: dict[str, str]) -> str:
    directory = os.path.join(str(root), "config.d")
    os.makedirs(directory, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
    return directory


# -- the choice -----------------------------------------------------------------------------------


def test_names_are_file_names_with_or_without_yaml_and_a_configmaps_entries_are_skipped(tmp_path):
    d = _configs(tmp_path, {"a100.yaml": PLAIN, "h100.yml": PLAIN, "shared": SHARED,
                            "..data": PLAIN, ".hidden.yaml": PLAIN, "notes.txt~": PLAIN})
    os.mkdir(os.path.join(d, "..2026_11_28_19_00_00.000000001"))  # a ConfigMap volume's
    os.symlink("shared", os.path.join(d, "linked"))  # a ConfigMap volume's files are links
    os.symlink("missing", os.path.join(d, "dangling"))
    assert sorted(named_configs(d)) == ["a100", "h100", "linked", "shared"]
    assert named_configs(str(tmp_path / "absent")) == {}


def test_two_files_for_one_name_are_refused_naming_both(tmp_path):
    d = _configs(tmp_path, {"a100.yaml": PLAIN, "a100": PLAIN})
    with pytest.raises(ConfigError, match="a100 and a100.yaml both name the config 'a100'") as e:
        named_configs(d)
    assert e.value.key == "agent.configDir" and e.value.source == d


@pytest.mark.parametrize("files, label, default, fallbacks, name, why", [
    ({"a100": PLAIN, "shared": SHARED}, "shared", "", ("named", "single"), "shared",
     f"node label {DEFAULT_NODE_LABEL}=shared"),
    ({"a100": PLAIN, "shared": SHARED}, "", "a100", ("named", "single"), "a100",
     "the default config"),
    ({"default": PLAIN, "shared": SHARED}, None, "", ("named", "single"), "default",
     "fallback named: the config 'default'"),
    ({"shared": SHARED}, None, "", ("named", "single"), "shared",
     "fallback single: the only config"),
    ({"a100": PLAIN, "shared": SHARED}, None, "", ("named", "single", "empty"), "",
     "fallback empty: the --config file"),
    ({"a100": PLAIN, "shared": SHARED}, None, "", ("named", "single"), "",
     "no label, no default config, fallbacks named,single found none: the --config file"),
    ({"default": PLAIN}, None, "", ("single", "named"), "default",
     "fallback single: the only config"),  # in the order given
], ids=["label", "default-config", "fallback-named", "fallback-single", "fallback-empty",
        "all-fail", "order"])
def test_the_choice_follows_nvidias_config_manager(tmp_path, files, label, default, fallbacks,
                                                   name, why):
    d = _configs(tmp_path, files)
    choice = choose(d, DEFAULT_NODE_LABEL, label, default, fallbacks)
    assert (choice.name, choice.why, choice.problem) == (name, why, "")
    assert choice.path == (os.path.join(d, name) if name else "")


def test_a_label_naming_no_config_keeps_the_unlabelled_choice_and_says_why(tmp_path):
    d = _configs(tmp_path, {"default": PLAIN, "shared": SHARED})
    choice = choose(d, DEFAULT_NODE_LABEL, "sahred", "", DEFAULT_FALLBACK_STRATEGIES)
    assert choice.name == "default"
    assert choice.problem == (f"node label {DEFAULT_NODE_LABEL}=sahred names no config in {d} "
                              f"(there: default, shared); using the config of a node without "
                              f"it")


def test_a_default_config_that_is_not_there_is_a_config_error(tmp_path):
    d = _configs(tmp_path, {"shared": SHARED})
    with pytest.raises(ConfigError, match=r"agent.defaultConfig: 'a100' names no config in "):
        choose(d, DEFAULT_NODE_LABEL, None, "a100", DEFAULT_FALLBACK_STRATEGIES)


def test_the_named_config_replaces_the_config_file_and_cannot_move_the_choice(tmp_path):
    base = tmp_path / "config.yaml"
    d = _configs(tmp_path, {"shared": SHARED})
    base.write_text(f"version: v1\nflags:\n  migStrategy: single\nagent:\n  configDir: {d}\n")
    cfg = load_config({"config_file": str(base)}, {}, label="shared")
    assert cfg.config_file == os.path.join(d, "shared")
    assert cfg.mig_strategy == "none"  # the base file's value is not layered under it
    assert cfg.sharing.time_slicing is not None
    assert cfg.config_dir == d and cfg.source("config_dir").name == str(base)
    assert str(cfg.source("config_file")) == (f"named config shared (node label "
                                              f"{DEFAULT_NODE_LABEL}=shared)")
    _configs(tmp_path, {"shared": SHARED + "agent:\n  defaultConfig: shared\n"})
    with pytest.raises(ConfigError) as e:
        load_config({"config_file": str(base)}, {}, label="shared")
    assert e.value.key == "agent.defaultConfig" and e.value.source == os.path.join(d, "shared")


# -- the agent: the label read at start, watched, switched live ---------------------------------


@pytest.fixture
def node():
    with Node() as n:
        yield n


def _gpus(agent, count: int):
    return agent.wait_for(lambda s: s.resource(GPU) is not None
                          and len(s.resource(GPU).devices) == count, f"{count} {GPU} devices")


def test_the_label_chooses_at_start_and_relabelling_switches_without_a_new_registration(node):
    api = KubeApi(NODE)
    api.kubeconfig(node.kubeconfig)
    _configs(node.root, {"default.yaml": PLAIN, "shared": SHARED})
    api.label(DEFAULT_NODE_LABEL, "shared")
    agent = node.agent("--node-name", NODE)
    agent.wait_registered(1)
    _gpus(agent, 32)  # 8 GPUs, 4 replicas each: the label's config from the first registration
    agent.wait_log(f"named config: shared (node label {DEFAULT_NODE_LABEL}=shared)")
    api.wait(lambda: api.watches() == 1, "the agent's watch of its Node")

    api.label(DEFAULT_NODE_LABEL, None)  # unlabelled: the fallback "named", the config default
    _gpus(agent, 8)
    agent.wait_log("configuration reloaded (reload 1)")

    api.label(DEFAULT_NODE_LABEL, "sahred")  # a typo: the node keeps the unlabelled choice
    status = node.status_when(lambda d: "sahred" in d["lastError"], "the refused label")
    assert status["namedConfig"]["name"] == "default"
    assert status["namedConfig"]["problem"].startswith(
        f"node label {DEFAULT_NODE_LABEL}=sahred names no config in {node.config_dir}")
    assert len(node.client.state().resource(GPU).devices) == 8

    api.end_watches()  # the server ends a watch (timeoutSeconds): the next one follows ...
    api.wait(lambda: sum(1 for m, _, _ in api.requests if m == "WATCH") == 2, "a second watch")
    api.label(DEFAULT_NODE_LABEL, "shared")  # ... and sees the next change
    _gpus(agent, 32)
    status = node.status_when(lambda d: d["reloads"] == 3 and not d["lastError"], "reload 3")
    assert status["namedConfig"]["name"] == "shared"
    res = node.client.state().resource(GPU)
    assert res.connected and res.registrations == 1  # every switch on the same stream
    assert agent.stop() == 0


def test_with_the_api_down_at_start_the_node_serves_unlabelled_then_switches_when_it_answers(node):
    api = KubeApi(NODE)
    api.kubeconfig(node.kubeconfig)
    api.label(DEFAULT_NODE_LABEL, "shared")
    api.stop()
    _configs(node.root, {"default.yaml": PLAIN, "shared": SHARED})
    agent = node.agent("--node-name", NODE)
    agent.wait_registered(1)
    _gpus(agent, 8)  # not known yet: the config of a node without the label
    agent.wait_log(f"node label {DEFAULT_NODE_LABEL} not read")
    api.start()
    _gpus(agent, 32)
    agent.wait_log("configuration reloaded (reload 1)")
    assert agent.stop() == 0


def test_sighup_reads_the_chosen_named_config_again(node):
    api = KubeApi(NODE)
    api.kubeconfig(node.kubeconfig)
    d = _configs(node.root, {"default.yaml": PLAIN, "shared": SHARED})
    api.label(DEFAULT_NODE_LABEL, "shared")
    agent = node.agent("--node-name", NODE)
    _gpus(agent, 32)
    _configs(node.root, {"shared": SHARED.replace("replicas: 4", "replicas: 2")})
    agent.send(signal.SIGHUP)
    _gpus(agent, 16)
    assert read_status(node.state)["namedConfig"]["why"] == \
        f"node label {DEFAULT_NODE_LABEL}=shared"
    assert os.path.exists(os.path.join(d, "shared"))
    assert agent.stop() == 0


def test_without_named_configs_the_label_is_not_watched(node):
    api = KubeApi(NODE)
    api.kubeconfig(node.kubeconfig)
    agent = node.agent("--node-name", NODE, "--fault-events=false", "--node-condition=false")
    agent.wait_registered(1)
    status = node.status_when(lambda d: d["phase"] == "running", "running")
    assert status["namedConfig"] is None
    assert not [r for r in api.requests if r[0] == "WATCH" or "/nodes" in r[1]]
    assert agent.stop() == 0
