"""The names and defaults that more than one part of gpu-agent uses, each defined here once.

Owns: every list of names the agent accepts (MIG, device-list and device-ID strategies,
allocation policies, XID action classes) and every default value or path that is shared across
layers (the option defaults of agent.config.options and the code defaults of the parts that
take those options). Plain literals only: must not import anything, of `agent` or otherwise, so
that every module, `agent._fast` included, may import it.
"""

from __future__ import annotations

# -- the NVML library ---------------------------------------------------------------------------

# The SONAME pynvml opens, and what the driver installs (looked up under the driver root).
NVML_SONAME = "libnvidia-ml.so.1"

# -- strategies (NVIDIA k8s-device-plugin's spellings) ------------------------------------------

DEFAULT_KUBELET_DIR = "/var/lib/kubelet"  # kubelet's --root-dir
# agent.mode: what the agent serves kubelet (the first is the default)
MODES = ("device-plugin", "dra")
# agent.draRebootTaint: the taint effects (KEP-5055) a reboot-class fault may get in dra mode
# (the first is the default); every other withdrawal is NoSchedule
REBOOT_TAINT_EFFECTS = ("NoExecute", "NoSchedule")
MIG_STRATEGIES = ("none", "single", "mixed")
DEFAULT_MIG_STRATEGY = "none"

# How the allocated devices are passed to the container runtime (flags.plugin.deviceListStrategy).
DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri")
DEFAULT_DEVICE_LIST_STRATEGIES = ("envvar",)

# How devices are named to the container runtime, and how checkpointed allocations find their
# GPUs after a restart (flags.plugin.deviceIDStrategy, agent.checkpointDeviceIDStrategy).
DEVICE_ID_STRATEGIES = ("uuid", "index")
DEFAULT_DEVICE_ID_STRATEGY = "uuid"

DEFAULT_CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
# Where nvidia-container-toolkit writes CDI specs; later directories take precedence.
DEFAULT_CDI_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")

# -- allocation policies (GetPreferredAllocation, docs/allocation.md) ---------------------------

BEST_EFFORT = "best-effort"
PACKED = "packed"
DISTRIBUTED = "distributed"
ALLOCATION_POLICIES = (BEST_EFFORT, PACKED)
REPLICA_ALLOCATION_POLICIES = (DISTRIBUTED, PACKED)
DEFAULT_ALLOCATION_POLICY = BEST_EFFORT
DEFAULT_REPLICA_ALLOCATION_POLICY = DISTRIBUTED

# -- XID action classes (NVIDIA's XID catalog "immediate action" buckets), weakest first -------

XID_IGNORE = "ignore"            # nothing to do (not even logged)
XID_APPLICATION = "application"  # an application's error: the GPU is fine (RESTART_APP)
XID_RESET = "reset"              # the GPU needs a reset (RESET_GPU)
XID_REBOOT = "reboot"            # the node needs a reboot (RESTART_BM)
XID_ACTIONS = (XID_IGNORE, XID_APPLICATION, XID_RESET, XID_REBOOT)
# The default table of XID classes (agent.health.policy): NVIDIA's device plugin's choice of
# what withdraws a GPU (six application XIDs, every other withdraws), or the XID catalog's
# immediate action for each XID.
XID_POLICY_NVIDIA = "nvidia"
XID_POLICY_CATALOG = "catalog"
XID_POLICIES = (XID_POLICY_NVIDIA, XID_POLICY_CATALOG)
DEFAULT_XID_POLICY = XID_POLICY_NVIDIA

# -- host paths and intervals -------------------------------------------------------------------

DEFAULT_DRIVER_ROOT = "/"
DEFAULT_KUBELET_SOCKET = "/var/lib/kubelet/device-plugins/kubelet.sock"
DEFAULT_POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_STATE_DIR = "/var/lib/gpu-agent"
# MPS (sharing.mps): where each GPU's control daemon keeps its pipe and log directories, and
# the /dev/shm its clients share (NVIDIA's Helm default for flags.mpsRoot), and the control
# program, looked up under the driver root unless agent.mpsControl names it.
DEFAULT_MPS_ROOT = "/run/nvidia/mps"
MPS_CONTROL = "nvidia-cuda-mps-control"
# TKEStack gpu-manager's names: vcuda-core (100 units a GPU) is a preset of sharing.mps
# (docs/sharing.md); vcuda-memory, an independent second resource, is refused with why.
VCUDA_CORE = "tencent.com/vcuda-core"
VCUDA_MEMORY = "tencent.com/vcuda-memory"
VCUDA_CORE_UNITS = 100
# The operators' manual isolation file, where Alibaba Cloud ACK's fork of NVIDIA's plugin keeps it.
DEFAULT_ISOLATION_FILE = "/etc/nvidia-device-plugin/unhealthyDevices.json"
# Matching allocations to pods through podresources, besides at start and after Allocate.
DEFAULT_RECONCILE_INTERVAL_S = 60.0
# how long podresources must keep not listing a pod before its allocations are dropped: a
# restarted kubelet lists its running pods only once it has read them from the API server
DEFAULT_ENDED_POD_GRACE_S = 30.0
# The allocation journal's background fdatasync (0: before every Allocate answers). One second
# bounds what a power loss can take (a node that then reboots re-runs every Allocate anyway),
# as InnoDB's innodb_flush_log_at_trx_commit=2 does; why it is safe: docs/state.md.
DEFAULT_JOURNAL_SYNC_INTERVAL_S = 1.0
# How often a changed MIG layout is looked for under migStrategy single / mixed (NVML has no
# event for it): a few NVML calls per MIG-capable GPU; the idle-CPU bench measures the cost.
DEFAULT_MIG_CHECK_INTERVAL_S = 5.0
# How long an NVML call on a GPU may take before the GPU counts as not answering (withdrawn
# until a call returns; agent.nvml.guard). Well above what a healthy GPU takes, including one
# woken from idle without persistence mode (hundreds of ms), and well below the systemd
# watchdog's 15 s ping interval, which a call made from the main loop delays by at most this.
DEFAULT_NVML_CALL_TIMEOUT_S = 5.0
# A GPU withdrawn for a reset-class error stays free of critical events this long to return.
DEFAULT_RECOVERY_QUIET_PERIOD_S = 60.0
# Create the missing /dev/char links of the NVIDIA device nodes (agent.devchar; why: docs).
DEFAULT_DEV_CHAR_SYMLINKS = True
# The Prometheus endpoint (agent.metrics). The port collides with none of the GPU node's usual
# listeners: dcgm-exporter 9400, node-exporter 9100, gpu-manager 5678, kubelet 10250.
DEFAULT_METRICS_ADDRESS = ":9445"
# How long a scrape waits for the GPUs' NVML telemetry; a GPU that has not answered by then
# (a hung call) is left out of that scrape and counted.
TELEMETRY_BUDGET_S = 0.5
# NFD's local feature source: node labels with gpu-feature-discovery's names (agent.rm.labels).
DEFAULT_NFD_FEATURES_FILE = "/etc/kubernetes/node-feature-discovery/features.d/gpu-agent"

# -- the Kubernetes API (agent.kubeapi: fault events and the node condition) -------------------
# The kubeconfig the agent reaches the API server with: the kubelet's own by default (kubeadm
# writes it there; its identity, system:node:<node>, may create events and patch its own
# Node's status). Empty: no API, so no events and no condition.
DEFAULT_KUBECONFIG = "/etc/kubernetes/kubelet.conf"
# What the agent signs its events with (source.component, reportingComponent).
EVENT_COMPONENT = "gpu-agent"
# The Node condition the agent keeps: False while a GPU is withdrawn, True when all are in.
CONDITION_TYPE = "GPUHealthy"

# -- per-node configs, chosen by a node label (agent.config.named, agent.kubeapi.nodelabel) ----
# NVIDIA's config-manager (cmd/config-manager/main.go): the label naming the config, the name a
# config is looked for under when the node has no label ("named" fallback), the fallbacks.
DEFAULT_CONFIG_DIR = "/etc/gpu-agent/config.d"
DEFAULT_NODE_LABEL = "nvidia.com/device-plugin.config"
NAMED_CONFIG_FALLBACK = "default"
FALLBACK_STRATEGIES = ("named", "single", "empty")
DEFAULT_FALLBACK_STRATEGIES = ("named", "single")  # the Helm chart's config.fallbackStrategies
