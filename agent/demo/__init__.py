"""`gpu-agent demo` (the README's `make demo`): a narrated walk through a simulated GPU node.

Owns: the walk-through and its short tables. It starts the simulated kubelet and the agent
(`gpu-agent run`) as real subprocesses, loads the simulated NVML in this process to show what
the node looks like, admits a pod through the simulated kubelet, restarts the kubelet, drives
faults through `gpu-agent sim`, and ends with `gpu-agent doctor` on the node (a simulated
driver tree from agent.sim.driver_tree, the simulated kubelet, the simulated NVML). Must not
contain agent logic: it only shows what the parts do, as an operator would see them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

XID_EVENT = 0x8
RESOURCE = "nvidia.com/gpu"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> str:
    """A plain-text table with a header rule, columns padded to their widest cell."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [indent + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in cells]
    lines.insert(1, indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def say(step: str, text: str = "") -> None:
    print(f"\n== {step}")
    if text:
        print(text)
    sys.stdout.flush()


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.0f} GiB"


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"simulated kubelet exited early with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.05)


def _wait_state(client, predicate, agent: subprocess.Popen, log: Path, what: str,
                timeout: float = 20):
    """Poll the simulated kubelet until predicate(state); fail if the agent exits."""
    deadline = time.monotonic() + timeout
    while True:
        state = client.state()
        if predicate(state):
            return state
        if agent.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"{what}: not seen (agent exit code {agent.poll()}); "
                               f"agent log:\n{tail}")
        time.sleep(0.02)


def _wait_listed(socket: Path, pod: str, timeout: float = 20) -> None:
    """Until kubelet's podresources lists `pod`."""
    from agent.kubelet.podresources import PodResourcesClient

    client, start = PodResourcesClient(str(socket)), time.monotonic()
    try:
        while not any(d.name == pod for d in client.list()):
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"podresources never listed pod {pod} again")
            time.sleep(0.02)
    finally:
        client.close()


def _registered(count: int):
    def check(state) -> bool:
        r = state.resource(RESOURCE)
        return bool(r and r.connected and r.registrations >= count and r.devices
                    and r.last_snapshot_ns >= r.registered_ns)
    return check


def _doctor(work: Path, tree, config_args: list[str], lib: str) -> int:
    """Step 11: `gpu-agent doctor` on the simulated node, then on the same node without its
    /dev/char links; the exit code of the first run."""
    argv = [sys.executable, "-m", "agent", "doctor", "--root", tree.root, *config_args]
    shown = " ".join(["gpu-agent", *argv[3:]]).replace(lib, "$(gpu-agent sim lib-path)") \
        .replace(str(work), "$W")
    say("12. gpu-agent doctor: the node checked end to end (docs/troubleshooting.md)",
        f"  {shown}\n  (--root: the simulated driver tree, device nodes recorded with their "
        f"major:minor, /dev/char links, containerd config, toolkit stubs; the rest is the "
        f"agent's own configuration)")
    first = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    print("\n".join("    " + line for line in first.stdout.splitlines()))
    links = sorted({tree.char_link(p) for p, _, _ in tree.nodes})
    for link in links:
        os.unlink(link)
    print(f"\n  The same node without its {len(links)} /dev/char links (nothing created them, "
          f"as on many hosts): `systemctl daemon-reload` would take the GPUs from running "
          f"containers; the doctor says so and names the fix:")
    second = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    lines = second.stdout.splitlines()
    at = next((i for i, line in enumerate(lines) if "devices.dev-char" in line), None)
    if at is not None:
        shown_lines = [lines[at]] + [line for line in lines[at + 1:at + 3]
                                     if line.startswith(" " * 10)]
        print("\n".join("    " + line for line in shown_lines))
    print(f"    ... {lines[-1] if lines else ''}")
    return first.returncode


def run_demo(profile: str = "dgx1-v100", keep: bool = False) -> int:
    import pynvml

    from agent import _fast
    from agent.nvml import discovery, library
    from agent.sim import control, driver_tree, lib_path
    from agent.sim.kubelet import SimKubeletClient

    work = Path(tempfile.mkdtemp(prefix="gademo"))
    ctl = work / "simctl"
    ctl.mkdir()
    dp_dir = work / "device-plugins"
    dp_dir.mkdir()
    os.environ["GPU_AGENT_SIM_PROFILE"] = profile
    os.environ["GPU_AGENT_SIM_CONTROL"] = str(ctl)
    kubelet = agent = None
    try:
        path = str(lib_path())
        library.init(path)
        say(f"1. Simulated GPU node '{profile}'",
            f"  NVML library: {path} (the same ABI as the driver's libnvidia-ml.so.1)\n"
            f"  driver {pynvml.nvmlSystemGetDriverVersion()}, "
            f"CUDA {pynvml.nvmlSystemGetCudaDriverVersion()}")
        gpus = discovery.discover()
        print(table(
            ["GPU", "name", "UUID", "PCI bus id", "NUMA", "memory", "CC", "MIG"],
            [[g.index, g.name, g.uuid, g.pci_bus_id,
              "-" if g.numa_node is None else g.numa_node, _gib(g.memory_total),
              "{}.{}".format(*g.compute_capability), "on" if g.mig_enabled else "off"] for g in gpus],
        ))

        links = discovery.read_links(gpus)
        say("2. Topology read back through NVML (as `nvidia-smi topo -m` shows it)")
        print(table(["", *[f"GPU{g.index}" for g in gpus]],
                    [[f"GPU{a.index}", *["X" if a.index == b.index
                                         else links[(a.index, b.index)].label for b in gpus]]
                     for a in gpus]))

        say("3. Simulated kubelet", f"  gpu-agent sim kubelet --dir {dp_dir}")
        kubelet = subprocess.Popen(
            [sys.executable, "-m", "agent", "sim", "kubelet", "--dir", str(dp_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _wait_for(dp_dir / "kubelet.sock", kubelet)
        client = SimKubeletClient(str(dp_dir))
        state = client.state()
        print(f"  listening on {dp_dir / 'kubelet.sock'} (pid {kubelet.pid}); "
              f"registered device plugins: {len(state.registrations)}")

        # The host's files as the driver, the toolkit and containerd leave them (device nodes,
        # /dev/char links, config.toml, the CDI spec), for the agent's CDI check and the doctor.
        tree = driver_tree.build(str(work / "root"), profile)
        config_args = ["--kubelet-socket", str(dp_dir / "kubelet.sock"),
                       "--pod-resources-socket", str(dp_dir / "pod-resources" / "kubelet.sock"),
                       "--nvml-library", path, "--state-dir", str(work / "state"),
                       "--device-list-strategy", "envvar,cdi-cri",
                       "--cdi-spec-dirs", tree.path("/etc/cdi")]
        features = work / "features.d" / "gpu-agent"
        agent_args = ["run", *config_args, "--recovery-quiet-period", "1s",
                      "--unhealthy-devices-file", str(work / "unhealthyDevices.json"),
                      "--metrics-address", "127.0.0.1:0", "--nfd-features-file", str(features)]
        say("4. The agent registers with kubelet",
            f"  W={work}\n  gpu-agent " + " ".join(agent_args).replace(path, "$(gpu-agent sim lib-path)")
            .replace(str(work), "$W"))
        agent_log = work / "agent.log"
        t0 = time.monotonic()
        with open(agent_log, "wb") as log_file:
            agent = subprocess.Popen([sys.executable, "-m", "agent", *agent_args],
                                     stdout=log_file, stderr=subprocess.STDOUT)
        state = _wait_state(client, _registered(1), agent, agent_log, "registration")
        res = state.resource(RESOURCE)
        print(table(["resource", "endpoint", "registrations", "preferred allocation",
                     "pre-start", "registered after"],
                    [[res.name, res.endpoint, res.registrations,
                      "yes" if res.get_preferred_allocation_available else "no",
                      "yes" if res.pre_start_required else "no",
                      f"{time.monotonic() - t0:.2f} s (process start to device list)"]]))

        say("5. Devices as kubelet sees them (ListAndWatch)")
        by_uuid = {g.uuid: g for g in gpus}
        print(table(["GPU", "device ID (UUID)", "NUMA", "health"],
                    [[by_uuid[d.id].index, d.id, ",".join(map(str, d.numa_nodes)) or "-",
                      d.health] for d in sorted(res.devices, key=lambda d: by_uuid[d.id].index)]))
        print(f"  capacity {res.capacity}, allocatable {res.allocatable}")

        size = min(4, len(gpus))
        say(f"6. A {size}-GPU pod: kubelet asks for a preferred allocation, then Allocate")
        pod = client.admit_pod("trainer", {"main": {RESOURCE: size}})
        alloc = pod.container("main").allocation(RESOURCE)
        picked = [by_uuid[d] for d in alloc.preferred_device_ids]
        print(f"  preferred: GPUs {', '.join(str(g.index) for g in picked)} "
              f"(NUMA {', '.join(sorted({str(g.numa_node) for g in picked}))}); "
              f"kubelet allocated: GPUs "
              f"{', '.join(str(by_uuid[d].index) for d in alloc.device_ids)}")
        print("  links joining the picked GPUs:")
        print(table(["", *[f"GPU{g.index}" for g in picked]],
                    [[f"GPU{a.index}", *["X" if a.index == b.index
                                         else links[(a.index, b.index)].label for b in picked]]
                     for a in picked], indent="    "))
        from agent.rm.topology import TopologyModel
        model = TopologyModel.from_links(gpus, links)
        chosen = sum(1 << model.by_uuid[g.uuid].pos for g in picked)
        best = model.search.best_set((1 << len(model.gpus)) - 1, 0, size)
        print(f"  set score {model.search.set_score(chosen)} (the sum of its pair scores: 100 "
              f"per NVLink, PIX 50 ... SYS 10, +5 on one NUMA node; docs/allocation.md); the "
              f"best {size}-GPU set of this node scores {model.search.set_score(best)}")
        r = alloc.container_response
        rows = [[f"env {k}", v] for k, v in sorted(r.envs.items())]
        rows += [["CDI device", c.name] for c in r.cdi_devices]
        rows += [["mount", f"{m.host_path} -> {m.container_path}"] for m in r.mounts]
        rows += [["device", f"{d.host_path} ({d.permissions})"] for d in r.devices]
        rows += [[f"annotation {k}", v] for k, v in sorted(r.annotations.items())]
        print("  Allocate response (one container):")
        wrapped = []  # long lists one item a line, as written (commas kept)
        for field, value in rows:
            items = value.split(",")
            wrapped += [[field if i == 0 else "", item + ("," if i < len(items) - 1 else "")]
                        for i, item in enumerate(items)]
        print(table(["field", "value"], wrapped, indent="    "))

        say("7. Health signal path: NVML event → agent._fast event loop → kubelet, and back",
            f"  hot paths: {_fast.IMPLEMENTATION}")
        events = _fast.events_impl
        with events.EventSet(path) as es:
            for g in gpus:
                es.register(g.index, XID_EVENT)
            victim = gpus[min(3, len(gpus) - 1)]
            print(f"  registered XidCriticalError on {len(gpus)} GPUs; injecting: "
                  f"gpu-agent sim inject-xid --gpu {victim.index} --xid 48")
            control.check_gpu(victim.index)  # validate first: time the delivery only
            t0 = time.perf_counter()
            control.inject_xid(str(ctl), victim.index, 48)
            ev = es.wait(2000)
            dt = (time.perf_counter() - t0) * 1e6
            if ev is None:
                raise RuntimeError("the injected XID was not delivered")
            print(table(["GPU", "UUID", "event", "XID", "delivered in"],
                        [[ev.index, ev.uuid, "XidCriticalError", ev.xid, f"{dt:.0f} µs"]]))
        # The agent's own event loop saw the same XID: kubelet gets a snapshot without the GPU,
        # and XID 48 (reset-class) lets it come back after the quiet period and a probe.
        state = _wait_state(client, lambda s: victim.uuid not in s.resource(RESOURCE).healthy_ids,
                            agent, agent_log, "the withdrawal")
        res = state.resource(RESOURCE)
        snap = res.latest_snapshot
        print(f"  the agent withdrew GPU {victim.index}: kubelet got snapshot #{snap.seq} with it "
              f"Unhealthy, allocatable {res.allocatable}/{res.capacity}")
        t1 = time.monotonic()
        state = _wait_state(client, lambda s: victim.uuid in s.resource(RESOURCE).healthy_ids,
                            agent, agent_log, "the recovery")
        res = state.resource(RESOURCE)
        print(f"  XID 48 is reset-class: after {time.monotonic() - t1:.1f} s without a new "
              f"critical event and a passing NVML probe it is back, allocatable "
              f"{res.allocatable}/{res.capacity} (docs/health.md)")

        say("8. Kubelet restart: the agent registers again",
            f"  gpu-agent sim kubelet-restart --dir {dp_dir}")
        t0 = time.monotonic()
        removed = client.restart()
        state = _wait_state(client, _registered(2), agent, agent_log, "re-registration")
        res = state.resource(RESOURCE)
        print(f"  kubelet removed {', '.join(os.path.basename(p) for p in removed)}; the agent "
              f"saw it (inotify) and registered again in {time.monotonic() - t0:.2f} s")
        print(table(["resource", "registrations", "stream", "allocatable", "pod trainer keeps"],
                    [[res.name, res.registrations, "open" if res.connected else "closed",
                      res.allocatable,
                      f"GPUs {', '.join(str(by_uuid[d].index) for d in state.pod('trainer').devices(RESOURCE))}"]]))
        _wait_listed(dp_dir / "pod-resources" / "kubelet.sock", "trainer")
        print(f"  podresources lists pod trainer again {time.monotonic() - t0:.1f} s after the "
              f"restart (a real "
              f"kubelet lists its pods once it has read them from the API server; the agent "
              f"keeps their records meanwhile: docs/state.md)")

        from agent.demo.metrics import run_metrics_step
        from agent.demo.mig import run_mig_step
        from agent.demo.sharing import run_sharing_step

        metrics_code = run_metrics_step(str(work / "state"), str(features), str(ctl), "9",
                                        table, say)
        mig_code = run_mig_step(work, path, "10", table, say, _wait_state)
        sharing_code = run_sharing_step(work, path, profile, "11", table, say, _wait_state)
        doctor_code = _doctor(work, tree, config_args, path)

        say("13. Clean stop")
        agent.send_signal(signal.SIGTERM)
        agent_code = agent.wait(10)
        gone = not (dp_dir / "gpu-agent-gpu.sock").exists()
        print(f"  gpu-agent: SIGTERM → exit {agent_code}; its socket removed: "
              f"{'yes' if gone else 'no'}")
        agent = None
        kubelet.terminate()
        code = kubelet.wait(10)
        kubelet = None
        client.close()
        print(f"  simulated kubelet stopped (exit {code}); NVML shut down")
        library.shutdown()
        ok = code == 0 and agent_code == 0 and gone and doctor_code == 0 and mig_code == 0 \
            and metrics_code == 0 and sharing_code == 0
        return 0 if ok else 1
    finally:
        if agent is not None:
            agent.kill()
            agent.wait()
        if kubelet is not None:
            kubelet.kill()
            kubelet.wait()
        if keep:
            print(f"\n(kept {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)
