"""The doctor's kubelet checks: kubelet's sockets answer, kubelet's allocatable devices match
what the agent advertises, and the agent is registered and healthy.

Owns: the checks `kubelet.*`. The allocatable check is the node-side form of the "is
nvidia.com/gpu allocatable 0" loop operators script with kubectl: kubelet's own answer
(podresources GetAllocatableResources, through agent.kubelet.podresources' client, bounded by
the doctor's timeout) against the healthy devices the running agent reports in status.json, or,
when no agent runs, the devices discovery and the config give. Must not register anything,
import grpc itself, or change the agent's state.
"""

from __future__ import annotations

import os
import socket

from agent.doctor.context import Context
from agent.doctor.driver import nvml_facts
from agent.doctor.model import Finding, Spec, fail, ok, skip, warn, worst
from agent.doctor.service import agent_status
from agent.errors import MigLayoutError, PodResourcesError

KUBELET_FIX = "`systemctl status kubelet`; start it with `systemctl start kubelet`"
_SHOWN = 4  # device IDs named per difference


def connect(path: str, timeout: float) -> str:
    """"" when something accepts connections on the unix socket `path`, else why not."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except socket.timeout:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        sock.close()
    return ""


def _dra_mode(ctx: Context) -> Finding | None:
    if ctx.cfg.mode == "dra":
        return skip("agent.mode dra: no device-plugin resource is registered (see dra.*)")
    return None


def check_socket(ctx: Context) -> Finding:
    if (skipped := _dra_mode(ctx)) is not None:
        return skipped
    path = ctx.cfg.kubelet_socket
    if not path:
        return skip("no kubelet socket configured (--kubelet-socket ''): the agent does not "
                    "register")
    if not os.path.exists(path):
        return fail(f"{path} does not exist: kubelet is not running, or its root directory "
                    f"is elsewhere (--kubelet-socket, flags.plugin.kubeletSocket)", KUBELET_FIX)
    problem = connect(path, ctx.timeout)
    if problem:
        return fail(f"{path} does not answer: {problem} (a socket left by a stopped kubelet)",
                    KUBELET_FIX)
    return ok(f"{path} answers")


def podresources_allocatable(ctx: Context) -> tuple[dict | None, PodResourcesError | None]:
    """kubelet's allocatable device IDs per resource (once per run), or the error."""
    def ask():
        from agent.kubelet.podresources import PodResourcesClient

        client = PodResourcesClient(ctx.cfg.pod_resources_socket, timeout=ctx.timeout)
        try:
            return client.allocatable(), None
        except PodResourcesError as exc:
            return None, exc
        finally:
            client.close()
    return ctx.memo("allocatable", ask)


def check_podresources(ctx: Context) -> Finding:
    path = ctx.cfg.pod_resources_socket
    if not path:
        return skip("no podresources socket configured (agent.podResourcesSocket ''): "
                    "allocations are not matched to pods")
    alloc, error = podresources_allocatable(ctx)
    if error is None:
        return ok(f"{path} answers GetAllocatableResources ({len(alloc)} resources)")
    if error.kind == "unimplemented":
        return warn(str(error), "upgrade kubelet to Kubernetes 1.23 or later")
    fix = (f"kubelet serves it at /var/lib/kubelet/pod-resources/kubelet.sock; point "
           f"--pod-resources-socket (agent.podResourcesSocket) at it; {KUBELET_FIX}")
    return fail(str(error), fix)


def advertised(ctx: Context) -> tuple[dict[str, set] | None, str]:
    """(healthy device IDs per resource the agent advertises, where that comes from)."""
    doc, _error = agent_status(ctx)
    if doc is not None and doc.get("running"):
        return ({r["name"]: {d["id"] for d in r["devices"] if d["healthy"]}
                 for r in doc.get("resources", [])},
                f"the running agent (pid {doc.get('pid')}, status.json)")
    facts = nvml_facts(ctx)
    if not facts.up:
        return None, "no agent runs and NVML does not load"
    try:
        by_resource = facts.device_map(ctx.cfg)
    except MigLayoutError as exc:
        return None, f"no agent runs and the MIG layout is refused ({exc})"
    return ({name: {d.id for d in devices} for name, devices in by_resource.items()},
            "discovery and the config (no agent runs)")


def _ids(ids: set) -> str:
    shown = sorted(ids)[:_SHOWN]
    more = f" and {len(ids) - _SHOWN} more" if len(ids) > _SHOWN else ""
    return ", ".join(shown) + more


def check_allocatable(ctx: Context) -> Finding:
    if (skipped := _dra_mode(ctx)) is not None:
        return skipped
    if not ctx.cfg.pod_resources_socket:
        return skip("no podresources socket configured")
    alloc, error = podresources_allocatable(ctx)
    if error is not None:
        return skip("needs kubelet's podresources (see kubelet.podresources)")
    expected, source = advertised(ctx)
    if expected is None:
        return skip(f"nothing to compare with: {source}")
    restart = ("`systemctl restart gpu-agent` (it registers again); if that does not help, "
               "`journalctl -u kubelet | grep -i device` and `journalctl -u gpu-agent -e`")
    findings = []
    for name, want in sorted(expected.items()):
        have = set(alloc.get(name, ()))
        if want and not have:
            findings.append(fail(f"kubelet reports 0 allocatable {name}, while {source} "
                                 f"advertises {len(want)} healthy devices", restart))
        elif want != have:
            parts = []
            if want - have:
                parts.append(f"not allocatable in kubelet: {_ids(want - have)}")
            if have - want:
                parts.append(f"allocatable in kubelet but not advertised: {_ids(have - want)}")
            findings.append(fail(f"{name}: kubelet's {len(have)} allocatable devices differ "
                                 f"from the {len(want)} healthy ones {source} advertises "
                                 f"({'; '.join(parts)})", restart))
        else:
            findings.append(ok(f"{name}: {len(have)} allocatable, as {source} advertises"))
    for name in sorted(set(alloc) - set(expected)):
        if name.startswith("nvidia.com/"):
            findings.append(warn(f"kubelet has {len(alloc[name])} allocatable {name}, which "
                                 f"this agent does not advertise: another device plugin "
                                 f"(NVIDIA's DaemonSet?) serves it on this node",
                                 "run one device plugin per node: remove the other one from "
                                 "this node"))
    if not findings:
        return ok(f"nothing advertised ({source}) and no nvidia.com resource in kubelet")
    return worst(findings)


def check_registration(ctx: Context) -> Finding:
    if (skipped := _dra_mode(ctx)) is not None:
        return skipped
    doc, error = agent_status(ctx)
    state_dir = ctx.cfg.state_dir
    start = "systemctl enable --now gpu-agent"
    if error:
        return fail(error, f"remove the damaged {state_dir}/status.json; the agent rewrites "
                           f"it: `systemctl restart gpu-agent`")
    if doc is None:
        return fail(f"no agent has run with state directory {state_dir} (no status.json)",
                    f"{start} (or give the doctor the agent's --config / --state-dir)")
    if not doc.get("running"):
        return fail(f"the agent (pid {doc.get('pid')}) is not running; it last said: "
                    f"{doc.get('summary')}", f"`journalctl -u gpu-agent -e` says why it "
                                              f"stopped; then {start}")
    findings = []
    if doc.get("kubeletSocket") != ctx.cfg.kubelet_socket:
        findings.append(warn(f"the running agent uses kubelet socket "
                             f"{doc.get('kubeletSocket') or 'none'}, these checks "
                             f"{ctx.cfg.kubelet_socket or 'none'}",
                             "give the doctor the agent's configuration (--config or the "
                             "same flags)"))
    findings += _advertised_vs_discovered(ctx, doc)
    nvml = doc.get("nvml") or {}
    if not nvml.get("up"):
        findings.append(fail(f"the agent runs without NVML: {nvml.get('error') or 'starting'}",
                             "see driver.nvml; the agent retries by itself"))
    resources = doc.get("resources") or []
    if nvml.get("up") and not resources:
        findings.append(warn("the agent advertises no resource (no GPU it can advertise)",
                             "see driver.gpus and driver.mig"))
    for r in resources:
        if not r.get("registered"):
            findings.append(fail(f"{r['name']} is not registered with kubelet"
                                 + (f": {r['lastError']}" if r.get("lastError") else ""),
                                 f"{KUBELET_FIX}; the agent registers as soon as kubelet "
                                 f"answers"))
            continue
        bad = [d for d in r["devices"] if not d["healthy"]]
        if bad:
            findings.append(warn(
                f"{r['name']}: {len(bad)} of {len(r['devices'])} devices unhealthy: "
                + ", ".join(f"GPU {d['index']} {d['uuid']}"
                            + (f" ({d['reason']})" if d.get("reason") else "")
                            for d in bad[:_SHOWN]),
                "`gpu-agent status` says why; reset-class XIDs recover by themselves "
                "(docs/health.md), otherwise reset the GPU (`nvidia-smi -i N -r`) or reboot"))
        else:
            findings.append(ok(f"{r['name']} registered ({r.get('registrations')} "
                               f"registrations), {len(r['devices'])} devices healthy"))
    return worst([ok(f"the agent runs (pid {doc.get('pid')}, version {doc.get('version')})")]
                 + findings)


def _advertised_vs_discovered(ctx: Context, doc: dict) -> list[Finding]:
    """The running agent's devices against what discovery and the config give now (GPUs
    gone or new since the agent last discovered)."""
    facts = nvml_facts(ctx)
    if not facts.up or not (doc.get("nvml") or {}).get("up"):
        return []
    try:
        now = {d.id for ds in facts.device_map(ctx.cfg).values() for d in ds}
    except MigLayoutError as exc:
        return [warn(f"the node's MIG layout now is refused by migStrategy "
                     f"{ctx.cfg.mig_strategy}: {exc}", "see docs/mig.md")]
    advertised = {d["id"] for r in doc.get("resources") or [] for d in r["devices"]}
    if now == advertised:
        return []
    parts = []
    if advertised - now:
        parts.append(f"advertised but not found by NVML now: {_ids(advertised - now)}")
    if now - advertised:
        parts.append(f"found by NVML but not advertised: {_ids(now - advertised)}")
    return [warn(f"the agent's devices are not the node's GPUs now ({'; '.join(parts)})",
                 "systemctl reload gpu-agent (it discovers the GPUs again)")]


CHECKS = (
    Spec("kubelet.socket", "kubelet's registration socket answers", check_socket),
    Spec("kubelet.podresources", "kubelet's podresources socket answers", check_podresources),
    Spec("kubelet.allocatable", "kubelet's allocatable devices match what the agent "
                                "advertises", check_allocatable),
    Spec("kubelet.registration", "the agent is registered and its devices healthy",
         check_registration),
)
