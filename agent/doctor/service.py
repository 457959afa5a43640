"""The doctor's checks of the agent itself: the systemd unit is active, the configuration is
valid, the state directory is writable, the allocation journal is healthy.

Owns: the checks `agent.*` and `agent_status` (the running agent's status.json, read once per
run through agent.status). The unit is asked with `systemctl is-active` (bounded) where
systemctl exists under the root; the journal is read with agent.state.journal's
`read_journal`, never loaded or repaired. Must not start, stop or reload anything, nor
write in the state directory.
"""

from __future__ import annotations

import os

from agent.doctor.context import UNIT_NAME, Context
from agent.doctor.model import Finding, Spec, fail, ok, skip, warn, worst
from agent.errors import AgentError, CheckpointError, ConfigError


def agent_status(ctx: Context) -> tuple[dict | None, str]:
    """(status.json of the agent using the configured state directory, or None; an error
    text when the file is there but unreadable)."""
    def read():
        from agent.status import read_status

        try:
            return read_status(ctx.cfg.state_dir), ""
        except AgentError as exc:
            return None, str(exc)
    return ctx.memo("status", read)


# Words systemctl prints when there is no systemd to ask (a container, a chroot).
_NO_SYSTEMD = ("not been booted with systemd", "failed to connect to bus",
               "system has not been booted", "connect to bus")


def check_unit(ctx: Context) -> Finding:
    systemctl = ctx.which("systemctl")
    if systemctl is None:
        return skip(f"systemctl not found under {ctx.root}: not a systemd host, unit not asked")
    ran = ctx.run([systemctl, "is-active", UNIT_NAME])
    state = ran.out.strip()
    if ran.error:
        return warn(f"systemctl did not answer: {ran.error}", "`systemctl status gpu-agent`")
    if any(words in ran.err.lower() for words in _NO_SYSTEMD):
        return skip(f"systemd does not run here ({ran.err.strip().splitlines()[0]})")
    if state == "active":
        return ok(f"{UNIT_NAME}.service is active")
    if state in ("activating", "reloading"):
        return warn(f"{UNIT_NAME}.service is {state} (READY comes once every resource is "
                    f"registered with kubelet)", "`systemctl status gpu-agent` and "
                                                 "`journalctl -u gpu-agent -e`")
    return fail(f"{UNIT_NAME}.service is {state or 'unknown'}",
                "systemctl enable --now gpu-agent (`journalctl -u gpu-agent -e` says why it "
                "stopped)")


def check_config(ctx: Context) -> Finding:
    cfg = ctx.cfg
    source = cfg.config_file or "no config file (flags, environment, defaults)"
    if ctx.config_note and cfg.config_file:
        source = ctx.config_note
    if ctx.config_error is not None:
        err = ctx.config_error
        where = err.source or "the command line / environment"
        return fail(f"the configuration is invalid: {err} (the other checks used "
                    f"{ctx.config_fallback})",
                    f"fix {err.key} ({where}), then check with `gpu-agent config check FILE` "
                    f"and `systemctl reload gpu-agent`")
    from agent.config import check_supported

    try:
        check_supported(cfg)
    except ConfigError as exc:
        return fail(f"valid, but `gpu-agent run` refuses it: {exc}",
                    f"change {exc.key} ({exc.source or 'where it is set'}), then "
                    f"`systemctl restart gpu-agent`")
    return ok(f"valid ({source}); device-list strategy {','.join(cfg.device_list_strategy)}, "
              f"device-ID strategy {cfg.device_id_strategy}")


def check_state_dir(ctx: Context) -> Finding:
    path = ctx.cfg.state_dir
    if not os.path.exists(path):
        return warn(f"{path} does not exist yet: the agent creates it at start (the unit's "
                    f"StateDirectory= too)", "systemctl start gpu-agent")
    if not os.path.isdir(path):
        return fail(f"{path} is not a directory", f"move {path} away; the agent creates the "
                                                  f"directory at start")
    if not os.access(path, os.W_OK | os.X_OK):
        return fail(f"{path} is not writable by this user (uid {os.getuid()}): the journal "
                    f"and status.json cannot be written", f"chown root: {path} && chmod 0755 "
                                                          f"{path} (the agent runs as root)")
    return ok(f"{path} is a writable directory")


def check_journal(ctx: Context) -> Finding:
    from agent.state.journal import JOURNAL_FILE, read_journal, set_aside_files

    path = os.path.join(ctx.cfg.state_dir, JOURNAL_FILE)
    findings = []
    try:
        cp = read_journal(path)
    except CheckpointError as exc:
        return fail(f"{path} is unusable ({exc.kind}): {exc.problem}",
                    "systemctl restart gpu-agent (it sets the file aside and starts empty; "
                    "docs/state.md)")
    if cp is None:
        findings.append(ok(f"no journal yet ({path}): no allocation recorded"))
    else:
        attributed = sum(1 for r in cp.records if r.pod is not None)
        findings.append(ok(f"{path}: allocations recorded: {len(cp.records)}, attributed "
                           f"to pods: {attributed}"))
    doc, _error = agent_status(ctx)
    state = (doc or {}).get("state") or {}
    if doc is not None and doc.get("running") and state.get("failing"):
        findings.append(fail(f"the agent cannot write its journal: {state['failing']}",
                             f"free space or fix permissions in {ctx.cfg.state_dir} "
                             f"(`df -h {ctx.cfg.state_dir}`); Allocate fails until it can"))
    aside = set_aside_files(path)
    if aside:
        findings.append(warn(f"{len(aside)} bad state files set aside earlier: "
                             f"{', '.join(aside[-3:])}",
                             f"inspect them (`gpu-agent state show` shows the live one), then "
                             f"remove them: rm {' '.join(aside)}"))
    return worst(findings)


CHECKS = (
    Spec("agent.unit", "the gpu-agent unit is active", check_unit),
    Spec("agent.config", "the configuration is valid", check_config),
    Spec("agent.state-dir", "the state directory is writable", check_state_dir),
    Spec("agent.journal", "the allocation journal is healthy", check_journal),
)
