"""The agent's status: the one-line summary (systemd STATUS=), STATE_DIR/status.json, and how
`gpu-agent status` reads and prints it.

Owns: the status document's fields and their wording, publishing it (systemd STATUS= when the
line changes, status.json rewritten atomically when anything changed), reading it back with
whether its writer still runs, and the text `gpu-agent status` prints. It reads the
running daemon's parts (`agent.daemon.Daemon`: cfg, phase, nvml, resources, registrar,
state, cdi, health) and changes none of them. Must not talk to NVML or kubelet.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from typing import Any

from agent import __version__
from agent.errors import AgentError
from agent.fileio import write_atomic

log = logging.getLogger(__name__)

STATUS_FILE = "status.json"


def summary(d: Any) -> str:
    """The one-line status of daemon `d`."""
    if d.phase in ("stopping", "stopped"):
        return d.phase
    if not d.nvml.up:
        if d.nvml.error:
            return (f"NVML unavailable, advertising nothing, retrying (attempt "
                    f"{d.nvml.attempts}): {d.nvml.error}")
        return "starting"
    registrations = d.registrar.status() if d.registrar is not None else {}
    parts = []
    for name, m in d.resources.managers.items():
        r = registrations.get(name)
        if not d.cfg.plugin_socket_dir:
            state = "not serving (no kubelet socket)"
        elif r is None or not r.socket:
            state = "not serving"
        elif r.registered:
            state = f"registered ({r.registrations})"
        elif r.last_error:
            state = "waiting for kubelet"
        else:
            state = "registering"
        parts.append(f"{name}: {m.healthy_count}/{len(m.devices)} healthy, {state}")
    text = "; ".join(parts) or "no GPUs: advertising nothing"
    for problem in (d.state.problem if d.state is not None else "",
                    d.cdi.summary() if d.cdi is not None and not d.cdi.ok else "",
                    "; ".join(d.resources.gone_in_use),
                    "; ".join(f"GPU {g.index}: MIG mode change pending"
                              for g in d.resources.gpus if g.mig_pending_note), d.last_error):
        if problem:
            text += f"; {problem}"
    return text


def document(d: Any) -> dict:
    """The status document of daemon `d` (STATE_DIR/status.json)."""
    registrations = d.registrar.status() if d.registrar is not None else {}
    held = d.state.holders() if d.state is not None else {}  # from the journal, no kubelet
    resources = []
    for name, m in d.resources.managers.items():
        r = registrations.get(name)
        resources.append({
            "name": name,
            "socket": r.socket if r and r.socket else None,
            "registered": bool(r and r.registered),
            "registrations": r.registrations if r else 0,
            "lastError": r.last_error if r else "",
            "devices": [{"id": h.device.id, "index": h.device.gpu_index,
                         "uuid": h.device.gpu_uuid, "numaNode": h.device.numa_node,
                         "healthy": h.healthy, "reason": h.reason,
                         "heldBy": sorted("/".join(pod)
                                          for pod in held.get((name, h.device.id), ()))}
                        for h in m.snapshot().devices],
        })
    cfg = d.cfg
    return {
        "pid": os.getpid(),
        "version": __version__,
        "phase": d.phase,
        "summary": summary(d),
        "started": d.started,
        "updated": time.time(),
        "configFile": cfg.config_file if cfg else None,
        "namedConfig": {"name": cfg.choice.name, "why": cfg.choice.why,
                        "problem": cfg.choice.problem,
                        "label": d.label_watch.status() if d.label_watch is not None else None}
        if cfg and (cfg.choice.path or cfg.choice.problem or d.label_watch is not None) else None,
        "kubeletSocket": cfg.kubelet_socket if cfg else None,
        "nvml": {"up": d.nvml.up, "library": d.nvml.path, "error": d.nvml.error,
                 "attempts": d.nvml.attempts},
        "restarts": d.registrar.restarts if d.registrar is not None else 0,
        "reloads": d.reloads,
        "lastError": d.last_error,
        "resources": resources,
        "migGoneInUse": list(d.resources.gone_in_use),
        "migPending": [g.mig_pending_note for g in d.resources.gpus if g.mig_pending_note],
        "state": d.state.status() if d.state is not None else None,
        "cdi": d.cdi.to_json() if d.cdi is not None else None,
        "mode": cfg.mode if cfg else None,
        "dra": d.dra.status() if d.dra is not None else None,
        "mps": d.mps.status(),
        "health": d.health.status() if d.health is not None else None,
        "kubernetes": d.faults.status() if d.faults is not None else None,
        **d.services.status(),  # devChar, metrics, labels
    }


class Publisher:
    """Tells systemd (`notifier`) and status.json what daemon `d` looks like now."""

    def __init__(self, notifier: Any):
        self.notifier = notifier
        self.dirty = True  # status.json needs writing (set from any thread)
        self._line = ""
        self._state_written = -1
        self._warned = False

    def ready(self, d: Any) -> None:
        """READY=1; status.json is written first, so it is current when systemd hears."""
        self._line = summary(d)
        self.write(d)
        self.notifier.ready(self._line)

    def publish(self, d: Any) -> None:
        line = summary(d)
        changed = line != self._line
        if changed or self.dirty or (d.state is not None
                                     and d.state.version != self._state_written):
            self.write(d)
        if changed:
            self._line = line
            self.notifier.status(line)

    def write(self, d: Any) -> None:
        if d.cfg is None:
            return
        self.dirty = False
        if d.state is not None:
            self._state_written = d.state.version
        path = os.path.join(d.cfg.state_dir, STATUS_FILE)
        try:
            # Not fsynced: rewritten from memory at every start, and at most once a loop tick.
            write_atomic(path, (json.dumps(document(d), indent=1) + "\n").encode(), mode=0o644,
                         durable=False)
        except OSError as exc:
            if not self._warned:
                log.warning("cannot write %s: %s", path, exc)
                self._warned = True


def read_status(state_dir: str) -> dict | None:
    """The status a running (or the last) agent wrote under `state_dir`, or None."""
    try:
        with open(os.path.join(state_dir, STATUS_FILE)) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise AgentError(f"cannot read {os.path.join(state_dir, STATUS_FILE)}: {exc}") from exc
    doc["running"] = doc.get("phase") not in ("stopped",) and _alive(doc.get("pid"))
    return doc


# `gpu-agent status` exits as `systemctl status` does, so that a script can branch on it.
EXIT_RUNNING = 0  # running, every advertised device in service
EXIT_DEGRADED = 1  # running, but a device is withdrawn or NVML is down
EXIT_NOT_RUNNING = 3  # stopped, or never started with this state directory


def exit_code(doc: dict | None) -> int:
    """The exit code of `gpu-agent status` for status document `doc` (read_status)."""
    if doc is None or not doc.get("running"):
        return EXIT_NOT_RUNNING
    out = any(not dev["healthy"] for r in doc.get("resources", []) for dev in r["devices"])
    return EXIT_DEGRADED if out or not doc.get("nvml", {}).get("up") else EXIT_RUNNING


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


def _metrics_line(m: dict | None, now: float | None) -> str:
    if not m:
        return "metrics: off (agent.metricsAddress is empty)"
    if not m["listening"]:
        return f"metrics: not listening: {m['error'] or m['address']}"
    line = f"metrics: listening on {m['address']} (port {m['port']}), {m['scrapes']} scrapes"
    if m["lastScrape"] is not None:
        ago = max(0.0, (now or time.time()) - m["lastScrape"])
        line += (f", last {ago:.0f} s before this status, took "
                 f"{m['lastScrapeSeconds'] * 1000:.1f} ms")
    return line


def _kubernetes_line(k: dict) -> str:
    counts = k["eventCounts"]
    text = f"Kubernetes API (node {k['node']}, {k['kubeconfig']}): {k['api']}"
    if k["events"]:
        text += (f"; events: {counts['posted']} posted, {counts['counted']} counted on one "
                 f"posted, {k['queued']} queued, {counts['dropped']} dropped, "
                 f"{counts['limited']} over the rate limit, {counts['failed']} refused")
    c = k.get("condition")
    if c:
        text += (f"; {c['type']}={c['status']} ({c['reason']})" if c["asserted"] else
                 f"; {c['type']} not asserted yet")
    return text


def _health_lines(doc: dict) -> list[str]:
    """`gpu-agent status` lines for the health part of status.json."""
    if not doc:
        return []
    c = doc.get("counters", {})
    lines = [f"health: {'on' if doc.get('enabled') else 'off'} ({doc.get('implementation')}; "
             f"{doc.get('policy')}); recovery quiet period {doc.get('quietPeriodS'):g} s",
             f"  events: {c.get('delivered', 0)} delivered, {c.get('ignored', 0)} ignored XIDs, "
             f"{c.get('sbe', 0)} single-bit ECC; wait errors {c.get('waitErrors', 0)}, event "
             f"set {doc.get('eventSet')}"
             + (f"; {c['loopErrors']} unexpected loop errors (see the log)"
                if c.get("loopErrors") else "")]
    iso = doc.get("isolation", {})
    if iso.get("file"):
        named = iso.get("indexes", []) + iso.get("uuids", [])
        lines.append(f"  isolation file {iso['file']}: "
                     + (", ".join(named) if named else "nothing isolated")
                     + (f"; ERROR: {iso['error']}" if iso.get("error") else ""))
    if doc.get("stateError"):
        lines.append(f"  state: {doc['stateError']}")
    for index, why in sorted(doc.get("unsupported", {}).items()):
        lines.append(f"  GPU {index}: no NVML events ({why})")
    for u in doc.get("unhealthy", []):
        lines.append(f"  unhealthy: {u['id']} (GPU {u['gpuIndex']} {u['gpuUuid']}) "
                     f"[xid={u['xid']} action={u['action']}]: {u['reason']}")
    recent = doc.get("transitions", [])
    if recent:
        lines.append("  recent transitions:")
        for t in recent[-10:]:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t["time"]))
            state = "healthy" if t["healthy"] else "unhealthy"
            extra = "" if t["healthy"] else f" [xid={t['xid']} action={t['action']}]"
            lines.append(f"    {stamp} GPU {t['gpuIndex']} {t['gpuUuid']} {state}{extra}: "
                         f"{t['reason']}")
    return lines


def format_status(doc: dict) -> str:
    from agent.state.allocations import format_state

    lines = [f"agent: {'running' if doc['running'] else 'not running'} "
             f"(pid {doc.get('pid')}, phase {doc.get('phase')}, version {doc.get('version')})",
             f"summary: {doc.get('summary')}",
             f"config file: {doc.get('configFile') or 'none'}; kubelet socket: "
             f"{doc.get('kubeletSocket') or 'none'}"]
    named = doc.get("namedConfig")
    if named:
        lines.append(f"named config: {named['name'] or 'none'} ({named['why']})"
                     + (f"; {named['problem']}" if named["problem"] else "")
                     + (f"; node label API: {named['label']['api']}" if named["label"] else ""))
    nvml = doc.get("nvml", {})
    lines.append(f"NVML: {'up' if nvml.get('up') else 'down'} ({nvml.get('library') or '-'})"
                 + (f": {nvml['error']}" if nvml.get("error") else ""))
    lines.append(f"restarts: {doc.get('restarts', 0)}; reloads: {doc.get('reloads', 0)}"
                 + (f"; last error: {doc['lastError']}" if doc.get("lastError") else ""))
    for r in doc.get("resources", []):
        lines.append(f"{r['name']}: {'registered' if r['registered'] else 'not registered'} "
                     f"({r['registrations']} registrations) on {r['socket'] or '-'}")
        runs: list[list] = []  # replicas and MIG devices of one GPU read alike: one line each
        for dev in r["devices"]:
            numa = "-" if dev["numaNode"] is None else dev["numaNode"]
            line = (f"  GPU {dev['index']} {dev['uuid']} NUMA {numa}: "
                    f"{'healthy' if dev['healthy'] else 'unhealthy'}"
                    + (f" ({dev['reason']})" if dev.get("reason") else "")
                    + (f"; held by {', '.join(dev['heldBy'])}" if dev.get("heldBy") else ""))
            if runs and runs[-1][0] == line:
                runs[-1][1] += 1
            else:
                runs.append([line, 1])
        lines.extend(line if n == 1 else f"{line} [{n} devices]" for line, n in runs)
    mps = doc.get("mps") or {}
    if mps.get("daemons"):
        lines.append(f"MPS control daemons ({mps['launcher']}, {mps['program']}, under "
                     f"{mps['root']}):")
        for m in mps["daemons"]:
            lines.append(f"  GPU {m['gpuIndex']} {m['gpuUuid']}: "
                         + (f"running (pid {m['pid']})" if m["running"] else m["reason"])
                         + f"; {m['replicas']} replicas, {m['threadPercentage']}% of the SMs "
                           f"and {m['memoryLimitMiB']} MiB a client by default; restarted "
                           f"{m['restarts']} times")
    if doc.get("dra"):
        r = doc["dra"]
        lines.append(f"DRA driver {r['driver']} on node {r['node']}: {r['devices']} devices in "
                     f"its ResourceSlice (pool generation {r['sliceGeneration']}"
                     + (f"; not published: {r['error']}" if r["error"] else "")
                     + ("; published once kubelet registers the plugin" if r.get("held") else "")
                     + "); kubelet "
                     + {True: "registered it", False: "refused it", None: "has not registered "
                        "it yet"}[r["registered"]]
                     + ("; tainted: " + ", ".join(f"{n}: {why}" for n, why in
                                                  r["tainted"].items())
                        if r.get("tainted") else "")
                     + f"; {len(r['preparedClaims'])} claims prepared"
                     + "".join(f"\n  claim {c['namespace']}/{c['name']}: "
                               + ", ".join(d + (f" ({how})" if how != "exclusive" else "")
                                           for d, how in zip(c["devices"], c.get("sharing") or
                                                             ["exclusive"] * len(c["devices"])))
                               + " for pod "
                               + (", ".join(c["pods"]) or "(none named)")
                               for c in r.get("claims") or []))
    if doc.get("cdi"):
        c = doc["cdi"]
        lines.append(f"CDI ({', '.join(c['strategies'])}): "
                     + (f"all {c['wanted']} device names defined" if c["ok"] else
                        f"{len(c['missing'])} of {c['wanted']} device names missing from the "
                        f"specs in {', '.join(c['dirs'])}: {', '.join(c['missing'])}"))
    lines.append(_metrics_line(doc.get("metrics"), doc.get("updated")))
    if doc.get("labels", {}).get("file") or doc.get("labels", {}).get("error"):
        labels = doc["labels"]
        lines.append(f"node feature labels: {labels['file'] or '-'}"
                     + (f": {labels['error']}" if labels["error"] else ""))
    if doc.get("kubernetes"):
        lines.append(_kubernetes_line(doc["kubernetes"]))
    if doc.get("state"):
        lines += format_state(doc["state"])
    if doc.get("health"):
        lines += _health_lines(doc["health"])
    return "\n".join(lines)
