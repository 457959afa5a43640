"""The doctor's DRA checks (`agent.mode: dra`, docs/dra.md): kubelet's plugin watcher can reach
the driver's sockets, kubelet registered the plugin, the node's ResourceSlice is published and
no device in it is tainted.

Owns: the checks `dra.*`, which skip in device-plugin mode (the `kubelet.*` registration checks
skip in dra mode instead). Reads the sockets and the running agent's status.json only: must
not call the Kubernetes API or change anything.
"""

from __future__ import annotations

import os

from agent.doctor.context import Context
from agent.doctor.kubelet import KUBELET_FIX, connect
from agent.doctor.model import Finding, Spec, fail, ok, skip, warn, worst
from agent.doctor.service import agent_status

RESTART = "`systemctl restart gpu-agent` (it makes both sockets again)"


def check_sockets(ctx: Context) -> Finding:
    if ctx.cfg.mode != "dra":
        return skip(f"agent.mode {ctx.cfg.mode}: no DRA driver")
    from agent.dra.plugin import socket_paths

    findings = []
    for path in socket_paths(ctx.cfg.kubelet_dir):
        if not os.path.exists(path):
            findings.append(fail(f"{path} does not exist: the agent does not run in dra mode "
                                 f"with agent.kubeletDir {ctx.cfg.kubelet_dir}", RESTART))
            continue
        problem = connect(path, ctx.timeout)
        findings.append(fail(f"{path} does not answer: {problem} (left by a stopped agent)",
                             RESTART) if problem else ok(f"{path} answers"))
    return worst(findings)


def check_driver(ctx: Context) -> Finding:
    if ctx.cfg.mode != "dra":
        return skip(f"agent.mode {ctx.cfg.mode}: no DRA driver")
    doc, error = agent_status(ctx)
    if error or doc is None or not doc.get("running"):
        return fail(error or f"no agent runs with state directory {ctx.cfg.state_dir}",
                    "see kubelet.registration's fix: `systemctl enable --now gpu-agent`")
    dra = doc.get("dra")
    if not dra:
        return fail(f"the running agent (pid {doc.get('pid')}) is not in dra mode",
                    "set agent.mode: dra in its config, then `systemctl restart gpu-agent`")
    findings = []
    if dra["registered"] is None:
        findings.append(fail(f"kubelet has not registered the driver {dra['driver']} yet",
                             f"kubelet's --root-dir must be agent.kubeletDir "
                             f"({ctx.cfg.kubelet_dir}); {KUBELET_FIX}"))
    elif not dra["registered"]:
        findings.append(fail(f"kubelet refused the driver {dra['driver']}",
                             "`journalctl -u gpu-agent -e` has kubelet's reason"))
    if dra["error"]:
        findings.append(fail(f"the ResourceSlice is not published: {dra['error']}",
                             "the agent tries again every 10 s; see docs/dra.md#credentials-rbac"))
    if dra.get("tainted"):
        findings.append(warn("tainted in the ResourceSlice: " + ", ".join(
            f"{n}: {why}" for n, why in dra["tainted"].items()),
            "`gpu-agent status` says why; the taint goes when the device recovers "
            "(docs/health.md), or with the reboot a reboot-class fault needs"))
    if not findings:
        findings.append(ok(f"{dra['driver']} registered, {dra['devices']} devices published "
                           f"(pool generation {dra['sliceGeneration']}), "
                           f"{len(dra['preparedClaims'])} claims prepared"))
    return worst(findings)


CHECKS = (
    Spec("dra.sockets", "kubelet's plugin watcher can reach the DRA driver's sockets",
         check_sockets),
    Spec("dra.driver", "kubelet registered the DRA driver and its ResourceSlice is published",
         check_driver),
)
