"""The allocation journal's cost: what checkpointing adds to Allocate, and how long a restart
takes to load and reconcile a large checkpoint.

Owns: measuring Allocate over a real plugin socket against a server process with the journal
(checkpoint on the machine's disk, every write fsynced) and without it, with 1 blocking caller
and with 64 concurrent grpc.aio callers; the journal alone (record_allocation, 1 and 64
threads); and, for 10,000 records, the checkpoint's size, its decode, the journal's load
(read + decode), one reconciliation against a 10,000-container podresources listing, and one
full rewrite (encode + fsync). Figures only; the tests assert behaviour, never time.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import grpc

from agent._proto.deviceplugin.v1beta1 import api_pb2 as dp
from agent._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from bench import Section, allocate_concurrently, percentile

RESOURCE = "nvidia.com/gpu"
ONE_CALLER_CALLS = 1000
MANY_CALLERS = 64
CALLS_PER_CALLER = 30
JOURNAL_CALLS = 500
RECORDS = 10_000
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _devices():
    from agent.rm.devices import Device
    return [Device(id=f"GPU-{uuid.UUID(int=i + 1)}", index=str(i),
                   gpu_uuid=f"GPU-{uuid.UUID(int=i + 1)}", gpu_index=i, numa_node=i // 4,
                   paths=(f"/dev/nvidia{i}",), name="Tesla V100-SXM2-16GB") for i in range(8)]


def serve(socket_dir: str, state_dir: str) -> None:
    """The server process: one resource's plugin server (journal in `state_dir`, or none if
    it is empty) until stdin closes; then prints the journal's write count."""
    from agent.kubelet.plugin import PluginServer
    from agent.rm.allocate import ResponseOptions
    from agent.rm.manager import ResourceManager
    from agent.state.journal import CHECKPOINT_FILE, Journal

    journal = None
    if state_dir:
        journal = Journal(os.path.join(state_dir, CHECKPOINT_FILE), boot="bench")
        journal.load()
    manager = ResourceManager(RESOURCE, _devices(), ResponseOptions(),
                              journal=journal.record_allocation if journal else None)
    server = PluginServer(manager, socket_dir)
    server.start()
    print("ready", flush=True)
    sys.stdin.read()
    server.stop()
    print(f"{journal.writes if journal else 0} {len(journal.records()) if journal else 0}",
          flush=True)


class _Server:
    def __init__(self, work: str, with_journal: bool):
        self.dir = tempfile.mkdtemp(prefix="s", dir=work)
        state = os.path.join(self.dir, "state") if with_journal else ""
        if state:
            os.makedirs(state)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from bench.bench_state import serve; "
             "serve(sys.argv[1], sys.argv[2])", self.dir, state],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the bench server did not start")
        self.socket = os.path.join(self.dir, "gpu-agent-gpu.sock")

    def stop(self) -> tuple[int, int]:
        """(writes, records) of the server's journal."""
        self.proc.stdin.close()
        out = self.proc.stdout.read().split()
        self.proc.wait(10)
        return int(out[-2]), int(out[-1])


def _request() -> dp.AllocateRequest:
    ids = [d.id for d in _devices()[:2]]
    return dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)])


def _one_caller(socket: str) -> list[float]:
    request = _request()
    with grpc.insecure_channel(f"unix:{socket}", options=[("grpc.enable_http_proxy", 0)]) as ch:
        stub = dp_grpc.DevicePluginStub(ch)
        for _ in range(50):
            stub.Allocate(request, timeout=10)
        out = []
        for _ in range(ONE_CALLER_CALLS):
            start = time.perf_counter()
            stub.Allocate(request, timeout=10)
            out.append(time.perf_counter() - start)
    return out


def _many_callers(socket: str) -> list[float]:
    return allocate_concurrently(socket, _request(), MANY_CALLERS, CALLS_PER_CALLER)[0]


def _journal_direct(work: str, threads: int) -> tuple[list[float], int, int]:
    """record_allocation timed in-process from `threads` threads; (samples, calls, writes)."""
    from agent.rm.allocate import ResponseOptions, container_response
    from agent.state.journal import CHECKPOINT_FILE, Journal

    d = tempfile.mkdtemp(prefix="j", dir=work)
    journal = Journal(os.path.join(d, CHECKPOINT_FILE), boot="bench")
    journal.load()
    devices = _devices()[:2]
    containers = [(devices, container_response(devices, ResponseOptions()))]
    per_thread = max(1, JOURNAL_CALLS // threads) if threads > 1 else JOURNAL_CALLS
    samples: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(threads)

    def run() -> None:
        mine = []
        barrier.wait()
        for _ in range(per_thread):
            start = time.perf_counter()
            journal.record_allocation(RESOURCE, containers)
            mine.append(time.perf_counter() - start)
        with lock:
            samples.extend(mine)

    pool = [threading.Thread(target=run) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return samples, len(samples), journal.writes


def _big_checkpoint(work: str) -> dict:
    """Figures for a checkpoint of RECORDS records (1-2 GPUs each, envvar + CDI annotation
    responses), all attributed, reconciled against a listing naming every container."""
    from agent.state import checkpoint as ck
    from agent.state.journal import CHECKPOINT_FILE, Journal
    from agent.state.reconcile import PodDevices, reconcile

    devices = _devices()
    now = time.time()
    records = []
    listing = []
    for i in range(RECORDS):
        ds = [devices[i % 8]] + ([devices[(i + 1) % 8]] if i % 2 else [])
        pod = ck.PodRef(f"ns-{i % 50}", f"pod-{i}", "main")
        ids = tuple(d.id for d in ds)
        records.append(ck.Record(
            id=uuid.uuid4().hex, resource=RESOURCE, devices=ids,
            gpus=tuple(ck.GpuRef(d.gpu_uuid, d.gpu_index) for d in ds),
            response=ck.Response(envs={"NVIDIA_VISIBLE_DEVICES": ",".join(ids)},
                                 annotations={f"cdi.k8s.io/gpu-agent_{uuid.uuid4()}":
                                              ",".join(f"nvidia.com/gpu={i}" for i in ids)},
                                 cdi_devices=tuple(f"nvidia.com/gpu={i}" for i in ids)),
            time=now - RECORDS + i, boot="bench", pod=pod, confirmed=now - 1))
        listing.append(PodDevices(pod.namespace, pod.name, pod.container, RESOURCE, ids))
    cp = ck.Checkpoint(records=tuple(records), written=now, boot="bench", keyed_by="uuid")
    d = tempfile.mkdtemp(prefix="big", dir=work)
    path = os.path.join(d, CHECKPOINT_FILE)

    def timed(fn, repeat=5):
        out = []
        for _ in range(repeat):
            start = time.perf_counter()
            value = fn()
            out.append(time.perf_counter() - start)
        return statistics.median(out), value

    encode_s, data = timed(lambda: ck.encode(cp))
    with open(path, "wb") as f:
        f.write(data)
    decode_s, _ = timed(lambda: ck.decode(data))

    def load():
        j = Journal(path, boot="bench")
        j.load()
        return j

    load_s, journal = timed(load)
    by_resource = {RESOURCE: devices}
    reconcile_s, outcome = timed(lambda: reconcile(journal.records(), listing,
                                                   devices=by_resource, keyed_by="uuid",
                                                   boot="bench", now=now))
    assert len(outcome.kept) == RECORDS and not outcome.dropped
    apply_s, _ = timed(lambda: journal.apply(outcome), repeat=1)  # confirmed times change
    flush_s, _ = timed(journal.flush)
    return {"size": len(data), "encode": encode_s, "decode": decode_s, "load": load_s,
            "reconcile": reconcile_s, "apply": apply_s, "flush": flush_s}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def run() -> Section:
    section = Section(
        title="Allocation state: checkpoint cost on Allocate, load and reconcile at scale",
        method=(
            "A plugin server process (one resource, 8 devices, envvar responses) serving "
            "Allocate on a unix socket, with the journal (checkpoint on the local disk, temp "
            "file + fsync + rename + directory fsync per write, concurrent Allocates sharing "
            "a write) and without it; a 2-GPU request from 1 blocking caller "
            f"({ONE_CALLER_CALLS} calls) and from {MANY_CALLERS} concurrent grpc.aio callers "
            f"× {CALLS_PER_CALLER} calls on one channel. The journal alone: "
            f"record_allocation from 1 thread and from 64 threads ({JOURNAL_CALLS} calls). "
            f"Restart at scale: a checkpoint of {RECORDS:,} attributed records decoded, "
            "loaded by the journal (read + decode), reconciled against a podresources "
            f"listing of {RECORDS:,} containers, the outcome applied (one rewrite), and one "
            "more rewrite (encode + fsync)."),
        header=["measure", "median", "p99", "notes"],
    )
    work = tempfile.mkdtemp(prefix="gabs", dir="/var/tmp")
    try:
        results = {}
        for label, with_journal in (("without journal", False), ("with journal", True)):
            server = _Server(work, with_journal)
            try:
                one = _one_caller(server.socket)
                many = _many_callers(server.socket)
            finally:
                writes, records = server.stop()
            results[label] = (one, many, writes, records)
        for callers, idx in (("1 caller", 0), (f"{MANY_CALLERS} callers", 1)):
            base = results["without journal"][idx]
            withj = results["with journal"][idx]
            for label, samples in (("without journal", base), ("with journal", withj)):
                note = ""
                if label == "with journal" and idx == 1:
                    calls = len(samples) + 50
                    writes = results["with journal"][2] - ONE_CALLER_CALLS - 50
                    note = f"{calls} Allocates in {writes} writes"
                section.rows.append([f"Allocate, {callers}, {label}",
                                     _ms(statistics.median(samples)),
                                     _ms(percentile(samples, 99)), note])
            added50 = statistics.median(withj) - statistics.median(base)
            added99 = percentile(withj, 99) - percentile(base, 99)
            section.rows.append([f"**added by the journal, {callers}**", _ms(added50),
                                 _ms(added99), "p50 and p99 differences"])
        section.notes.append(
            f"No pod ends in this run, so nothing is dropped: the checkpoint grows from 0 to "
            f"{results['with journal'][3]:,} records while it runs, and every write carries "
            f"all of them; the figures are an upper bound for a node with fewer live "
            f"allocations.")
        for threads in (1, 64):
            samples, calls, writes = _journal_direct(work, threads)
            section.rows.append([f"journal.record_allocation, {threads} thread"
                                 f"{'s' if threads > 1 else ''}",
                                 _ms(statistics.median(samples)), _ms(percentile(samples, 99)),
                                 f"{calls} records in {writes} writes"])
        big = _big_checkpoint(work)
        section.rows += [
            [f"decode {RECORDS:,} records", _ms(big["decode"]), "",
             f"file {big['size'] / 1e6:.2f} MB"],
            [f"load {RECORDS:,} records (read + decode)", _ms(big["load"]), "", ""],
            [f"reconcile {RECORDS:,} records with {RECORDS:,} listed containers",
             _ms(big["reconcile"]), "", "all matched"],
            ["**load + reconcile**", _ms(big["load"] + big["reconcile"]), "",
             "what a restart spends before the first write"],
            [f"apply the outcome: first rewrite of {RECORDS:,} records", _ms(big["apply"]), "",
             "packs every record once"],
            [f"rewrite {RECORDS:,} records, packed records cached", _ms(big["flush"]), "",
             f"encode without the cache {_ms(big['encode'])}"],
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    section.notes += [
        "Each write rewrites the whole file, so its cost grows with the number of live "
        "records (records of ended pods are dropped at each reconciliation); a node holds "
        "one record per container with GPUs, tens to a few hundred in practice.",
        "The checkpoint is on /var/tmp (the local disk); fsync cost depends on the disk and "
        "its cache (a VM's virtual disk here).",
    ]
    return section
