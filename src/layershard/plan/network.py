"""Communication from the links: named clusters, and a collective's time on them.

A collective's time is NCCL's own cost model (``src/graph/tuning.cc``, Simple protocol, the
one NCCL picks for the megabyte buffers of sharded training): a latency of ``base + steps x
hop`` and the bytes each GPU sends over each link divided by that link's bandwidth:

    ring all-gather / reduce-scatter over m ranks:  8.4 us + (m - 1) x hop
    ring all-reduce:                                8.4 us + 2 (m - 1) x hop
    tree all-reduce (several nodes):                2 ((m / nodes - 1) x 28 us + log2(nodes) x 50 us)
    hop: 5.7 us over NVLink, 6.6 us when the ring crosses the network

An all-reduce takes the faster of ring and tree latency (NCCL tunes per size; the bytes are
the ring's). The bytes by link are ``timing.ring_bytes``: a group within one node moves
everything over NVLink; across nodes each of the p GPUs of a node runs a ring through its own
NIC, so 1/p of what a GPU sends crosses the network.

The latency grows with the ring (linearly) and with the tree (log2 of the nodes): at 512 GPUs
one all-gather pays 8.4 + 511 x 6.6 us = 3.4 ms whatever its size, which is what a sharded
run of a small model loses going from 128 to 512 GPUs.

A cluster preset names the links of a real machine (per-GPU bandwidth per direction, from
datasheets or the source of a published run) and the fraction of it a ring reaches
(``Links``); ``--cluster`` picks one, ``--intra-bw`` / ``--inter-bw`` override it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# NCCL's Simple-protocol latencies (us): NVIDIA/nccl src/graph/tuning.cc, baseLat and hwLat
NCCL_BASE_US = 8.4  # ring
NCCL_RING_HOP_US = {"nvlink": 5.7, "network": 6.6}
NCCL_TREE_HOP_US = {"nvlink": 28.0, "network": 50.0}


@dataclass(frozen=True)
class Links:
    """A cluster's links: per-GPU bandwidth per direction (GB/s) and the fraction of it a ring
    collective reaches (nccl-tests' bus bandwidth / nominal)."""

    name: str
    intra_gbs: float  # NVLink per GPU
    inter_gbs: float  # network per GPU (the node's NICs / its GPUs)
    intra_eff: float
    inter_eff: float
    source: str


CLUSTERS: dict[str, Links] = {
    "dgx-a100": Links("dgx-a100", 300.0, 25.0, 0.77, 0.80,
                      "DGX A100: NVLink 3 (600 GB/s bidirectional), 8 x HDR 200 Gb/s NICs"),
    "dgx-h100": Links("dgx-h100", 450.0, 50.0, 0.80, 0.80,
                      "DGX H100: NVLink 4 (900 GB/s bidirectional), 8 x NDR 400 Gb/s NICs"),
    "mosaic-a100": Links("mosaic-a100", 300.0, 25.0, 0.77, 0.80,
                         "llm-foundry's A100 tables: 1600 Gb/s node-to-node RoCE per node of 8"),
    "mosaic-h100": Links("mosaic-h100", 450.0, 50.0, 0.80, 0.80,
                         "llm-foundry's H100 tables (network not printed): assumed 3200 Gb/s "
                         "per node of 8, the HGX H100 reference"),
    "grand-teton": Links("grand-teton", 450.0, 50.0, 0.80, 0.80,
                         "torchtitan's H100 hosts: NVLink, 400 Gb/s RDMA per GPU"),
    "ibm-vela": Links("ibm-vela", 300.0, 6.25, 0.77, 0.80,
                      "IBM's A100 cluster of fms-fsdp's runs: 400 Gb/s per node of 8 (fms-fsdp "
                      "README at 5a296af, 'A100 80G 128 GPUs with 400Gbps'; Ethernet with "
                      "SR-IOV, research.ibm.com/blog/AI-supercomputer-Vela-GPU-cluster)"),
    "aws-p4d": Links("aws-p4d", 300.0, 6.25, 0.77, 0.80,
                     "AWS p4d.24xlarge: 400 Gb/s EFA per node of 8 A100"),
    "aws-p5": Links("aws-p5", 450.0, 50.0, 0.80, 0.80,
                    "AWS p5.48xlarge: 3200 Gb/s EFA per node of 8 H100"),
}  # fmt: skip


def get_cluster(name: str) -> Links:
    key = name.lower()
    if key not in CLUSTERS:
        raise ValueError(f"unknown cluster {name!r}; known: {', '.join(CLUSTERS)}")
    return CLUSTERS[key]


def collective_latency_s(
    op: str, ranks: int, nodes: int, base_us: float = NCCL_BASE_US, hop_scale: float = 1.0
) -> float:
    """NCCL's latency of one collective over ``ranks`` ranks on ``nodes`` nodes (module
    docstring); ``hop_scale`` scales the per-step terms (1: NCCL's table)."""
    if ranks <= 1:
        return 0.0
    link = "network" if nodes > 1 else "nvlink"
    # a point-to-point hop (ring attention's send/recv) is one step whatever the group
    steps = 2 * (ranks - 1) if op == "all_reduce" else 1 if op == "send_recv" else ranks - 1
    ring = base_us + steps * NCCL_RING_HOP_US[link] * hop_scale
    if op != "all_reduce" or nodes <= 1:
        return ring * 1e-6
    per_node = max(1, ranks // nodes)
    tree = (
        2
        * (
            (per_node - 1) * NCCL_TREE_HOP_US["nvlink"]
            + math.log2(nodes) * NCCL_TREE_HOP_US["network"]
        )
        * hop_scale
    )
    return min(ring, tree) * 1e-6
