"""The doctor's driver checks: NVML loads, the driver and CUDA versions, every GPU answers,
persistence mode, MIG modes.

Owns: `nvml_facts` (NVML's view of the node, gathered once per run in a bounded thread through
agent.nvml: library, discovery, probe, driver) and the checks `driver.*`. Reads only: NVML
is initialised and shut down again, no setting changes. Must not import pynvml (agent.nvml
talks to NVML) nor grpc.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from agent.doctor.context import Context
from agent.doctor.model import Finding, Spec, fail, ok, skip, warn, worst
from agent.errors import NvmlError, NvmlLibraryError


@dataclass
class NvmlFacts:
    """What NVML said. `error` is "" when NVML loaded and discovery ran."""

    library: str = ""
    error: str = ""
    info: object = None  # agent.nvml.driver.DriverInfo
    gpus: list = field(default_factory=list)  # agent.nvml.discovery.Gpu, as discovered
    lost: list = field(default_factory=list)  # indices NVML counts but cannot read
    unanswered: dict = field(default_factory=dict)  # index -> what the probe said
    settings: list = field(default_factory=list)  # agent.nvml.driver.GpuSettings
    settings_errors: dict = field(default_factory=dict)  # index -> error
    migs: list = field(default_factory=list)  # agent.nvml.mig.MigDevice of MIG-enabled GPUs

    @property
    def up(self) -> bool:
        return not self.error

    def device_map(self, cfg) -> dict:
        """The devices of each resource the agent would advertise on these GPUs under `cfg`
        (its MIG strategy included); MigLayoutError for a layout the strategy refuses."""
        from agent.rm.devices import devices_by_resource

        return devices_by_resource(self.gpus, cfg.resources.gpus, strategy=cfg.mig_strategy,
                                   migs=self.migs, mig_patterns=cfg.resources.mig)


def _gather(ctx: Context) -> NvmlFacts:
    from agent.nvml import discovery, library, probe
    from agent.nvml import driver as nvml_driver

    cfg = ctx.cfg
    facts = NvmlFacts(library=cfg.nvml_library)
    try:
        facts.library = library.resolve_library_path(cfg.driver_root, cfg.nvml_library_explicit)
        library.init(facts.library)
    except (NvmlError, NvmlLibraryError) as exc:
        facts.error = str(exc)
        return facts
    try:
        facts.info = nvml_driver.driver_info()
        facts.gpus = discovery.discover()
        if ctx.cfg.mig_strategy != "none":
            from agent.nvml import mig

            facts.migs = mig.read_mig_devices(facts.gpus)
        found = {g.index for g in facts.gpus}
        facts.lost = [i for i in range(facts.info.gpu_count) if i not in found]
        for gpu in facts.gpus:
            problem = probe.probe(gpu.uuid, gpu.pci_bus_id)
            if problem:
                facts.unanswered[gpu.index] = problem
                continue
            try:
                facts.settings.append(nvml_driver.gpu_settings(gpu.index))
            except NvmlError as exc:
                facts.settings_errors[gpu.index] = str(exc)
    except NvmlError as exc:
        facts.error = f"NVML loaded from {facts.library} but {exc}"
    finally:
        try:
            library.shutdown()
        except NvmlError:
            pass  # a shutdown failure changes nothing of what was read
    return facts


def nvml_facts(ctx: Context) -> NvmlFacts:
    """NVML's view of the node, read once per run; bounded by ctx.nvml_timeout (a wedged driver
    that never answers is itself a finding)."""
    def read() -> NvmlFacts:
        box: dict = {}

        def target() -> None:
            box["facts"] = _gather(ctx)  # a bug here: Python prints the thread's trace

        thread = threading.Thread(target=target, name="doctor-nvml", daemon=True)
        thread.start()
        thread.join(ctx.nvml_timeout)
        if thread.is_alive():
            return NvmlFacts(library=ctx.cfg.nvml_library,
                             error=f"NVML did not answer within {ctx.nvml_timeout:g} s "
                                   f"(a hung driver: check `dmesg` for NVRM/Xid messages)")
        if "facts" not in box:
            return NvmlFacts(library=ctx.cfg.nvml_library,
                             error="reading NVML failed unexpectedly (the trace is above)")
        return box["facts"]
    return ctx.memo("nvml", read)


NVML_FIX = ("check that the driver is loaded (`lsmod | grep nvidia`, `nvidia-smi`) and that "
            "--nvml-library / --driver-root (agent.nvmlLibrary, flags.nvidiaDriverRoot) name "
            "the driver's libnvidia-ml.so.1")


def check_nvml(ctx: Context) -> Finding:
    facts = nvml_facts(ctx)
    if not facts.up:
        return fail(f"NVML does not load: {facts.error}", NVML_FIX)
    return ok(f"NVML loaded from {facts.library}")


def _needs_nvml(ctx: Context) -> NvmlFacts | Finding:
    facts = nvml_facts(ctx)
    return facts if facts.up else skip("needs NVML (see driver.nvml)")


def check_versions(ctx: Context) -> Finding:
    facts = _needs_nvml(ctx)
    if isinstance(facts, Finding):
        return facts
    info = facts.info
    return ok(f"driver {info.driver_version}, CUDA driver {info.cuda_text} "
              f"({info.cuda_driver_version}); {info.gpu_count} GPUs")


def check_gpus(ctx: Context) -> Finding:
    facts = _needs_nvml(ctx)
    if isinstance(facts, Finding):
        return facts
    findings = []
    if facts.lost:
        findings.append(fail(
            f"NVML counts {facts.info.gpu_count} GPUs but cannot read "
            f"{', '.join(f'GPU {i}' for i in facts.lost)} (GPU_IS_LOST: fallen off the bus)",
            "check `dmesg` for Xid 79 / NVRM errors; reset the GPU (`nvidia-smi -i N -r`) or "
            "reboot, then `systemctl reload gpu-agent`"))
    for index, problem in sorted(facts.unanswered.items()):
        gpu = next(g for g in facts.gpus if g.index == index)
        findings.append(fail(f"GPU {index} {gpu.uuid} does not answer: {problem}",
                             f"`nvidia-smi -q -i {index}`; reset it (`nvidia-smi -i {index} "
                             f"-r`) or reboot"))
    if not facts.gpus and not facts.lost:
        findings.append(warn("NVML finds no GPUs: the agent advertises nothing",
                             "check `nvidia-smi -L` and `lspci -d 10de:`"))
    if not findings:
        findings.append(ok(f"all {len(facts.gpus)} GPUs answer (GPU "
                           f"{', '.join(str(g.index) for g in facts.gpus)})"))
    return worst(findings)


def check_persistence(ctx: Context) -> Finding:
    facts = _needs_nvml(ctx)
    if isinstance(facts, Finding):
        return facts
    known = [s for s in facts.settings if s.persistence is not None]
    if not known:
        return skip("NVML does not report persistence mode on these GPUs")
    off = [s.index for s in known if not s.persistence]
    if off:
        return warn(f"persistence mode is off on GPU {', '.join(map(str, off))}: the driver "
                    f"tears the GPUs down when no client holds them, so every start (the "
                    f"agent's, each container's) waits for their initialisation",
                    "systemctl enable --now nvidia-persistenced")
    return ok(f"persistence mode on for all {len(known)} GPUs")


def check_mig(ctx: Context) -> Finding:
    facts = _needs_nvml(ctx)
    if isinstance(facts, Finding):
        return facts
    findings = []
    capable = [s for s in facts.settings if s.mig_current is not None]
    pending = [s for s in capable if s.mig_pending != s.mig_current]
    if pending:
        ids = ",".join(str(s.index) for s in pending)
        findings.append(warn("a MIG mode change is pending (applied at the next GPU reset) on "
                             + ", ".join(f"GPU {s.index} (MIG "
                                         f"{'enabled' if s.mig_pending else 'disabled'} after)"
                                         for s in pending),
                             f"stop the GPUs' processes, then `nvidia-smi -i {ids} -r` (or "
                             f"reboot); then `systemctl reload gpu-agent`"))
    whole = [s for s in capable if s.mig_current] if ctx.cfg.mig_strategy == "none" else []
    if whole:  # NVIDIA's plugin does the same (internal/rm/device_map.go, buildGPUDeviceMap)
        ids = ",".join(str(s.index) for s in whole)
        findings.append(warn(f"MIG is enabled on GPU {', '.join(str(s.index) for s in whole)}: "
                             f"with migStrategy none the agent advertises "
                             f"{'it' if len(whole) == 1 else 'them'} as whole GPUs, and a "
                             f"container given one sees its MIG devices",
                             f"to use the GPU whole, disable MIG: `nvidia-smi -i {ids} -mig 0`, "
                             f"then `nvidia-smi -i {ids} -r`"))
    for index, error in sorted(facts.settings_errors.items()):
        findings.append(warn(f"GPU {index}: settings unreadable: {error}", None))
    if findings:
        return worst(findings)
    if not capable:
        return skip("no MIG-capable GPU")
    return ok(f"no MIG mode change pending ({len(capable)} MIG-capable GPUs, MIG enabled on "
              f"{sum(1 for s in capable if s.mig_current)})")


CHECKS = (
    Spec("driver.nvml", "NVML loads", check_nvml),
    Spec("driver.versions", "driver and CUDA driver versions", check_versions),
    Spec("driver.gpus", "every GPU answers", check_gpus),
    Spec("driver.persistence", "persistence mode", check_persistence),
    Spec("driver.mig", "MIG mode changes pending", check_mig),
)
