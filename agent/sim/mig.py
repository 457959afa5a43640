"""Run-time MIG reconfiguration of the simulated node: `gpu-agent sim mig apply|create|destroy`.

Owns: writing the `mig` control records (docs/simulator.md) that change a simulated GPU's MIG
mode and instances while processes use the library, checking a layout against the node's
profile first (known GPU, MIG-capable, known profile names, no more instances or slices than
the GPU has), and reading nvidia-mig-parted's config file shape for `apply`:

    version: v1
    mig-configs:
      all-1g.10gb:
        - devices: all            # or a list of GPU indexes
          mig-enabled: true
          mig-devices:
            "1g.10gb": 7

Must not read the control log back or talk to NVML: the library applies the records (instances
of a profile already there keep their UUIDs; new ones get the lowest free GPU instance ID and a
UUID derived from the GPU's; every instance gets a placement), so every process that loaded it
sees the same node. A layout must also fit the placements of its profiles (profile.py's
instances_fit, the library's rule).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from agent.errors import SimError
from agent.sim import ENV_PROFILE
from agent.sim.control import append_record, control_dir
from agent.sim.profile import gi_placements, instances_fit


def _profile(profile: str | None) -> dict:
    from agent.sim.profile import load_profile

    name = profile or os.environ.get(ENV_PROFILE)
    if not name:
        raise SimError(f"no profile to check the layout against: set {ENV_PROFILE} or pass "
                       f"--profile")
    return load_profile(name)


def _mig_gpu(profile: dict, index: int) -> dict:
    gpus = profile["gpus"]
    if not 0 <= index < len(gpus):
        raise SimError(f"GPU {index}: profile {profile['name']} has GPUs 0-{len(gpus) - 1}")
    gpu = gpus[index]
    if "mig" not in gpu:
        raise SimError(f"GPU {index} ({gpu['name']}) is not MIG capable in profile "
                       f"{profile['name']}")
    return gpu


def check_layout(profile: dict, index: int, layout: Mapping[str, int]) -> None:
    """SimError naming the GPU and the profile when `layout` cannot be made on GPU `index`."""
    mig = _mig_gpu(profile, index)["mig"]
    by_name = {p["name"]: p for p in mig["profiles"]}
    slices = max((p["slices"] for p in mig["profiles"]), default=0)
    used = count = 0
    for name, n in layout.items():
        if name not in by_name:
            raise SimError(f"GPU {index}: no MIG profile {name!r} (it has "
                           f"{', '.join(sorted(by_name))})")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise SimError(f"GPU {index}: {name}: {n!r} is not a count")
        used += by_name[name]["slices"] * n
        count += n
    if used > slices or count > mig["max_devices"]:
        raise SimError(f"GPU {index}: the layout {dict(layout)} needs {used} slices and "
                       f"{count} instances; the GPU has {slices} slices and at most "
                       f"{mig['max_devices']} instances")
    instances = [dict(gi=k, profile=by_name[name]["nvml_profile"])
                 for k, (name, n) in enumerate((name, n) for name, n in layout.items()
                                               for _ in range(n))]
    if not instances_fit(mig["profiles"], instances):
        raise SimError(f"GPU {index}: the layout {dict(layout)} does not fit the placements "
                       f"of its profiles (docs/simulator.md)")


def set_layout(ctl: str | os.PathLike | None, index: int, layout: Mapping[str, int] | None,
               profile: str | None = None) -> str:
    """Give GPU `index` the MIG instances `layout` ({profile name: count}; MIG enabled), or
    disable MIG on it (None). Returns the record written."""
    node = _profile(profile)
    if layout is None:
        _mig_gpu(node, index)
        return append_record(ctl, f"mig gpu={index} mode=disabled")
    check_layout(node, index, layout)
    text = ",".join(f"{name}:{n}" for name, n in layout.items() if n)
    if not text:
        return append_record(ctl, f"mig gpu={index} mode=enabled")
    return append_record(ctl, f"mig gpu={index} layout={text}")


def create(ctl: str | os.PathLike | None, index: int, name: str,
           profile: str | None = None, placement: int | None = None) -> str:
    """Create one instance of MIG profile `name` on GPU `index` (MIG must be enabled): a GPU
    instance with a compute instance of all its slices, at memory slice `placement` (one of
    the profile's placements), or the lowest free one."""
    node = _profile(profile)
    mig = _mig_gpu(node, index)["mig"]
    by_name = {p["name"]: p for p in mig["profiles"]}
    if name not in by_name:
        raise SimError(f"GPU {index}: no MIG profile {name!r}")
    if placement is None:
        return append_record(ctl, f"mig gpu={index} create={name}")
    starts, size = gi_placements(mig["profiles"])[by_name[name]["nvml_profile"]]
    if placement not in starts:
        raise SimError(f"GPU {index}: {name} has placements {starts} (size {size}), not "
                       f"{placement}")
    return append_record(ctl, f"mig gpu={index} create={name} placement={placement}")


def destroy(ctl: str | os.PathLike | None, mig_uuid: str) -> str:
    """Destroy the MIG device `mig_uuid`."""
    if not mig_uuid.startswith("MIG-") or any(c.isspace() for c in mig_uuid):
        raise SimError(f"{mig_uuid!r} is not a MIG device UUID")
    return append_record(ctl, f"mig gpu={mig_uuid} destroy=1")


def layouts_from_mig_parted(text: str, config: str | None, ngpus: int,
                            source: str = "<mig-parted config>") -> dict[int, dict | None]:
    """{GPU index: layout, or None for MIG disabled} from a mig-parted config file's text;
    `config` names the entry of `mig-configs` (needed when there are several)."""
    import yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SimError(f"{source}: not YAML: {exc}") from None
    configs = doc.get("mig-configs") if isinstance(doc, dict) else None
    if not isinstance(configs, dict) or not configs:
        raise SimError(f"{source}: no mig-configs mapping")
    if config is None:
        if len(configs) != 1:
            raise SimError(f"{source}: several mig-configs ({', '.join(configs)}): name one "
                           f"with --config")
        config = next(iter(configs))
    if config not in configs:
        raise SimError(f"{source}: no mig-config {config!r} (it has {', '.join(configs)})")
    out: dict[int, dict | None] = {}
    for i, entry in enumerate(configs[config] or []):
        where = f"{source}: mig-configs.{config}[{i}]"
        if not isinstance(entry, dict):
            raise SimError(f"{where}: expected a mapping")
        devices = entry.get("devices", "all")
        indexes = range(ngpus) if devices == "all" else devices
        if not isinstance(indexes, (list, range)) or \
                not all(isinstance(x, int) and 0 <= x < ngpus for x in indexes):
            raise SimError(f"{where}.devices: 'all' or a list of GPU indexes below {ngpus}")
        enabled = entry.get("mig-enabled")
        if not isinstance(enabled, bool):
            raise SimError(f"{where}.mig-enabled: expected true or false")
        layout = entry.get("mig-devices") or {}
        if not isinstance(layout, dict):
            raise SimError(f"{where}.mig-devices: expected a mapping of profile to count")
        for x in indexes:
            out[x] = dict(layout) if enabled else None
    return out


def _cmd_apply(args: argparse.Namespace) -> int:
    control_dir(args.control_dir)  # fails early when there is none
    node = _profile(args.profile)
    with open(args.file) as f:
        text = f.read()
    layouts = layouts_from_mig_parted(text, args.config, len(node["gpus"]), args.file)
    for index, layout in sorted(layouts.items()):
        if layout is not None:
            check_layout(node, index, layout)
        elif "mig" not in node["gpus"][index]:
            continue  # mig-enabled: false on a GPU without MIG: nothing to do
    for index, layout in sorted(layouts.items()):
        if layout is None and "mig" not in node["gpus"][index]:
            continue
        print(set_layout(args.control_dir, index, layout, args.profile))
    return 0


def _cmd_create(args: argparse.Namespace) -> int:
    print(create(args.control_dir, args.gpu, args.mig_profile, args.profile, args.placement))
    return 0


def _cmd_destroy(args: argparse.Namespace) -> int:
    print(destroy(args.control_dir, args.uuid))
    return 0


def add_cli(simsub: argparse._SubParsersAction) -> None:
    """Declare `gpu-agent sim mig apply|create|destroy`."""
    mig = simsub.add_parser("mig", help="change the simulated node's MIG layout while it runs")
    sub = mig.add_subparsers(dest="mig_command", metavar="MIG_COMMAND")
    sub.required = True

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--control-dir", default=None, help="control directory (default: "
                                                           "$GPU_AGENT_SIM_CONTROL)")
        p.add_argument("--profile", default=None, help=f"the node's profile, to check the "
                                                       f"layout against (default: ${ENV_PROFILE})")

    p = sub.add_parser("apply", help="apply a layout per GPU from an nvidia-mig-parted config")
    p.add_argument("file", help="mig-parted config file (version: v1, mig-configs: ...)")
    p.add_argument("--config", default=None, help="the mig-configs entry (needed when the "
                                                  "file has several)")
    common(p)
    p.set_defaults(func=_cmd_apply)

    p = sub.add_parser("create", help="create one MIG instance on a GPU")
    p.add_argument("--gpu", type=int, required=True, help="GPU index")
    p.add_argument("mig_profile", metavar="PROFILE", help="MIG profile name, e.g. 1g.10gb")
    p.add_argument("--placement", type=int, default=None, metavar="S",
                   help="the first memory slice, one of the profile's placements (default: "
                        "the lowest free one)")
    common(p)
    p.set_defaults(func=_cmd_create)

    p = sub.add_parser("destroy", help="destroy one MIG device")
    p.add_argument("uuid", help="the MIG device's UUID (MIG-...)")
    common(p)
    p.set_defaults(func=_cmd_destroy)
