"""The doctor's device-node checks: the NVIDIA device nodes exist, and each has its
`/dev/char/<major>:<minor>` link.

Why the links matter: with systemd managing the cgroups, runc hands systemd a container's
device rules as /dev/char/<major>:<minor> paths (systemd names devices by path, the OCI spec by
number) and leaves out those whose link does not exist; `systemctl daemon-reload` makes systemd
re-apply every scope's device policy from what it knows, so a container whose NVIDIA nodes had
no link loses them, and its next CUDA/NVML call fails with "Failed to initialize NVML: Unknown
Error" (nvidia-container-toolkit issues #48, #251, #1227). Device nodes only
nvidia-container-runtime's hook added (envvar without passDeviceSpecs) are not in the spec at
all: systemd never learns them. NVIDIA's fix for Kubernetes is both: the links (`nvidia-ctk
system create-dev-char-symlinks --create-all`) and the nodes in the spec (passDeviceSpecs, or
CDI).

Owns: the checks `devices.*`, on the nodes agent.devchar lists (`list_nodes`: the names the
toolkit links, a simulated driver tree's recorded numbers for entries that are not character
devices), the same nodes the agent's start log counts. Must not create, remove or change any
node or link.
"""

from __future__ import annotations

import os
import re

from agent.devchar import SIM_RECORD, Node
from agent.devchar import list_nodes as devchar_nodes
from agent.doctor.context import Context
from agent.doctor.driver import nvml_facts
from agent.doctor.model import Finding, Spec, fail, ok, warn, worst

DEV = "/dev"
DEV_CHAR = "/dev/char"
CAPS_DIR = "nvidia-caps"
_GPU_NODE = re.compile(r"^/dev/nvidia\d+$")
SIM_NODES_FILE = f"{DEV}/{SIM_RECORD}"
DEV_CHAR_COMMAND = "nvidia-ctk system create-dev-char-symlinks --create-all"


def list_nodes(ctx: Context) -> list[Node]:
    """The NVIDIA device nodes under ROOT/dev, as the agent lists them (agent.devchar)."""
    return devchar_nodes(ctx.root or "/")


def check_nodes(ctx: Context) -> Finding:
    nodes = list_nodes(ctx)
    load = "nvidia-modprobe -u -c 0 (or run `nvidia-smi` once as root)"
    if not nodes:
        return fail(f"no NVIDIA device nodes in {ctx.host(DEV)}: the driver is not loaded "
                    f"or nothing created them", load)
    findings = []
    have = {n.name for n in nodes}
    facts = nvml_facts(ctx)
    wanted = ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    if facts.up:
        wanted += [f"/dev/nvidia{g.minor}" for g in facts.gpus]
    missing = [w for w in wanted if w not in have]
    if missing:
        minors = [w[len("/dev/nvidia"):] for w in missing if w[len("/dev/nvidia"):].isdigit()]
        fix = " && ".join(f"nvidia-modprobe -u -c {m}" for m in minors) or "nvidia-modprobe -u"
        findings.append(fail(f"missing: {', '.join(missing)}", fix))
    odd = [n.name for n in nodes if n.major is None]
    if odd:
        findings.append(warn(f"not character devices: {', '.join(odd)}",
                             f"remove them; `{load.split(' (')[0]}` creates the real nodes"))
    recorded = " (major:minor as the simulated driver tree records them)" \
        if any(n.recorded for n in nodes) else ""
    real = [n for n in nodes if n.major is not None]  # as many as the agent's start log says
    gpus = [n for n in real if _GPU_NODE.match(n.name)]
    caps = [n for n in real if n.name.startswith(f"{DEV}/{CAPS_DIR}/")]
    control = [os.path.basename(n.name) for n in real if n not in gpus and n not in caps]
    findings.insert(0, ok(f"{len(real)} NVIDIA device nodes{recorded}: "
                          + ", ".join(control + [f"{len(gpus)} GPUs",
                                                 f"{len(caps)} in {CAPS_DIR}/"])))
    return worst(findings)


def _link_target(ctx: Context, link: str) -> str | None:
    """Where the /dev/char link at `link` points, as a path under the root (None: no link)."""
    try:
        target = os.readlink(link)
    except OSError:
        return None
    if os.path.isabs(target):
        inside = os.path.normpath(target)
        if ctx.root not in ("", "/") and not inside.startswith(ctx.root.rstrip("/") + "/"):
            inside = ctx.host(target)  # an absolute link is relative to the root it lives in
        return os.path.normpath(inside)
    return os.path.normpath(os.path.join(os.path.dirname(link), target))


def check_dev_char(ctx: Context) -> Finding:
    nodes = [n for n in list_nodes(ctx) if n.major is not None]
    if not nodes:
        return fail("no NVIDIA device nodes to check (see devices.nodes)", None)
    missing, wrong, wrong_links = [], [], []
    for node in nodes:
        link = ctx.host(f"{DEV_CHAR}/{node.char_name}")
        if not os.path.lexists(link):
            missing.append(f"{node.name} ({DEV_CHAR}/{node.char_name})")
            continue
        target = _link_target(ctx, link)
        if target != os.path.normpath(node.path):
            what = "is not a link" if target is None else f"points to {target}"
            wrong.append(f"{DEV_CHAR}/{node.char_name} {what}, not {node.name}")
            wrong_links.append(link)
    findings = [_links_finding(ctx, nodes, missing, wrong, wrong_links)]
    if not (ctx.uses_cdi or ctx.cfg.pass_device_specs):
        findings.append(warn(
            "the agent's containers get their device nodes only from nvidia-container-"
            "runtime's hook (device-list strategy "
            f"{','.join(ctx.cfg.device_list_strategy)}, passDeviceSpecs false): they are not "
            "in the container's spec, so systemd never learns them and `systemctl "
            "daemon-reload` takes them away, links or not",
            "set flags.plugin.passDeviceSpecs: true (--pass-device-specs) or use the cdi-cri "
            "device-list strategy; then `systemctl reload gpu-agent`"))
    return worst(findings)


def _links_finding(ctx: Context, nodes: list, missing: list, wrong: list,
                   wrong_links: list) -> Finding:
    if not missing and not wrong:
        return ok(f"all {len(nodes)} NVIDIA device nodes have their {DEV_CHAR} link")
    command = DEV_CHAR_COMMAND
    if ctx.root not in ("", "/"):
        command += f" --driver-root={ctx.root} --dev-char-path={ctx.host(DEV_CHAR)}"
    parts = []
    if missing:
        parts.append(f"{len(missing)} of {len(nodes)} NVIDIA device nodes have no "
                     f"{DEV_CHAR} link: {', '.join(missing[:6])}"
                     + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))
    if wrong:
        parts.append("; ".join(wrong[:6]))
    fix = (f"remove the wrong links first: rm {' '.join(wrong_links)}\n" if wrong else "") \
        + command
    return fail(f"{'; '.join(parts)}: runc gives systemd a container's devices as "
                f"{DEV_CHAR}/<major>:<minor> paths and leaves out those without a link, so "
                f"after `systemctl daemon-reload` containers lose these devices and fail with "
                f"'Failed to initialize NVML: Unknown Error' (nvidia-container-toolkit #48)",
                fix)


CHECKS = (
    Spec("devices.nodes", "the NVIDIA device nodes exist", check_nodes),
    Spec("devices.dev-char", "every NVIDIA device node has its /dev/char link", check_dev_char),
)
