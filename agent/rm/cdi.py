"""Does nvidia-container-toolkit's CDI spec define the device names the agent hands out?

Owns: reading the CDI spec files in the configured directories (`agent.cdiSpecDirs`, by default
/etc/cdi and /var/run/cdi: the `*.yaml` and `*.json` files directly in each, as the CDI
library reads them), resolving them as the CDI library does (a later directory overrides an
earlier one; the same name twice in one directory is a conflict that leaves the name
unresolvable), and
comparing the result with the names that the `cdi-annotations` / `cdi-cri` device-list
strategies put in Allocate responses (taken from agent.rm.allocate itself, so the two never
disagree). The result says exactly what to run when names are missing.

Must not decide what to do about a missing name (agent.daemon does: it warns and keeps
serving), write spec files (`nvidia-ctk cdi generate` does), import grpc or call NVML.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from agent.rm.allocate import ResponseOptions, container_response
from agent.rm.devices import Device

CDI_STRATEGIES = ("cdi-annotations", "cdi-cri")
SPEC_EXTENSIONS = (".yaml", ".json")
GENERATE_COMMAND = "nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml"
REFRESH_UNITS = "nvidia-cdi-refresh.path nvidia-cdi-refresh.service"


def uses_cdi(opts: ResponseOptions) -> bool:
    """Whether Allocate responses under `opts` name devices by CDI name."""
    return any(s in CDI_STRATEGIES for s in opts.list_strategies)


def device_names(devices: Iterable[Device], opts: ResponseOptions) -> dict[str, Device]:
    """The fully-qualified CDI names (`nvidia.com/gpu=<id>`) that Allocate hands out for
    `devices` under `opts`, each with its device, as agent.rm.allocate builds them."""
    cdi_only = opts._replace(list_strategies=("cdi-cri",), pass_device_specs=False, mps_root="")
    names: dict[str, Device] = {}
    for device in devices:
        for name in container_response([device], cdi_only).cdi_devices:
            names[name] = device
    return names


@dataclass(frozen=True)
class SpecIndex:
    """What the spec directories define: each resolvable name with the file defining it, the
    files read, and the problems found (unreadable or invalid files, conflicts)."""

    dirs: tuple[str, ...]
    names: dict[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()


def _spec_devices(path: str) -> tuple[str, list[str]]:
    """(kind, device names) of one spec file; ValueError with the reason if it is not a spec."""
    import yaml  # only where a cdi-* strategy has specs to read: not on every start

    with open(path, "rb") as f:
        raw = f.read()
    try:
        doc = json.loads(raw) if path.endswith(".json") else yaml.safe_load(raw)
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                         f"{' '.join(str(exc).split())}") from None
    if not isinstance(doc, dict):
        raise ValueError("not a CDI spec (expected a mapping with cdiVersion, kind, devices)")
    kind = doc.get("kind")
    if not isinstance(kind, str) or "/" not in kind:
        raise ValueError(f"kind: expected vendor/class such as nvidia.com/gpu, got {kind!r}")
    devices = doc.get("devices")
    if not isinstance(devices, list):
        raise ValueError("devices: expected a list")
    names = []
    for i, device in enumerate(devices):
        name = device.get("name") if isinstance(device, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"devices[{i}].name: expected a non-empty string")
        names.append(name)
    return kind, names


def read_specs(dirs: Sequence[str]) -> SpecIndex:
    """Index the CDI specs in `dirs` (lowest precedence first), as the CDI library resolves
    them. A missing directory is not a problem (the toolkit may not have written it yet)."""
    resolved: dict[str, tuple[int, str]] = {}  # name -> (directory rank, file)
    conflicts: dict[str, set[str]] = {}
    files: list[str] = []
    problems: list[str] = []
    for rank, directory in enumerate(dirs):
        try:
            entries = sorted(os.listdir(directory))
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"cannot list {directory}: {exc.strerror or exc}")
            continue
        for entry in entries:
            path = os.path.join(directory, entry)
            if not entry.endswith(SPEC_EXTENSIONS) or not os.path.isfile(path):
                continue
            files.append(path)
            try:
                kind, names = _spec_devices(path)
            except OSError as exc:
                problems.append(f"cannot read {path}: {exc.strerror or exc}")
                continue
            except ValueError as exc:
                problems.append(f"{path} is not a usable CDI spec: {exc}")
                continue
            for short in names:
                name = f"{kind}={short}"
                old = resolved.get(name)
                if old is not None and old[0] == rank:
                    conflicts.setdefault(name, {old[1]}).add(path)
                elif old is None or old[0] < rank:
                    resolved[name] = (rank, path)
    # As in the CDI library, a conflict makes the name unresolvable even where another
    # directory defines it too.
    for name, paths in sorted(conflicts.items()):
        problems.append(f"{name} is defined by more than one spec in the same directory "
                        f"({', '.join(sorted(paths))}): container runtimes refuse it")
        resolved.pop(name, None)
    return SpecIndex(tuple(dirs), {n: p for n, (_, p) in resolved.items()}, tuple(files),
                     tuple(problems))


@dataclass(frozen=True)
class CdiCheck:
    """The outcome of checking the CDI names the agent hands out against the spec."""

    strategies: tuple[str, ...]
    wanted: dict[str, Device]  # CDI name -> device, in Allocate's order
    index: SpecIndex
    missing: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.missing

    def summary(self) -> str:
        """One short line for the systemd STATUS and `gpu-agent status`."""
        if self.ok:
            return f"CDI spec defines all {len(self.wanted)} device names"
        return (f"CDI spec lacks {len(self.missing)} of {len(self.wanted)} device names "
                f"(see the log)")

    def message(self) -> str:
        """The whole finding, and what to run when names are missing (one log line)."""
        dirs = ", ".join(self.index.dirs)
        strategies = " and ".join(self.strategies)
        notes = "".join(f" {p}." for p in self.index.problems)
        if self.ok:
            specs = sorted(set(self.index.names[n] for n in self.wanted))
            return (f"CDI: the {strategies} device-list strategy hands out {len(self.wanted)} "
                    f"device names, all defined by {', '.join(specs) or 'no spec (no devices)'}."
                    + notes)
        shown = [f"{name} (GPU {d.gpu_index} {d.gpu_uuid})" for name, d in
                 ((n, self.wanted[n]) for n in self.missing[:8])]
        more = f" and {len(self.missing) - 8} more" if len(self.missing) > 8 else ""
        found = (f"the specs there ({', '.join(self.index.files)}) do not define them"
                 if self.index.files else "there is no spec file there")
        return (f"CDI: the {strategies} device-list strategy hands out device names that no "
                f"CDI spec in {dirs} defines: {', '.join(shown)}{more}; {found}.{notes} "
                f"Containers given these devices will fail to start. Generate the spec with "
                f"nvidia-container-toolkit: `{GENERATE_COMMAND}`, or let the toolkit keep it "
                f"current (at boot and on driver changes): `systemctl enable --now "
                f"{REFRESH_UNITS}`. Then `systemctl reload gpu-agent` to check again. The agent "
                f"keeps serving meanwhile.")

    def to_json(self) -> dict:
        return {"ok": self.ok, "strategies": list(self.strategies), "dirs": list(self.index.dirs),
                "specFiles": list(self.index.files), "wanted": len(self.wanted),
                "missing": list(self.missing), "problems": list(self.index.problems)}


def check(devices: Iterable[Device], opts: ResponseOptions,
          dirs: Sequence[str]) -> CdiCheck | None:
    """Check the CDI names Allocate hands out for `devices` against the specs in `dirs`;
    None when `opts` uses no CDI device-list strategy (nothing to check)."""
    if not uses_cdi(opts):
        return None
    wanted = device_names(devices, opts)
    index = read_specs(dirs)
    missing = tuple(name for name in wanted if name not in index.names)
    strategies = tuple(s for s in opts.list_strategies if s in CDI_STRATEGIES)
    return CdiCheck(strategies, wanted, index, missing)
