"""fsdp-plan's network: what one collective costs on the cluster's links (ring algorithms, the
busiest host link), fsdp's shard, replica and hpZ groups, and a quantized gather's bytes."""

import math


class Cost:
    """What one collective takes: t_inter, seconds of bytes on the busiest host link (0: it stays
    inside hosts); t_intra, seconds of bytes on a rank's link inside its host; t_messages, its
    per-message costs; link_bytes, the bytes on the busiest host link; overlaps_wire: whether the
    per-message costs run beside the transfers (Gloo over TCP) or before each step's (NCCL);
    t_after, compute its completion waits for (a quantized gather's quantizing and dequantizing)."""

    def __init__(self, t_inter=0.0, t_intra=0.0, t_messages=0.0, link_bytes=0.0, overlaps_wire=False):
        self.t_inter, self.t_intra, self.t_messages, self.link_bytes = t_inter, t_intra, t_messages, link_bytes
        self.overlaps_wire = overlaps_wire
        self.t_after = 0.0  # compute charged to its completion (quantizing and dequantizing)


class Network:
    """Per-collective cost from the bytes its busiest link carries (ring algorithms)."""

    def __init__(self, W, G, intra_bps, inter_bps, latency, backend, framing=1.0, gloo_reduce_scatter="ring"):
        self.W, self.G, self.intra, self.inter, self.latency, self.backend = W, G, intra_bps, inter_bps, latency, backend
        self.framing = framing  # wire bytes per payload byte (TCP/IP headers: 1.07 at MTU 1500)
        self.gloo_reduce_scatter = gloo_reduce_scatter  # fsdp-train --gloo-reduce-scatter

    def _ring(self, groups, M_per_rank_send, messages):
        """Cost of a ring collective that every group of `groups` runs at once (all shard groups,
        or all replica groups, do the same collective together), each member sending
        M_per_rank_send bytes to its neighbour: the busiest host link carries every edge that
        leaves its host, the ranks inside a host share nothing but their own links."""
        n = len(groups[0])
        if n == 1 or M_per_rank_send == 0:
            return Cost()
        host = lambda r: r // self.G  # noqa: E731
        leaving = {}
        for g in groups:
            for i in range(n):
                a, b = g[i], g[(i + 1) % n]
                if host(a) != host(b):
                    leaving[host(a)] = leaving.get(host(a), 0) + 1
        per_host_link = M_per_rank_send * max(leaving.values(), default=0) * self.framing
        # Gloo over TCP: a message's cost is the ranks' CPU time, paid while the socket buffers
        # drain onto the wire (simulate()); NCCL: a ring step's latency, then its transfer.
        return Cost(per_host_link / self.inter, M_per_rank_send / self.intra, messages * self.latency, per_host_link,
                    overlaps_wire=self.backend == "gloo")

    def all_gather(self, groups, M):
        n = len(groups[0])
        return self._ring(groups, M * (n - 1) / n, 2 * (n - 1))

    def all_reduce(self, groups, M):
        n = len(groups[0])
        return self._ring(groups, 2 * M * (n - 1) / n, 2 * (n - 1))

    def reduce_scatter(self, groups, M):
        n = len(groups[0])
        if self.backend == "gloo" and self.gloo_reduce_scatter == "all_reduce":
            return self.all_reduce(groups, M)  # ProcessGroupGloo's: an all-reduce of the whole input
        # NCCL's ring, and fsdp's own over Gloo send/recv: n - 1 messages of M / n.
        return self._ring(groups, M * (n - 1) / n, n - 1)


def groups_of(W, F, tp=1):
    """Every shard group (F consecutive ranks) and every replica group (the ranks at the same
    place in their shard groups; the world without sharding), in fsdp's mesh order. With tensor
    parallelism W is the data-parallel world and every TP place has these groups of its own, in
    world ranks: data-parallel rank p of TP place t is world rank p * tp + t."""
    shard = [list(range(s * F, (s + 1) * F)) for s in range(W // F)]
    replicate = [list(range(p, W, F)) for p in range(F)] if F > 1 else [list(range(W))]
    return world_ranks(shard, tp), world_ranks(replicate, tp)


def world_ranks(groups, tp):
    return [[p * tp + t for p in g] for t in range(tp) for g in groups]


def secondary_groups(W, N, tp=1):
    """hpZ's groups: N consecutive data-parallel ranks (a host's when N = the ranks per host)."""
    return world_ranks([list(range(k * N, (k + 1) * N)) for k in range(W // N)], tp)


def quantized_shard_bytes(shard_numel, block):
    """qwZ: what one rank contributes to a quantized all-gather, P: an fp32 scale per block of
    `block` elements and a byte per element, the record padded to a multiple of 4 bytes so that
    every rank's scales stay aligned (src/comm/quantized_all_gather.h)."""
    return (4 * math.ceil(shard_numel / block) + shard_numel + 3) // 4 * 4

