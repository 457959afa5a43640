"""The table of gpu-agent's options: for each one its command-line flag, environment variable,
config-file key, value kind and default.

Owns: the names and defaults, following NVIDIA's k8s-device-plugin wherever it has the option
(flags, env vars, `flags.*` keys) and our own `agent.*` keys otherwise; the lists of names
and the default values themselves are agent.constants' (the parts that act on an option share
them). Must not parse or layer anything (agent.config does), and must not import anything of
`agent` but `constants` and the modules of agent.config.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from agent.config.kinds import (
    BoolKind,
    ChoiceKind,
    ChoiceListKind,
    ConfigFileKind,
    ConfigNameKind,
    GpuListKind,
    IntervalKind,
    Kind,
    ListenAddressKind,
    NodeNameKind,
    NvmlLibraryKind,
    PathKind,
    PathListKind,
    TextKind,
    XidActionsKind,
    XidListKind,
)
from agent.constants import (
    ALLOCATION_POLICIES,
    CONDITION_TYPE,
    DEFAULT_ALLOCATION_POLICY,
    DEFAULT_CDI_ANNOTATION_PREFIX,
    DEFAULT_CDI_SPEC_DIRS,
    DEFAULT_CONFIG_DIR,
    DEFAULT_DEV_CHAR_SYMLINKS,
    DEFAULT_DEVICE_ID_STRATEGY,
    DEFAULT_DEVICE_LIST_STRATEGIES,
    DEFAULT_DRIVER_ROOT,
    DEFAULT_ENDED_POD_GRACE_S,
    DEFAULT_FALLBACK_STRATEGIES,
    DEFAULT_ISOLATION_FILE,
    DEFAULT_JOURNAL_SYNC_INTERVAL_S,
    DEFAULT_KUBECONFIG,
    DEFAULT_KUBELET_DIR,
    DEFAULT_KUBELET_SOCKET,
    DEFAULT_METRICS_ADDRESS,
    DEFAULT_MIG_CHECK_INTERVAL_S,
    DEFAULT_MIG_STRATEGY,
    DEFAULT_MPS_ROOT,
    DEFAULT_NFD_FEATURES_FILE,
    DEFAULT_NODE_LABEL,
    DEFAULT_NVML_CALL_TIMEOUT_S,
    DEFAULT_POD_RESOURCES_SOCKET,
    DEFAULT_RECONCILE_INTERVAL_S,
    DEFAULT_RECOVERY_QUIET_PERIOD_S,
    DEFAULT_REPLICA_ALLOCATION_POLICY,
    DEFAULT_STATE_DIR,
    DEFAULT_XID_POLICY,
    DEVICE_ID_STRATEGIES,
    DEVICE_LIST_STRATEGIES,
    FALLBACK_STRATEGIES,
    MIG_STRATEGIES,
    MODES,
    MPS_CONTROL,
    NAMED_CONFIG_FALLBACK,
    NVML_SONAME,
    REBOOT_TAINT_EFFECTS,
    REPLICA_ALLOCATION_POLICIES,
    XID_POLICIES,
)


class Option(NamedTuple):
    """One option: `name` is the Config field and the argparse dest."""

    name: str
    flag: str
    env: str
    key: str | None  # the config-file key path; None for the config file itself
    kind: Kind
    default: Any
    help: str
    aliases: tuple[str, ...] = ()
    default_text: str = ""  # the default as the docs say it, where repr would mislead

    def describe_default(self) -> str:
        if self.default_text:
            return self.default_text
        return self.kind.to_text(self.default)


OPTIONS: tuple[Option, ...] = (
    Option(
        "config_file", "--config", "CONFIG_FILE", None, ConfigFileKind(), "",
        "the config file: NVIDIA's version: v1 schema plus an agent: section",
        aliases=("--config-file",), default_text="none",
    ),
    Option(
        "mode", "--mode", "GPU_AGENT_MODE", "agent.mode", ChoiceKind(*MODES), MODES[0],
        "what the agent serves kubelet: device-plugin (the device-plugin API: nvidia.com/gpu "
        "and its MIG and shared resources) or dra (the DRA driver gpu.nvidia.com: "
        "ResourceSlices and prepared claims, docs/dra.md); a change takes a restart",
    ),
    Option(
        "kubelet_dir", "--kubelet-dir", "GPU_AGENT_KUBELET_DIR", "agent.kubeletDir",
        PathKind(), DEFAULT_KUBELET_DIR,
        "kubelet's root directory (its --root-dir): in dra mode the DRA plugin's sockets go "
        "in its plugins_registry and plugins directories",
    ),
    Option(
        "dra_reboot_taint", "--dra-reboot-taint", "GPU_AGENT_DRA_REBOOT_TAINT",
        "agent.draRebootTaint", ChoiceKind(*REBOOT_TAINT_EFFECTS), REBOOT_TAINT_EFFECTS[0],
        "in dra mode, the effect of the taint on a device withdrawn for a fault only a reboot "
        "ends (XID 79, docs/health.md): NoExecute evicts the pods using it, NoSchedule only "
        "keeps new claims off it; every other withdrawal taints NoSchedule",
    ),
    Option(
        "dra_shared_gpus", "--dra-shared-gpus", "GPU_AGENT_DRA_SHARED_GPUS",
        "agent.draSharedGpus", GpuListKind(), (),
        "in dra mode, the GPUs (indexes or UUIDs, or `all`) published as shareable by "
        "consumable capacity (KEP-5075): several claims each get the memory and share of SMs "
        "they ask, enforced by the GPU's MPS control daemon; a claim asking no capacity gets "
        "the GPU whole",
        default_text="none",
    ),
    Option(
        "dra_dynamic_mig", "--dra-dynamic-mig", "GPU_AGENT_DRA_DYNAMIC_MIG",
        "agent.draDynamicMig", GpuListKind(), (),
        "in dra mode, the MIG-enabled GPUs (indexes or UUIDs, or `all`) partitioned on demand "
        "(KEP-4815, Kubernetes 1.36+): every placement of every MIG profile published, the "
        "MIG device made at prepare and destroyed at unprepare; their instances are the "
        "agent's to make",
        default_text="none",
    ),
    Option(
        "mig_strategy", "--mig-strategy", "MIG_STRATEGY", "flags.migStrategy",
        ChoiceKind(*MIG_STRATEGIES), DEFAULT_MIG_STRATEGY,
        "how MIG devices on MIG-enabled GPUs are exposed",
    ),
    Option(
        "fail_on_init_error", "--fail-on-init-error", "FAIL_ON_INIT_ERROR",
        "flags.failOnInitError", BoolKind(), True,
        "exit if initialisation fails (false: log it and wait instead)",
    ),
    Option(
        "driver_root", "--driver-root", "NVIDIA_DRIVER_ROOT", "flags.nvidiaDriverRoot",
        PathKind(), DEFAULT_DRIVER_ROOT,
        "root of the NVIDIA driver installation on the host",
        aliases=("--nvidia-driver-root",),
    ),
    Option(
        "dev_root", "--dev-root", "NVIDIA_DEV_ROOT", "flags.nvidiaDevRoot",
        PathKind(empty="the driver root"), "",
        "root under which the NVIDIA device nodes (/dev/nvidia*) are; empty: the driver root",
        aliases=("--nvidia-dev-root",), default_text="the driver root",
    ),
    Option(
        "pass_device_specs", "--pass-device-specs", "PASS_DEVICE_SPECS",
        "flags.plugin.passDeviceSpecs", BoolKind(), False,
        "pass the device nodes (DeviceSpecs) to kubelet in Allocate responses",
    ),
    Option(
        "device_list_strategy", "--device-list-strategy", "DEVICE_LIST_STRATEGY",
        "flags.plugin.deviceListStrategy", ChoiceListKind(*DEVICE_LIST_STRATEGIES),
        DEFAULT_DEVICE_LIST_STRATEGIES,
        "how the allocated devices are passed to the container runtime (several allowed)",
    ),
    Option(
        "device_id_strategy", "--device-id-strategy", "DEVICE_ID_STRATEGY",
        "flags.plugin.deviceIDStrategy", ChoiceKind(*DEVICE_ID_STRATEGIES),
        DEFAULT_DEVICE_ID_STRATEGY,
        "how devices are named to the container runtime",
    ),
    Option(
        "cdi_annotation_prefix", "--cdi-annotation-prefix", "CDI_ANNOTATION_PREFIX",
        "flags.plugin.cdiAnnotationPrefix", TextKind(), DEFAULT_CDI_ANNOTATION_PREFIX,
        "prefix of the CDI annotation keys (device-list strategy cdi-annotations)",
    ),
    Option(
        "kubelet_socket", "--kubelet-socket", "KUBELET_SOCKET", "flags.plugin.kubeletSocket",
        PathKind(empty="do not connect to kubelet"), DEFAULT_KUBELET_SOCKET,
        "kubelet's registration socket; the plugin sockets go in its directory",
    ),
    Option(
        "state_dir", "--state-dir", "GPU_AGENT_STATE_DIR", "agent.stateDir",
        PathKind(), DEFAULT_STATE_DIR,
        "where the agent keeps its checkpoints",
    ),
    Option(
        "nvml_library", "--nvml-library", "GPU_AGENT_NVML_LIBRARY", "agent.nvmlLibrary",
        NvmlLibraryKind(), NVML_SONAME,
        f"the NVML library: {NVML_SONAME} (looked up under the driver root) or an absolute path",
        default_text=f"{NVML_SONAME} under the driver root",
    ),
    Option(
        "mps_root", "--mps-root", "MPS_ROOT", "flags.mpsRoot",
        PathKind(empty=f"the default, {DEFAULT_MPS_ROOT}"), DEFAULT_MPS_ROOT,
        "with sharing.mps: where each GPU's MPS control daemon gets its pipe and log "
        "directories, and the /dev/shm it shares with its clients",
    ),
    Option(
        "mps_control", "--mps-control", "GPU_AGENT_MPS_CONTROL", "agent.mpsControl",
        PathKind(empty=f"{MPS_CONTROL} under the driver root"), "",
        f"with sharing.mps: the {MPS_CONTROL} program the agent runs",
        default_text=f"usr/bin/{MPS_CONTROL} under the driver root",
    ),
    Option(
        "checkpoint_device_id_strategy", "--checkpoint-device-id-strategy",
        "CHECKPOINT_DEVICE_ID_STRATEGY", "agent.checkpointDeviceIDStrategy",
        ChoiceKind(*DEVICE_ID_STRATEGIES), DEFAULT_DEVICE_ID_STRATEGY,
        "how checkpointed allocations find their GPUs after a restart: by UUID, or by index "
        "(for VMs whose GPU UUIDs change on cold migration)",
    ),
    Option(
        "pod_resources_socket", "--pod-resources-socket", "GPU_AGENT_POD_RESOURCES_SOCKET",
        "agent.podResourcesSocket", PathKind(empty="do not attribute allocations to pods"),
        DEFAULT_POD_RESOURCES_SOCKET,
        "kubelet's podresources socket, asked which pod holds which allocated devices",
    ),
    Option(
        "reconcile_interval", "--reconcile-interval", "GPU_AGENT_RECONCILE_INTERVAL",
        "agent.reconcileInterval", IntervalKind(), DEFAULT_RECONCILE_INTERVAL_S,
        "how often allocations are matched to pods through podresources, besides at start "
        "and after Allocate; 0: only then",
    ),
    Option(
        "ended_pod_grace", "--ended-pod-grace", "GPU_AGENT_ENDED_POD_GRACE",
        "agent.endedPodGrace", IntervalKind(minimum=0.0), DEFAULT_ENDED_POD_GRACE_S,
        "how long podresources must keep not listing a pod before its allocations are "
        "dropped (a restarted kubelet lists its pods only once it has read them from the API "
        "server); 0: at the first listing without it",
    ),
    Option(
        "journal_sync_interval", "--journal-sync-interval", "GPU_AGENT_JOURNAL_SYNC_INTERVAL",
        "agent.journalSyncInterval", IntervalKind(minimum=0.01), DEFAULT_JOURNAL_SYNC_INTERVAL_S,
        "how often the allocation journal is fdatasynced in the background (records are "
        "written before Allocate answers, so an agent crash loses none); 0: sync before every "
        "Allocate answers",
    ),
    Option(
        "mig_check_interval", "--mig-check-interval", "GPU_AGENT_MIG_CHECK_INTERVAL",
        "agent.migCheckInterval", IntervalKind(), DEFAULT_MIG_CHECK_INTERVAL_S,
        "how often the MIG layout is read to find instances created or destroyed (under "
        "migStrategy single or mixed); 0: only at start and on SIGHUP",
    ),
    Option(
        "nvml_call_timeout", "--nvml-call-timeout", "GPU_AGENT_NVML_CALL_TIMEOUT",
        "agent.nvmlCallTimeout", IntervalKind(), DEFAULT_NVML_CALL_TIMEOUT_S,
        "how long an NVML call on a GPU may take: a GPU whose call takes longer is withdrawn "
        "as not answering until the call returns, and no caller waits on it meanwhile; 0: "
        "calls are waited for however long they take",
    ),
    Option(
        "allocation_policy", "--allocation-policy", "GPU_AGENT_ALLOCATION_POLICY",
        "agent.allocationPolicy", ChoiceKind(*ALLOCATION_POLICIES), DEFAULT_ALLOCATION_POLICY,
        "how GetPreferredAllocation picks GPUs: the best-linked set (best-effort), or the "
        "tightest topology group that fits first, keeping whole NVLink islands free (packed)",
    ),
    Option(
        "replica_allocation_policy", "--shared-devices-allocation-policy",
        "SHARED_DEVICES_ALLOCATION_POLICY", "flags.plugin.sharedDevicesAllocationPolicy",
        ChoiceKind(*REPLICA_ALLOCATION_POLICIES), DEFAULT_REPLICA_ALLOCATION_POLICY,
        "how shared replicas are picked: spread over the least used GPUs (distributed), or "
        "fill GPUs already in use first (packed); NVIDIA's v0.20 names",
        aliases=("--replica-allocation-policy",),
    ),
    Option(
        "disable_healthchecks", "--disable-healthchecks", "DP_DISABLE_HEALTHCHECKS",
        "agent.health.disableHealthchecks", XidListKind(), "",
        "XIDs to ignore besides NVIDIA's defaults (comma-separated), or all/xids to turn "
        "health checks off, as NVIDIA's plugin reads DP_DISABLE_HEALTHCHECKS (docs/health.md)",
        default_text="none",
    ),
    Option(
        "enable_healthchecks", "--enable-healthchecks", "DP_ENABLE_HEALTHCHECKS",
        "agent.health.enableHealthchecks", XidListKind(), "",
        "XIDs that withdraw a GPU even when ignored by default or disabled (comma-separated), "
        "or all, as NVIDIA's plugin reads DP_ENABLE_HEALTHCHECKS",
        default_text="none",
    ),
    Option(
        "xid_policy", "--xid-policy", "GPU_AGENT_XID_POLICY", "agent.health.xidPolicy",
        ChoiceKind(*XID_POLICIES), DEFAULT_XID_POLICY,
        "the default XID table: nvidia (NVIDIA's device plugin: six application XIDs, every "
        "other XID withdraws the GPU) or catalog (NVIDIA's XID catalog's immediate action for "
        "each XID); xidActions and DP_*_HEALTHCHECKS apply on top",
    ),
    Option(
        "xid_actions", "--xid-actions", "GPU_AGENT_XID_ACTIONS", "agent.health.xidActions",
        XidActionsKind(), (),
        "XID action classes over the xidPolicy table: ignore, application, reset, reboot "
        "(text 48=reset,79=reboot; in the file a mapping)",
        default_text="the xidPolicy table",
    ),
    Option(
        "recovery_quiet_period", "--recovery-quiet-period", "GPU_AGENT_RECOVERY_QUIET_PERIOD",
        "agent.health.recoveryQuietPeriod", IntervalKind(minimum=0.0),
        DEFAULT_RECOVERY_QUIET_PERIOD_S,
        "how long a GPU withdrawn for a reset-class error must stay free of critical events "
        "(and then pass a probe) before it returns",
    ),
    Option(
        "unhealthy_devices_file", "--unhealthy-devices-file",
        "GPU_AGENT_UNHEALTHY_DEVICES_FILE", "agent.health.unhealthyDevicesFile",
        PathKind(empty="no isolation file"), DEFAULT_ISOLATION_FILE,
        "the manual isolation file {\"index\": [...], \"uuid\": [...]}: devices listed are "
        "withdrawn; empty: none",
    ),
    Option(
        "cdi_spec_dirs", "--cdi-spec-dirs", "GPU_AGENT_CDI_SPEC_DIRS", "agent.cdiSpecDirs",
        PathListKind(), DEFAULT_CDI_SPEC_DIRS,
        "where nvidia-container-toolkit's CDI specs are, checked with a cdi-* device-list "
        "strategy (later directories take precedence, as in the CDI spec)",
    ),
    Option(
        "dev_char_symlinks", "--dev-char-symlinks", "GPU_AGENT_DEV_CHAR_SYMLINKS",
        "agent.devCharSymlinks", BoolKind(), DEFAULT_DEV_CHAR_SYMLINKS,
        "create the missing /dev/char/MAJOR:MINOR links of the NVIDIA device nodes under "
        "the device-node root, at start and when nodes appear, so that containers keep their "
        "GPUs across `systemctl daemon-reload` (nvidia-ctk system create-dev-char-symlinks)",
    ),
    Option(
        "metrics_address", "--metrics-address", "GPU_AGENT_METRICS_ADDRESS",
        "agent.metricsAddress", ListenAddressKind(), DEFAULT_METRICS_ADDRESS,
        "where the Prometheus endpoint /metrics listens ([host]:port; no host: every "
        "address); empty: no endpoint",
    ),
    Option(
        "nfd_features_file", "--nfd-features-file", "GPU_AGENT_NFD_FEATURES_FILE",
        "agent.nfdFeaturesFile", PathKind(empty="no node feature labels"),
        DEFAULT_NFD_FEATURES_FILE,
        "the node-feature-discovery features.d file the agent keeps with gpu-feature-discovery's "
        "labels (written when the GPUs, MIG layout or sharing change); empty: none",
    ),
    Option(
        "kubeconfig", "--kubeconfig", "GPU_AGENT_KUBECONFIG", "agent.kubeconfig",
        PathKind(empty="no Kubernetes API: no events, no node condition"), DEFAULT_KUBECONFIG,
        "the kubeconfig the agent reaches the Kubernetes API server with, for the fault events "
        "and the node condition (the kubelet's own by default; a file that is not there yet is "
        "looked for again every 10 s); empty: no API",
    ),
    Option(
        "node_name", "--node-name", "NODE_NAME", "agent.nodeName", NodeNameKind(), "",
        "this node's name in Kubernetes (NVIDIA's plugin and gpu-feature-discovery read "
        "NODE_NAME too); empty: the host name, lowercased, as kubelet takes it by default",
        default_text="the host name",
    ),
    Option(
        "fault_events", "--fault-events", "GPU_AGENT_FAULT_EVENTS", "agent.faultEvents",
        BoolKind(), True,
        "post Kubernetes Events when a GPU is withdrawn or returns: on the Node, and on each "
        "pod holding the GPU at that moment",
    ),
    Option(
        "node_condition", "--node-condition", "GPU_AGENT_NODE_CONDITION", "agent.nodeCondition",
        BoolKind(), True,
        f"keep the Node condition {CONDITION_TYPE}: False naming the GPUs withdrawn and why, "
        "True when all are in",
    ),
    # Per-node configs (docs/configuration.md): as NVIDIA's config-manager chooses one, with its
    # environment variable names. Read from the flags, the environment and the config file
    # named by --config only: a named config cannot move the choice that chose it.
    Option(
        "config_dir", "--config-dir", "CONFIG_FILE_SRCDIR", "agent.configDir",
        PathKind(empty="no named configs"), DEFAULT_CONFIG_DIR,
        "the directory of named configs (NAME.yaml, or NAME as a ConfigMap mounts it); when it "
        "holds any, the node label chooses the one used in place of --config; empty or no "
        "such directory: none", aliases=("--config-file-srcdir",),
    ),
    Option(
        "node_label", "--node-label", "NODE_LABEL", "agent.nodeLabel", TextKind(),
        DEFAULT_NODE_LABEL,
        "the label of this Node whose value names the config to use (read and watched through "
        "the kubeconfig; a change applies at once, as SIGHUP)",
    ),
    Option(
        "default_config", "--default-config", "DEFAULT_CONFIG", "agent.defaultConfig",
        ConfigNameKind(), "",
        "the named config of a node without the label (NVIDIA's config.default); empty: the "
        "fallback strategies choose", default_text="none",
    ),
    Option(
        "fallback_strategies", "--fallback-strategies", "FALLBACK_STRATEGIES",
        "agent.fallbackStrategies", ChoiceListKind(*FALLBACK_STRATEGIES),
        DEFAULT_FALLBACK_STRATEGIES,
        f"with no label and no default config, tried in order: named (the config "
        f"'{NAMED_CONFIG_FALLBACK}'), single (the only config there is), empty (the --config "
        f"file, or none); when all fail, the --config file",
    ),
)

# The options that choose the named config: they keep the values the flags, the environment and
# the --config file give them whichever config is chosen.
SELECTION_OPTIONS = ("config_dir", "node_label", "default_config", "fallback_strategies")

OPTIONS_BY_NAME = {opt.name: opt for opt in OPTIONS}
OPTIONS_BY_KEY = {opt.key: opt for opt in OPTIONS if opt.key}
