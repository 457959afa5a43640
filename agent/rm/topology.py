"""The cost model of preferred allocation: how good a pair of GPUs is, as plain data.

Owns: the score of a pair of GPUs (NVLink by link count, then the PCIe common-ancestor level,
then NUMA locality; docs/allocation.md), and `TopologyModel`, the node's GPUs with every pair's
`Link` and score, built once per device set from what `agent.nvml.discovery` read (or, without
it, from NUMA nodes alone) together with the search object of `agent._fast` over its scores
(the live implementation, or the one a test or benchmark hands in as `topology_module`).
Must not call NVML (the links come in read) nor import grpc; no policy here (agent.rm.preferred
decides what to ask the search).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from agent._fast import topology_impl
from agent.nvml.discovery import LEVEL_NAMES, LEVEL_SYSTEM, Gpu, Link

log = logging.getLogger(__name__)

# Points per NVLink between the two GPUs (through an NVSwitch: the smaller switch-link count).
NVLINK_POINTS = 100
# Points by PCIe common-ancestor level (nvmlGpuTopologyLevel_t), NVIDIA's scale: the same board
# (INTERNAL, two GPUs on one card) 60, one switch (PIX) 50, several switches (PXB) 40, a host
# bridge (PHB) 30, the same NUMA node (NODE) 20, across sockets (SYS) 10. An unknown level
# counts as SYS.
PCIE_POINTS = {0: 60, 10: 50, 20: 40, 30: 30, 40: 20, 50: 10}
# Points when both GPUs sit on the same known NUMA node.
SAME_NUMA_POINTS = 5


def pair_score(link: Link, numa_a: int | None, numa_b: int | None) -> int:
    """The score of two GPUs joined by `link` on NUMA nodes numa_a / numa_b."""
    score = NVLINK_POINTS * link.nvlinks + PCIE_POINTS.get(link.level, PCIE_POINTS[LEVEL_SYSTEM])
    if numa_a is not None and numa_a == numa_b:
        score += SAME_NUMA_POINTS
    return score


class ModelGpu(NamedTuple):
    """One physical GPU of the model, at position `pos` of the score matrix."""

    pos: int
    index: int
    uuid: str
    numa_node: int | None


class TopologyModel:
    """The node's GPUs, every pair's link and score, and the search over the scores.

    Positions follow GPU index order; `links[(a, b)]` is keyed by position. `source` says where
    the links came from ("nvml", or "numa" for the NUMA-only fallback), for logs and status.
    `topology_module` is the agent._fast topology module whose PairScores searches the model;
    None: the live one (agent._fast.topology_impl). Tests and benchmarks hand in the compiled
    module or its twin.
    """

    __slots__ = ("gpus", "links", "source", "scores", "search", "by_uuid")

    def __init__(self, gpus: tuple[ModelGpu, ...], links: Mapping[tuple[int, int], Link],
                 source: str = "nvml", topology_module: Any = None):
        self.gpus = gpus
        self.links = links
        self.source = source
        n = len(gpus)
        self.scores: tuple[tuple[int, ...], ...] = tuple(
            tuple(0 if a == b else pair_score(self.link(a, b), gpus[a].numa_node,
                                              gpus[b].numa_node) for b in range(n))
            for a in range(n))
        impl = topology_impl if topology_module is None else topology_module
        self.search = impl.PairScores(self.scores, [g.numa_node is None for g in gpus])
        self.by_uuid: dict[str, ModelGpu] = {g.uuid: g for g in gpus}

    def __repr__(self) -> str:
        return f"TopologyModel({len(self.gpus)} GPUs, source={self.source!r})"

    def link(self, a: int, b: int) -> Link:
        """The link between positions a and b (SYS without NVLink when it was not read)."""
        if a == b:
            return Link(0)
        return self.links.get((a, b)) or self.links.get((b, a)) or Link(LEVEL_SYSTEM)

    def summary(self) -> str:
        """One line for the log: GPU count, NVLinked / NVSwitch pairs, NUMA nodes."""
        n = len(self.gpus)
        pairs = [self.link(a, b) for a in range(n) for b in range(a + 1, n)]
        nv = sum(1 for link in pairs if link.nvlinks and not link.via_switch)
        switched = sum(1 for link in pairs if link.via_switch)
        numa = sorted({g.numa_node for g in self.gpus if g.numa_node is not None})
        return (f"{n} GPUs, {nv} NVLinked pairs, {switched} pairs over NVSwitch, "
                f"{len(pairs) - nv - switched} PCIe-only pairs, NUMA nodes "
                f"{numa or 'unknown'} (links from {self.source})")

    def covers(self, uuids: Iterable[str]) -> bool:
        return all(u in self.by_uuid for u in uuids)

    def describe(self, positions: Sequence[int]) -> str:
        """`GPU0-GPU1 NV2, GPU0-GPU3 SYS, ...`: the links of every pair among positions."""
        parts = []
        for x, a in enumerate(positions):
            for b in positions[x + 1:]:
                parts.append(f"GPU{self.gpus[a].index}-GPU{self.gpus[b].index} "
                             f"{self.link(a, b).label}")
        return ", ".join(parts)

    @classmethod
    def from_links(cls, gpus: Sequence[Gpu], links: Mapping[tuple[int, int], Link],
                   source: str = "nvml", *, topology_module: Any = None) -> TopologyModel:
        """The model of `gpus` from `read_links` output (keyed by GPU index), MIG-enabled GPUs
        included."""
        ordered = sorted(gpus, key=lambda g: g.index)
        model_gpus = tuple(ModelGpu(p, g.index, g.uuid, g.numa_node) for p, g in enumerate(ordered))
        pos = {g.index: g.pos for g in model_gpus}
        by_pos = {(pos[a], pos[b]): link for (a, b), link in links.items()
                  if a in pos and b in pos}
        return cls(model_gpus, by_pos, source, topology_module)

    @classmethod
    def numa_only(cls, devices: Iterable[Any], *, topology_module: Any = None) -> TopologyModel:
        """A model from NUMA nodes alone (no links read): every pair is SYS, plus the same-NUMA
        points. `devices` are agent.rm.devices.Device records (several may share a GPU)."""
        seen: dict[str, tuple[int, int | None]] = {}
        for d in devices:
            seen.setdefault(d.gpu_uuid, (d.gpu_index, d.numa_node))
        ordered = sorted(seen.items(), key=lambda kv: (kv[1][0], kv[0]))
        model_gpus = tuple(ModelGpu(p, index, uuid, numa)
                           for p, (uuid, (index, numa)) in enumerate(ordered))
        return cls(model_gpus, {}, "numa", topology_module)


def level_name(level: int) -> str:
    return LEVEL_NAMES.get(level, "SYS")
