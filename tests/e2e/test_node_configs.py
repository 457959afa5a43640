"""Per-node configs on the real API server: the node label `nvidia.com/device-plugin.config`
names the config, `kubectl label` switches it while pods run (docs/configuration.md, "Per-node
configs"; the rules are NVIDIA's config-manager's, pinned in tests/test_node_configs.py).

The agent runs as user `gpu-agent` with exactly the RBAC the package ships, so that reading and
watching its Node by name is shown to be allowed by it. Figures go to .e2e/results: `kubectl
label` → kubelet's allocatable changed; nothing asserts on them.
"""

from __future__ import annotations

import os
import time

from tests.e2e.cluster import NODE
from tests.e2e.conftest import GPU, write_result

LABEL = "nvidia.com/device-plugin.config"
PLAIN = "version: v1\n"
SHARED = ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
          "      replicas: 4\n")


def _label(node, value: str | None) -> None:
    node.cluster.kubectl("label", "node", NODE, f"{LABEL}={value}" if value else f"{LABEL}-",
                         "--overwrite")


def test_kubectl_label_switches_the_nodes_config_while_its_pods_run(node):
    configs = node.cluster.path(f"gpu-agent-{node.tag}-config.d")  # the agent's --config-dir
    os.makedirs(configs, exist_ok=True)
    for name, text in (("default.yaml", PLAIN), ("shared", SHARED)):
        with open(os.path.join(configs, name), "w") as f:
            f.write(text)
    _label(node, "shared")
    try:
        agent = node.agent("dgx1-v100", kubeconfig=node.agent_identity())
        node.wait_allocatable(32)  # 8 GPUs, 4 replicas each: the label's config from the start
        node.create_pod("shared-1", {GPU: 1})
        node.wait_running("shared-1")
        held = node.assigned("shared-1")

        start = time.monotonic()
        _label(node, None)  # unlabelled: the config named "default" (fallback named)
        node.wait_allocatable(8, node_object=False)
        write_result(node.results, "label_removed_to_allocatable_s",
                     round(time.monotonic() - start, 3))
        node.wait_allocatable(8)
        status = agent.status_when(lambda d: d["reloads"] == 1, "the switch applied")
        assert status["namedConfig"]["name"] == "default"
        assert [r["registrations"] for r in status["resources"]] == [1]  # no re-registration

        start = time.monotonic()
        _label(node, "shared")
        node.wait_allocatable(32, node_object=False)
        write_result(node.results, "label_set_to_allocatable_s",
                     round(time.monotonic() - start, 3))
        status = agent.status_when(lambda d: d["reloads"] == 2, "the second switch")
        assert status["namedConfig"]["why"] == f"node label {LABEL}=shared"
        assert not status["lastError"]
        # the pod admitted before both switches still runs, on the GPU it was given
        assert node.pod("shared-1")["status"]["phase"] == "Running"
        assert node.assigned("shared-1") == held
        node.create_pod("shared-2", {GPU: 1})
        node.wait_running("shared-2")
    finally:
        _label(node, None)
