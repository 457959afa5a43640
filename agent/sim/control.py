"""Run-time faults for the simulated NVML: the control channel's writer side.

Owns: the record format of `<control dir>/control.log` and appending records to it (one
O_APPEND write per record, so concurrent writers never interleave), the Python API
(`inject_xid`, `inject_xids` for storms, `lose`, `restore`, `hang`, `ecc`, `set_telemetry`),
the `telemetry` record's keys and limits (TELEMETRY_KEYS), and the
`gpu-agent sim inject-xid|lose|restore|hang|ecc|telemetry` commands built on it. The simulated
library (agent/sim/nvml/control.c) is the reader: it follows the log with inotify, wakes
blocked event waits and derives lost/ECC/telemetry state from it; every NVML call reads the
log to its end first, so a record is seen by the next call of any process once written.

Must not read the log back, talk to NVML, or decide what a record means for a GPU: that is
the library's job, so every process that loaded it sees the same node.

Record lines (docs/simulator.md):
    xid gpu=<index|GPU-uuid|MIG-uuid|none> xid=<n> gi=<n> ci=<n>
    ecc gpu=<...> type=sbe|dbe
    lose gpu=<...>
    restore gpu=<...>
    hang gpu=<index|GPU-uuid> until_ns=<CLOCK_MONOTONIC ns; 0 ends it>
    telemetry gpu=<index|GPU-uuid> KEY=VALUE ...   (keys: TELEMETRY_KEYS)
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import time
from pathlib import Path
from typing import Union

from agent.errors import SimError
from agent.sim import ENV_CONTROL, ENV_PROFILE

log = logging.getLogger(__name__)

LOG_NAME = "control.log"
NO_INSTANCE = 0xFFFFFFFF  # GI/CI of an XID that names no MIG instance
_MAX_U64 = 2**64 - 1
_MAX_U32 = 2**32 - 1
MAX_HANG_S = 3600
_MIB = 1024 * 1024
_UUID_RE = re.compile(r"^(GPU|MIG)-[0-9A-Za-z-]+$")

GpuSpec = Union[int, str, None]


def control_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The control directory: `explicit`, else $GPU_AGENT_SIM_CONTROL; it must exist."""
    raw = explicit if explicit is not None else os.environ.get(ENV_CONTROL, "")
    if not str(raw):
        raise SimError(
            f"no control directory: set {ENV_CONTROL} (or pass --control-dir) to the directory "
            f"the simulated NVML library was started with"
        )
    path = Path(raw)
    if not path.is_dir():
        raise SimError(f"control directory {path} does not exist or is not a directory "
                       f"({ENV_CONTROL})")
    return path


def _gpu_spec(gpu: GpuSpec, allow_none: bool = False) -> str:
    """Validate a GPU reference (index, GPU-/MIG- UUID, or None/'none') for a record."""
    if gpu is None or (isinstance(gpu, str) and gpu.strip().lower() == "none"):
        if allow_none:
            return "none"
        raise SimError("--gpu none is only valid for inject-xid (an event that names no GPU)")
    if isinstance(gpu, bool):
        raise SimError(f"--gpu {gpu!r}: expected a GPU index or UUID")
    if isinstance(gpu, int):
        if gpu < 0:
            raise SimError(f"--gpu {gpu}: a GPU index cannot be negative")
        spec = str(gpu)
    else:
        spec = str(gpu).strip()
        if spec.isdigit():
            spec = str(int(spec))
        elif not _UUID_RE.match(spec):
            raise SimError(
                f"--gpu {gpu!r}: expected a GPU index (0, 1, ...), a GPU-/MIG- UUID"
                + (" or 'none'" if allow_none else "")
            )
    _check_against_profile(spec)
    return spec


def _profile_for_checks(name: str) -> dict:
    """The profile `name`, parsed once per file version: a burst of injections (a benchmark,
    an XID storm) must not re-parse the YAML on every record."""
    from agent.sim.profile import load_profile, resolve_profile_path

    path = resolve_profile_path(name)
    try:
        stamp = (str(path), path.stat().st_mtime_ns)
    except OSError:
        return load_profile(name)  # reports the unreadable file
    cached = _PROFILE_CACHE.get(stamp)
    if cached is None:
        cached = _PROFILE_CACHE[stamp] = load_profile(path)
    return cached


_PROFILE_CACHE: dict[tuple[str, int], dict] = {}


def _check_against_profile(spec: str) -> None:
    """When $GPU_AGENT_SIM_PROFILE names the node, reject GPUs it does not have."""
    name = os.environ.get(ENV_PROFILE)
    if not name:
        return
    profile = _profile_for_checks(name)
    gpus = profile["gpus"]
    if spec.isdigit():
        if int(spec) >= len(gpus):
            raise SimError(f"--gpu {spec}: profile {profile['name']} has GPUs 0-{len(gpus) - 1}")
        return
    uuids = {g["uuid"] for g in gpus}
    uuids.update(m["uuid"] for g in gpus for m in g.get("mig", {}).get("instances", []))
    if spec not in uuids:
        raise SimError(f"--gpu {spec}: no GPU or MIG device with that UUID in profile "
                       f"{profile['name']}")


def _u(value: int, what: str, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise SimError(f"{what} {value!r}: expected an integer from 0 to {limit}")
    return value


def check_gpu(gpu: GpuSpec) -> str:
    """Validate a GPU index/UUID (against $GPU_AGENT_SIM_PROFILE when set) without writing a
    record; returns its normalized form. Later records for it skip re-reading the profile."""
    return _gpu_spec(gpu)


def append_record(ctl: str | os.PathLike | None, record: str) -> str:
    """Append one record line to the control log with a single O_APPEND write; return it."""
    directory = control_dir(ctl)
    line = (record.strip() + "\n").encode()
    fd = os.open(directory / LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                 0o644)
    try:
        written = os.write(fd, line)
    finally:
        os.close(fd)
    if written != len(line):
        raise SimError(f"short write to {directory / LOG_NAME} ({written} of {len(line)} bytes)")
    log.debug("control record: %s", record)
    return record


def inject_xid(control_dir: str | os.PathLike | None, gpu: GpuSpec, xid: int,
               gi: int | None = None, ci: int | None = None) -> str:
    """Deliver an XidCriticalError event (type 0x8, data = xid) for `gpu`.

    `gpu` is an index, a GPU-/MIG- UUID, or None for an event that names no GPU (delivered to
    every event set). `gi`/`ci` default to 0xFFFFFFFF (no MIG instance), or to the instance's
    ids when `gpu` is a MIG UUID.
    """
    spec = _gpu_spec(gpu, allow_none=True)
    parts = [f"xid gpu={spec}", f"xid={_u(xid, 'XID', _MAX_U64)}"]
    if gi is not None:
        parts.append(f"gi={_u(gi, 'GPU instance id', NO_INSTANCE)}")
    elif not spec.startswith("MIG-"):
        parts.append(f"gi={NO_INSTANCE}")
    if ci is not None:
        parts.append(f"ci={_u(ci, 'compute instance id', NO_INSTANCE)}")
    elif not spec.startswith("MIG-"):
        parts.append(f"ci={NO_INSTANCE}")
    return append_record(control_dir, " ".join(parts))


def inject_xids(ctl: str | os.PathLike | None, events) -> int:
    """Deliver many XID events at once: `events` holds (gpu, xid) or (gpu, xid, gi, ci)
    tuples, checked as `inject_xid` checks them; their records go to the log in as few
    O_APPEND writes as it takes (a storm of 100,000 costs milliseconds, not a process each).
    Returns how many records were appended."""
    lines = []
    specs: dict = {}
    for item in events:
        gpu, xid, *rest = item
        spec = specs.get((type(gpu), gpu))
        if spec is None:  # checked once per GPU, as the profile check reads a file
            spec = specs[(type(gpu), gpu)] = _gpu_spec(gpu, allow_none=True)
        gi, ci = (rest + [None, None])[:2]
        default = None if spec.startswith("MIG-") else NO_INSTANCE
        parts = [f"xid gpu={spec}", f"xid={_u(xid, 'XID', _MAX_U64)}"]
        for name, value, what in (("gi", gi, "GPU instance id"), ("ci", ci, "compute instance id")):
            value = default if value is None else _u(value, what, NO_INSTANCE)
            if value is not None:
                parts.append(f"{name}={value}")
        lines.append(" ".join(parts) + "\n")
    if not lines:
        return 0
    data = "".join(lines).encode()
    directory = control_dir(ctl)
    fd = os.open(directory / LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                 0o644)
    try:
        view = memoryview(data)
        while view:  # a regular file takes it whole; a short write only continues the tail
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    log.debug("control: %d xid records appended to %s", len(lines), directory)
    return len(lines)


def lose(control_dir: str | os.PathLike | None, gpu: GpuSpec) -> str:
    """Mark `gpu` lost: its calls return GPU_IS_LOST and waits that registered it return it once."""
    return append_record(control_dir, f"lose gpu={_gpu_spec(gpu)}")


def restore(control_dir: str | os.PathLike | None, gpu: GpuSpec) -> str:
    """Bring a lost `gpu` back."""
    return append_record(control_dir, f"restore gpu={_gpu_spec(gpu)}")


def hang(control_dir: str | os.PathLike | None, gpu: GpuSpec, seconds: float) -> str:
    """Make every NVML call on `gpu` (and its MIG devices) block, from now for `seconds`, as
    a GPU whose driver calls hang; the event wait is not affected. 0 ends a hang now. The end is
    a CLOCK_MONOTONIC time, the same in every process on this host."""
    spec = _gpu_spec(gpu)
    if spec.startswith("MIG-"):
        raise SimError(f"--gpu {spec}: a hang is per GPU; give its parent GPU's index or "
                       f"GPU- UUID")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not 0 <= seconds <= MAX_HANG_S:
        raise SimError(f"hang --seconds {seconds!r}: expected 0 to {MAX_HANG_S}")
    until = time.monotonic_ns() + int(seconds * 1e9) if seconds else 0
    return append_record(control_dir, f"hang gpu={spec} until_ns={until}")


def ecc(control_dir: str | os.PathLike | None, gpu: GpuSpec, double_bit: bool = True) -> str:
    """Count one ECC error on `gpu` and deliver its event (0x2 double-bit, 0x1 single-bit)."""
    kind = "dbe" if double_bit else "sbe"
    return append_record(control_dir, f"ecc gpu={_gpu_spec(gpu)} type={kind}")


# The keys of a `telemetry` record: the largest value each takes (the library's TELEMETRY_KEYS
# in agent/sim/nvml/telemetry.c has the same limits) and what it sets. memory_used_mib is
# further limited by the GPU's memory (total - reserved) when the profile is known.
TELEMETRY_KEYS: dict[str, tuple[int, str]] = {
    "gpu_util": (100, "GPU utilization, % (nvmlDeviceGetUtilizationRates .gpu)"),
    "mem_util": (100, "memory utilization, % (nvmlDeviceGetUtilizationRates .memory)"),
    "memory_used_mib": (_MAX_U64 // _MIB, "memory used, MiB (nvmlDeviceGetMemoryInfo*: the "
                                          "v2 .used; v1 .used adds the reserved memory)"),
    "temperature_c": (200, "GPU temperature, degrees C (nvmlDeviceGetTemperature, sensor 0)"),
    "power_mw": (_MAX_U32, "power draw, milliwatts (nvmlDeviceGetPowerUsage)"),
    "sm_clock_mhz": (100000, "SM and graphics clock, MHz (nvmlDeviceGetClockInfo)"),
    "throttle_reasons": (_MAX_U64, "nvmlClocksEventReason* bit mask "
                                   "(nvmlDeviceGetCurrentClocksEventReasons/ThrottleReasons)"),
    "retired_pending": (1, "pages pending retirement, 0|1 "
                           "(nvmlDeviceGetRetiredPagesPendingStatus; before Ampere)"),
    "remapped_correctable": (_MAX_U32, "rows remapped for correctable errors "
                                       "(nvmlDeviceGetRemappedRows; Ampere and newer)"),
    "remapped_uncorrectable": (_MAX_U32, "rows remapped for uncorrectable errors"),
    "remapped_pending": (1, "a row remapping is pending, 0|1"),
    "remapped_failed": (1, "a row remapping failed, 0|1 (nvmlDeviceGetRemappedRows "
                           "failureOccurred)"),
    "recovery_action": (7, "the driver's recovery action (nvmlDeviceGetFieldValues "
                           "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION): 0 none, 1 GPU reset, 2 node "
                           "reboot, 3 drain P2P, 4 drain and reset, 5 recover IMEX domain, 6 "
                           "bus reset, 7 system reboot"),
    "delay_ms": (600_000, "each telemetry query of this GPU but memory sleeps this long "
                          "first (0: none)"),
}
_FLAG_KEYS = frozenset(k for k, (most, _) in TELEMETRY_KEYS.items() if most == 1)


def _profile_gpu(spec: str) -> dict | None:
    """The GPU `spec` (an index or GPU- UUID) in $GPU_AGENT_SIM_PROFILE's profile, if set."""
    name = os.environ.get(ENV_PROFILE)
    if not name:
        return None
    gpus = _profile_for_checks(name)["gpus"]
    if spec.isdigit():
        return gpus[int(spec)]
    return next((g for g in gpus if g["uuid"] == spec), None)


def _telemetry_value(spec: str, key: str, value) -> int:
    option = "--" + key.replace("_", "-")
    if key not in TELEMETRY_KEYS:
        raise SimError(f"telemetry: unknown key {key!r} (known: {', '.join(TELEMETRY_KEYS)})")
    if isinstance(value, bool) and key in _FLAG_KEYS:
        value = int(value)
    most = TELEMETRY_KEYS[key][0]
    gpu = _profile_gpu(spec) if key == "memory_used_mib" else None
    if gpu is not None:
        most = (gpu["memory"]["total"] - gpu["memory"]["reserved"]) // _MIB
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        where = f" (GPU {spec}'s memory less its reserved memory)" if gpu is not None else ""
        raise SimError(f"telemetry {key} ({option}) {value!r}: expected an integer from 0 to "
                       f"{most}{where}")
    return value


def set_telemetry(gpu: int | str, control_dir: str | os.PathLike | None = None,
                  **values: int) -> str:
    """Set telemetry values of `gpu` (an index or GPU- UUID; MIG devices have none): keyword
    arguments named as TELEMETRY_KEYS (`temperature_c=85`, `delay_ms=500`, ...). They hold
    until set again, in every process that loaded the library, from its next NVML call on.
    Returns the record written."""
    spec = _gpu_spec(gpu)
    if spec.startswith("MIG-"):
        raise SimError(f"--gpu {spec}: telemetry is per GPU; give its parent GPU's index or "
                       f"GPU- UUID")
    if not values:
        raise SimError(f"telemetry: no values to set (keys: {', '.join(TELEMETRY_KEYS)})")
    checked = {key: _telemetry_value(spec, key, value) for key, value in values.items()}
    fields = [f"{key}={checked[key]}" for key in TELEMETRY_KEYS if key in checked]
    return append_record(control_dir, " ".join([f"telemetry gpu={spec}", *fields]))


# ---- command line ----

def _int_arg(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return value


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= MAX_HANG_S:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 0 to {MAX_HANG_S}")
    return value


def _add_common(p: argparse.ArgumentParser, gpu_help: str) -> None:
    p.add_argument("--gpu", required=True, help=gpu_help)
    p.add_argument("--control-dir", default=None,
                   help=f"control directory (default: ${ENV_CONTROL})")


def _cmd_inject_xid(args: argparse.Namespace) -> int:
    record = inject_xid(args.control_dir, args.gpu, args.xid, gi=args.gi, ci=args.ci)
    print(record)
    return 0


def _cmd_lose(args: argparse.Namespace) -> int:
    print(lose(args.control_dir, args.gpu))
    return 0


def _cmd_restore(args: argparse.Namespace) -> int:
    print(restore(args.control_dir, args.gpu))
    return 0


def _cmd_hang(args: argparse.Namespace) -> int:
    print(hang(args.control_dir, args.gpu, args.seconds))
    return 0


def _cmd_ecc(args: argparse.Namespace) -> int:
    print(ecc(args.control_dir, args.gpu, double_bit=args.double_bit))
    return 0


def _cmd_telemetry(args: argparse.Namespace) -> int:
    values = {key: getattr(args, key) for key in TELEMETRY_KEYS
              if getattr(args, key) is not None}
    print(set_telemetry(args.gpu, args.control_dir, **values))
    return 0


def add_cli(simsub: argparse._SubParsersAction) -> None:
    """Declare `gpu-agent sim inject-xid|lose|restore|hang|ecc|telemetry`."""
    p = simsub.add_parser("inject-xid", help="deliver an XID critical-error event")
    _add_common(p, "GPU index, GPU-/MIG- UUID, or 'none' for an event that names no GPU")
    p.add_argument("--xid", required=True, type=_int_arg, help="the XID number (event data)")
    p.add_argument("--gi", type=_int_arg, default=None,
                   help="GPU instance id (default 0xFFFFFFFF: none)")
    p.add_argument("--ci", type=_int_arg, default=None,
                   help="compute instance id (default 0xFFFFFFFF: none)")
    p.set_defaults(func=_cmd_inject_xid)

    p = simsub.add_parser("lose", help="make a GPU fall off the bus (GPU_IS_LOST)")
    _add_common(p, "GPU index or UUID")
    p.set_defaults(func=_cmd_lose)

    p = simsub.add_parser("restore", help="bring a lost GPU back")
    _add_common(p, "GPU index or UUID")
    p.set_defaults(func=_cmd_restore)

    p = simsub.add_parser("hang", help="make every NVML call on a GPU block for a time",
                          description="Every NVML call that names the GPU (its handle lookups, "
                                      "queries, event registration; not the event wait) blocks "
                                      "until the time is up, in every process that loaded the "
                                      "library. --seconds 0 ends a hang now.")
    _add_common(p, "GPU index or GPU- UUID")
    p.add_argument("--seconds", required=True, type=_seconds_arg,
                   help=f"how long from now (0 to {MAX_HANG_S}; 0 ends it)")
    p.set_defaults(func=_cmd_hang)

    p = simsub.add_parser("ecc", help="count an ECC error and deliver its event")
    _add_common(p, "GPU index or UUID")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--double-bit", dest="double_bit", action="store_true",
                      help="uncorrectable (event 0x2)")
    kind.add_argument("--single-bit", dest="double_bit", action="store_false",
                      help="correctable (event 0x1)")
    p.set_defaults(func=_cmd_ecc)

    p = simsub.add_parser("telemetry", help="set what a GPU's telemetry queries answer",
                          description="Set telemetry values of a GPU; each holds until set "
                                      "again. Give at least one.")
    _add_common(p, "GPU index or GPU- UUID")
    for key, (most, what) in TELEMETRY_KEYS.items():
        p.add_argument("--" + key.replace("_", "-"), dest=key, type=_int_arg, default=None,
                       metavar="N", help=f"{what}; 0 to {most}".replace("%", "%%"))
    p.set_defaults(func=_cmd_telemetry)
