"""fsdp-plan: predict one training step of a GPT-like model under fsdp on a cluster that may not
exist yet: per-rank memory (fsdp-train --plan, the library's own plan), per-host-link traffic and
step time, for any strategy, sharding factor, world size, hosts, link bandwidths and compute.

    scripts/fsdp-plan --model 175b --world 512 --ranks-per-host 8 --strategy full_shard \
        --batch-per-rank 1 --seq 2048 --hardware a100-roce

How the step time is predicted: the schedule the runtime follows, replayed as events. Compute is
one resource (the rank's device or cores); each process group's collectives run on that group's
workers (NCCL: one, a communicator's collectives in issue order; Gloo: its two threads per group,
and fsdp's ring reduce-scatter on an executor thread of its own), and the host link is one more
resource, busy only while bytes cross it, which the collectives running at once share. Forward:
each unit's all-gather is issued when the unit is reached (or one unit ahead with forward
prefetch), and its forward waits for it. Backward: with BACKWARD_PRE prefetch the next unit's
all-gather is issued before the current unit's gradient computation; each unit's reduce-scatter
(and, with replicas, the all-reduce of its shard) is issued when its gradients are ready; the rate
limiter keeps at most --limit-all-gathers gathers in flight; the step ends when the last reduction
is done and the optimizer has stepped.
A collective's cost: the bytes on its busiest link (ring algorithms; Gloo's reduce-scatter is
fsdp's own ring by default, as NCCL's, or with --gloo-reduce-scatter all_reduce ProcessGroupGloo's
all-reduce of the whole input) over that link's bandwidth, and a per-message cost (--latency). On
NCCL the latency of each ring step comes before its transfer, so they add up. On Gloo over TCP the
per-message cost is the ranks' CPU time (wake-ups, copies, the TCP stack), which runs while the
kernel drains the sockets' buffers onto the wire: a collective takes the longer of the two, not
their sum (on the emulated cluster a 10x slower link lengthened full_shard's step by a fifth of
the wire time it added; see simulate()). Compute per unit comes from a calibration (per-unit
forward and backward times measured on the target device, as bench/cluster/planner_check measures
them) or from FLOPs at a stated throughput (--tflops, --mfu).

Issue 26's options, as fsdp-train has them: --reshard-after-forward-to N (--hpz: N = ranks per
host) keeps a secondary shard of each non-root unit after forward, so backward's all-gathers run
over N consecutive ranks (inside a host when N divides the ranks per host) in the compute dtype;
--quantize-all-gather int8|fp8 gathers each rank's shard as a byte per element plus an fp32 scale
per --quantize-block elements (forward's gathers, and backward's without hpZ), about a quarter
of fp32's bytes or half of bf16's. --quantize-s-per-element charges the (de)quantization's
compute (default 0: nothing measured yet).

Issue 27's tensor parallelism, as fsdp-train --tp has it: --tp N splits each block's q/k/v and
first MLP layer by heads and features (column-parallel) and its two output projections by input
features (row-parallel), and the vocabulary (embedding and tied head) by rows, over N consecutive
ranks of a host; fsdp then shards each TP rank's parts over its W / N data-parallel ranks (world
ranks t, t + N, ...: across hosts when N is the ranks per host). What changes: each rank's units
hold its parts (the split layers' weights / N, norms, row-parallel biases and the position
embedding whole); its compute is the block's / N; and each block's forward adds two blocking
all-reduces of the activations [tokens, d] inside the host (backward two more, activation
checkpointing's recomputation two more again), charged as compute time over --intra-gbs (ring,
2 (N - 1) / N of the bytes, each of 2 (N - 1) messages at --latency). Without
--sequence-parallel the activations outside the split layers are whole on every TP rank; with it
(fsdp-train --sequence-parallel, Megatron-SP) they are each rank's 1 / N chunk of the sequence
(the checkpointed block inputs among them), the split layers' gathered inputs whole, and each
all-reduce becomes a reduce-scatter and an all-gather of the same bytes. --batch-per-rank is then
per data-parallel rank (its TP ranks share the batch).
"""

import argparse
import json
import math
import subprocess
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# {name: (vocab, seq, layers, heads, d_model, d_ff)}: the GPT presets of models/gpt.cpp (d_ff = 4 d),
# and T5-11B's shape (24 + 24 layers, d_model 1024, d_ff 65536, 128 heads of 128) as a stack of
# 48 equal layers for the planner (its cross-attention adds a quarter to the decoder's layers).
MODELS = {
    "tiny": (256, 32, 2, 2, 32, 128),
    "small": (256, 64, 2, 4, 64, 256),
    "default": (256, 128, 4, 4, 256, 1024),
    "medium": (256, 256, 8, 8, 512, 2048),
    "1b": (50000, 2048, 24, 16, 1792, 7168),
    "175b": (50000, 2048, 96, 96, 12288, 49152),
    "t5-11b": (32128, 512, 48, 128, 1024, 65536),
    # A GPT of Llama 3 70B's width, depth, heads and vocabulary, with a GPT MLP (d_ff = 4 d, two
    # matrices; Llama's SwiGLU has three of 28672): 65.5 B parameters, for issue 27's comparison
    # with torchtitan's Llama 3.1 70B at FSDP 32 x TP 8.
    "70b": (128256, 8192, 80, 64, 8192, 32768),
}

# Hardware presets: compute throughput (TFLOPS in the compute dtype), the share of it a step
# reaches (MFU), bandwidth per GPU inside a host and per host between hosts (GB/s, each
# direction), per-message latency (s), and the collective library.
HARDWARE = {
    # The paper's: A100 80 GB, 312 TFLOPS bf16, 8 per host, NVLink (300 GB/s per GPU), RoCE 2 Tb/s per host.
    "a100-roce": dict(tflops=312.0, mfu=0.55, intra_gbs=300.0, inter_gbs=250.0, latency=8e-6, backend="nccl", G=8),
    # torchtitan's benchmark hosts (Grand Teton): H100 SXM at 500 W, 989 TFLOPS dense bf16, 8 per
    # host, NVLink 4 (450 GB/s per GPU each direction), 400 Gb/s RDMA per GPU (400 GB/s per host).
    # MFU 0.40: torchtitan's measured 33-39 % for 1-D Llama 3.1 8B in bf16 (its 70B run adds
    # Float8, which this preset does not model).
    "h100-grand-teton": dict(tflops=989.0, mfu=0.40, intra_gbs=450.0, inter_gbs=400.0, latency=8e-6, backend="nccl", G=8),
}


class Model:
    def __init__(self, name, vocab, seq, layers, heads, d, d_ff, t5=False, tp=1):
        self.name, self.vocab, self.seq, self.layers, self.heads, self.d, self.d_ff = name, vocab, seq, layers, heads, d, d_ff
        self.tp = tp
        extra = 0.25 if t5 else 0.0  # T5's decoder cross-attention, averaged over its 48 layers
        self.block_params = int((4 * d * d * (1 + extra)) + 2 * d * d_ff + 9 * d + d_ff)
        self.root_params = vocab * d + seq * d + 2 * d
        # Forward FLOPs per token: 2 per weight, plus attention's two T x d products per layer.
        self.block_flops_per_token = 2 * self.block_params + 4 * seq * d
        self.head_flops_per_token = 2 * vocab * d
        # One TP rank's parts (models::gpt_tensor_parallel_plan): split weights and the column-parallel
        # biases (q/k/v 3 d, fc d_ff) / tp; LayerNorms (4 d) and row-parallel biases (2 d) whole.
        split = int(4 * d * d * (1 + extra)) + 2 * d * d_ff + 3 * d + d_ff
        self.block_params_local = split // tp + (self.block_params - split)
        self.root_params_local = vocab * d // tp + seq * d + 2 * d

    def total_params(self):
        return self.root_params + self.layers * self.block_params


def padded(n, F):
    return int(math.ceil(n / F) * F)


# Gloo process groups run this many collectives at once (src/comm/mesh_state.h, kGlooThreadsPerGroup).
GLOO_THREADS_PER_GROUP = 2


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


def check_issue26(args):
    """fsdp-train's rules for hpZ, so the planner refuses what the library would."""
    N = args.reshard_after_forward_to
    if N and args.strategy not in ("full_shard", "hybrid_shard"):
        raise SystemExit("fsdp-plan: --reshard-after-forward-to needs a strategy that reshards after forward "
                         "(full_shard, hybrid_shard), not %s" % args.strategy)
    if N and (args.F % N or N >= args.F):
        raise SystemExit("fsdp-plan: --reshard-after-forward-to %d must divide F = %d and be less than it" % (N, args.F))


class Link:
    """A host link's time on the wire: when its busiest direction carries bytes. The links are full
    duplex and every ring loads a host's two directions alike (what its edges send out of the host
    equals what its other edges bring in), so one calendar per link stands for both directions.

    The link is busy only while bytes cross it. A collective's transfer is placed in the link's idle
    time from when it is ready, around the transfers placed before it (the bytes of collectives that
    run at once, on different threads, interleave on the wire), so the link's busy time is the sum
    of every transfer's bytes over its rate, whatever else each collective waits for."""

    def __init__(self):
        self.busy = []  # sorted, disjoint (start, end)

    def transfer(self, ready, duration):
        """Carries `duration` seconds of bytes from `ready` on, in the gaps between what is there;
        returns when the last byte has crossed."""
        if duration <= 0:
            return ready
        t, left, placed = ready, duration, []
        for a, b in self.busy:
            if b <= t:
                continue
            if a > t:
                take = min(a - t, left)
                placed.append((t, t + take))
                left -= take
                t += take
                if left <= 0:
                    break
            t = max(t, b)
        if left > 0:
            placed.append((t, t + left))
            t += left
        merged = []
        for a, b in sorted(self.busy + placed):
            if merged and a <= merged[-1][1] + 1e-15:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.busy = merged
        return t


def simulate(model, args, compute, net):
    """One step's events for rank 0. Returns a dict of times (s) and per-host-link bytes.

    Where a collective runs, as the runtime runs it. Each process group has its workers: NCCL runs
    one communicator's collectives one after another (one worker per group: an all-gather waits
    behind the reduce-scatter issued before it, which is why the paper prefetches in backward); ProcessGroupGloo runs up to
    kGlooThreadsPerGroup = 2 of a group's collectives at once, each on its own thread
    (src/comm/mesh_state.h), and fsdp's ring reduce-scatter runs on its own executor thread, one per
    Gloo group, one job after another (src/comm/ring_reduce_scatter.h). A collective starts when it
    is issued and a worker of its group is free. What it sends across hosts goes through the host
    link (Link): collectives running at once share the wire, each link's busy time being the sum
    of their bytes. A collective is done when its last byte has crossed and its per-message costs
    are paid (Cost.overlaps_wire: with Gloo over TCP these are the ranks' CPU time, which runs
    while the kernel drains the sockets' buffers onto the wire, so they overlap the wire time; with
    NCCL each ring step's latency comes before the step's transfer).

    Until issue 26's check the planner queued every collective that crossed a host link in one
    FIFO, each holding it for its wire time plus its per-message costs. On Gloo that serialized
    what the runtime runs at once. The per-message cost is CPU time, not wire time: full_shard at
    2 x 2 measured 76 ms a step at 1 Gbit/s and 92 ms at 100 Mbit/s, where its 1095 KB per host
    link take 87.6 ms on the wire alone, so the step is the wire time and the 39 messages' costs
    (35 ms in the FIFO with that day's calibration, 0.9 ms a message) hide under it, even in
    forward, where each gather runs alone. Adding them put the planner 27-43 % over every
    full_shard configuration at 100 Mbit/s; at 20 Mbit/s, with wire times 5x longer, they were a
    small error. Where a gather's bytes are few (int8 records: 41 KB per host link for a block,
    3.3 ms at 100 Mbit/s), its 6 messages' CPU cost is the longer of the two and sets its time.
    The threads matter less at this scale (a reduce-scatter's bytes can go under the next gather's
    per-message costs) but are what the runtime does."""
    W, F, strategy = args.world // args.tp, args.F, args.strategy  # fsdp's world: the data-parallel ranks
    shard, replicate = groups_of(W, F, args.tp)
    el_param = args.param_bytes
    el_reduce = args.reduce_bytes
    units = ["root"] + ["block%d" % i for i in range(model.layers)]
    numel = {"root": padded(model.root_params_local, F)}
    for i in range(model.layers):
        numel["block%d" % i] = padded(model.block_params_local, F)
    gathers = strategy in ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2") and F > 1
    reshard = strategy in ("full_shard", "hybrid_shard")
    replicas = W // F if F > 1 else W
    N = args.reshard_after_forward_to
    secondary = secondary_groups(W, N, args.tp) if N else None
    quantized = args.quantize_all_gather != "none"
    gloo = net.backend == "gloo"
    link_bytes = 0.0
    link = Link()
    # Each group's workers: when each is next free. The ring reduce-scatter's executor ("ring") is
    # a worker of its own beside the shard group's Gloo threads.
    per_group = GLOO_THREADS_PER_GROUP if gloo else 1
    workers = {"shard": [0.0] * per_group, "replicate": [0.0] * per_group, "secondary": [0.0] * per_group,
               "ring": [0.0]}
    in_flight_gathers = []

    def comm(t_issue, cost, group):
        """Runs collective `cost` (Network's) issued at t_issue on `group`'s next free worker;
        returns when it is done."""
        nonlocal link_bytes
        free = workers[group]
        i = min(range(len(free)), key=free.__getitem__)
        start = max(t_issue, free[i])
        if cost.overlaps_wire:
            # The CPU's per-message work beside the wire: done when both are.
            wire_done = link.transfer(start, cost.t_inter)
            done = max(wire_done, start + max(cost.t_intra, cost.t_messages))
        else:
            # Each ring step's latency, then its transfer: the link idles through the latencies,
            # which other groups' transfers may use.
            wire_done = link.transfer(start + cost.t_messages, cost.t_inter)
            done = max(wire_done, start + cost.t_messages + cost.t_intra)
        done += cost.t_after
        free[i] = done
        link_bytes += cost.link_bytes
        return done

    t = 0.0
    exposed = 0.0
    ag_done = {}

    def gather(u, t_issue, backward=False):
        if not gathers or u in ag_done:
            return
        # The rate limiter: at most limit gathers in flight; the issue waits for the oldest.
        if args.limit_all_gathers > 0:
            in_flight_gathers[:] = [x for x in in_flight_gathers if x > t_issue]
            while len(in_flight_gathers) >= args.limit_all_gathers:
                t_issue = max(t_issue, in_flight_gathers.pop(0))
        if backward and N:
            # hpZ: from the secondary shards, over N ranks, in the compute dtype.
            cost, group = net.all_gather(secondary, numel[u] * el_param), "secondary"
        elif quantized:
            # qwZ: each rank's P bytes gathered into F P; quantizing the shard and dequantizing
            # the whole unit delay the gather's completion (charged as part of it).
            cost, group = net.all_gather(shard, F * quantized_shard_bytes(numel[u] // F, args.quantize_block)), "shard"
            cost.t_after = (numel[u] // F + numel[u]) * args.quantize_s_per_element
        else:
            cost, group = net.all_gather(shard, numel[u] * el_param), "shard"
        ag_done[u] = comm(t_issue, cost, group)
        in_flight_gathers.append(ag_done[u])

    def wait(u):
        nonlocal t, exposed
        if u in ag_done and ag_done[u] > t:
            exposed += ag_done[u] - t
            t = ag_done[u]

    def reduce(u, t):
        M = numel[u] * el_reduce
        if F == 1:
            return comm(t, net.all_reduce(replicate, M), "replicate")
        ring = gloo and net.gloo_reduce_scatter == "ring"
        done = comm(t, net.reduce_scatter(shard, M), "ring" if ring else "shard")
        if replicas > 1:
            done = comm(done, net.all_reduce(replicate, M / F), "replicate")
        return done

    # Forward: the root (embeddings) first, then the blocks, then the head (root again).
    order = units[1:]
    gather("root", t)
    wait("root")
    t += compute["root_fwd"]
    for k, u in enumerate(order):
        gather(u, t)
        if args.forward_prefetch and k + 1 < len(order):
            gather(order[k + 1], t)
        wait(u)
        t += compute["fwd"][u]
        if reshard:
            ag_done.pop(u, None)
    # Backward: the head (root) first, then the blocks in reverse.
    t += compute["root_bwd"]
    reductions_done = 0.0
    rev = list(reversed(order))
    for k, u in enumerate(rev):
        if reshard:
            gather(u, t, backward=True)
        if args.backward_prefetch and reshard and k + 1 < len(rev):
            gather(rev[k + 1], t, backward=True)
        wait(u)
        t += compute["bwd"][u]
        reductions_done = max(reductions_done, reduce(u, t))
    reductions_done = max(reductions_done, reduce("root", t))
    end_backward = t
    if reductions_done > t:
        exposed += reductions_done - t
        t = reductions_done
    t += compute["optimizer"]
    return {"step_s": t, "backward_end_s": end_backward, "exposed_comm_s": exposed, "link_bytes": link_bytes}


def tp_all_reduce_s(model, args):
    """One TP all-reduce of a block's activations [tokens, d] in the compute dtype inside the host
    (ring over --tp ranks at --intra-gbs, 2 (tp - 1) messages at --latency); 0 without TP."""
    tp = args.tp
    if tp == 1:
        return 0.0
    M = args.batch_per_rank * model.seq * model.d * args.param_bytes
    return 2 * M * (tp - 1) / tp / (args.intra_gbs * 1e9) + 2 * (tp - 1) * args.latency


def flops_compute(model, args):
    tokens = args.batch_per_rank * model.seq
    rate = args.tflops * 1e12 * args.mfu
    # A TP rank computes 1 / tp of every block and of the head (heads and features split), and
    # waits for two all-reduces per block in forward and two in backward.
    ar = tp_all_reduce_s(model, args)
    block = model.block_flops_per_token * tokens / rate / model.tp
    fwd = {"block%d" % i: block + 2 * ar for i in range(model.layers)}
    bwd = {"block%d" % i: 2 * block + 2 * ar for i in range(model.layers)}
    head = model.head_flops_per_token * tokens / rate / model.tp
    return {"fwd": fwd, "bwd": bwd, "root_fwd": head, "root_bwd": 2 * head, "optimizer": 0.0}


def calibrated_compute(model, path, args=None):
    """Per-unit times measured on the device. With --tp, a TP rank's share of a unit for its
    data-parallel rank's batch is the calibration's unit for batch_per_rank / tp sequences (the
    calibration's "batch_per_rank", when it names one, scales it), and each block waits for its
    TP all-reduces besides (tp_all_reduce_s, two in forward and two in backward)."""
    c = json.load(open(path))
    scale, ar = 1.0, 0.0
    if args is not None and args.tp > 1:
        work = args.batch_per_rank / args.tp
        scale = work / c.get("batch_per_rank", work)
        ar = tp_all_reduce_s(model, args)
    fwd = {"block%d" % i: c["block_fwd_s"] * scale + 2 * ar for i in range(model.layers)}
    bwd = {"block%d" % i: c["block_bwd_s"] * scale + 2 * ar for i in range(model.layers)}
    return {"fwd": fwd, "bwd": bwd, "root_fwd": c["root_fwd_s"] * scale, "root_bwd": c["root_bwd_s"] * scale,
            "optimizer": c["other_s"]}


GIB = 1024.0 ** 3
# fsdp-train's GPT presets (models/gpt.cpp) that --plan builds.
PLANNED_PRESETS = ("tiny", "small", "default", "medium", "1b", "175b")


def parse_bytes(cell):
    """'34.47 GiB' / '12.3 MiB' / '5.0 KiB' (format_bytes in src/plan/memory_plan.cpp) -> bytes."""
    value, unit = cell.split()
    return float(value) * {"GiB": GIB, "MiB": 1024.0 ** 2, "KiB": 1024.0}[unit]


def issue26_flags(args):
    """fsdp-train's flags for issue 26's options, as this plan has them."""
    out = ["--quantize-all-gather", args.quantize_all_gather, "--quantize-block", str(args.quantize_block)]
    if args.reshard_after_forward_to:
        out += ["--reshard-after-forward-to", str(args.reshard_after_forward_to)]
    return out


def library_plan(args):
    """The library's own per-rank plan (fsdp-train --plan) for the presets it knows: its peak and
    the rows issue 26 adds, in bytes (fp32 and bf16 columns). None where fsdp-train is not built or
    predates the options."""
    exe = os.path.join(ROOT, "build", "bin", "fsdp-train")
    if args.model not in PLANNED_PRESETS or not os.path.exists(exe) or args.tp > 1:
        return None
    cmd = [exe, "--plan", "--model", args.model, "--world-size", str(args.world), "--ranks-per-node", str(args.ranks_per_host),
           "--strategy", args.strategy, "--global-batch-size", str(args.batch_per_rank * args.world)] + issue26_flags(args)
    if args.strategy.startswith("hybrid"):
        cmd += ["--shard-size", str(args.F)]
    if args.activation_checkpointing:
        cmd.append("--activation-checkpointing")
    p = subprocess.run(cmd, capture_output=True, text=True)
    out = {"fp32": {"secondary_shards": 0.0, "gather_staging": 0.0}, "bf16": {"secondary_shards": 0.0, "gather_staging": 0.0}}
    rows = {"| **peak": "peak", "|   of which hpZ secondary shards": "secondary_shards",
            "| all-gather staging copies in flight": "gather_staging"}
    found = False
    for line in p.stdout.splitlines():
        for start, key in rows.items():
            if line.startswith(start):
                cells = [c.strip(" *") for c in line.split("|")[2:-1]]
                out["fp32"][key], out["bf16"][key] = parse_bytes(cells[0]), parse_bytes(cells[1])
                found = found or key == "peak"
    return out if found else None


def python_plan(model, args, compute_bytes, with_activations=True):
    """src/plan/memory_plan.cpp's plan_memory and backward_peak for a GPT preset, written out again
    (for when fsdp-train is not built): fp32 master, parameters and gradients in the compute dtype
    (4: fp32; 2: bf16 mixed precision, reduced in bf16), activations of --batch-per-rank sequences
    (models/gpt.cpp's activation_bytes: fused attention, no dropout; --activation-checkpointing).
    Returns {"peak", "secondary_shards", "gather_staging"} in bytes.

    Issue 26 as the library plans it: hpZ's secondary shards (every non-root unit's padded / N in
    the compute dtype) all held when backward starts, so counted with the gathered parameters; a
    quantized gather in flight (backward's, without hpZ) holds on Gloo its records and their
    staging copy, 2 F P, instead of a staging copy of the unit. On NCCL, where the library counts
    no staging, the planner adds the gathered records, F P: NCCL gathers into them, not into the
    unit's buffer."""
    W, F, tp = args.world // args.tp, args.F, args.tp
    N = args.reshard_after_forward_to
    root, block = padded(model.root_params_local, F), padded(model.block_params_local, F)
    units = [root] + [block] * model.layers
    shard = sum(u // F for u in units)
    state = shard * 4 + shard * 4 + 2 * shard * 4   # parameters, gradients (fp32 master) and Adam's two moments
    gathered = lambda u: u * compute_bytes if (F > 1 or compute_bytes != 4) else 0  # noqa: E731
    prefetch = 1 if args.backward_prefetch else 0   # fsdp-train's --prefetch-count 1
    cpu = args.backend == "gloo"
    quantized_backward = args.quantize_all_gather != "none" and not N and F > 1
    records = F * quantized_shard_bytes(block // F, args.quantize_block)
    secondary = model.layers * (block // N) * compute_bytes if N else 0
    if args.strategy in ("full_shard", "hybrid_shard"):
        held = 1 + prefetch + (1 if args.forward_prefetch else 0)
        nonroot = [gathered(block)] * model.layers
        peak_unsharded = gathered(root) + sum(nonroot[:held]) + secondary
        head_unsharded = gathered(root) + sum(nonroot[:prefetch]) + secondary
        if cpu:  # Gloo gathers into a flat copy of its output (of the records, when quantized)
            staging = prefetch * (2 * records if quantized_backward else gathered(block))
        else:
            staging = prefetch * records if quantized_backward else 0
    else:
        peak_unsharded = head_unsharded = sum(gathered(u) for u in units)
        staging = 0
    tokens, d, T = args.batch_per_rank * model.seq, model.d, model.seq
    head_act = (tokens * d + 3 * tokens * model.vocab) * compute_bytes
    if tp > 1:  # vocabulary-parallel: this rank's classes, two fp32 arrays and a half one (models/gpt.cpp)
        head_act = tokens * d * compute_bytes + tokens * (model.vocab // tp) * (8 + (0 if compute_bytes == 4 else compute_bytes))
    # Split under TP: qkv's, the attention's, fc's and gelu's outputs (12 of the 16 per token).
    # Sequence parallelism (models/gpt.cpp's activation_bytes): ln1's and ln2's outputs kept as the
    # split layers' gathered inputs (whole), h and the block's output as chunks.
    chunk = tp if tp > 1 and args.sequence_parallel else 1
    whole = 4 * tokens * d if chunk == 1 else 2 * tokens * d + 2 * tokens * d // chunk
    staging = tokens * d if chunk > 1 else 0  # a gathered gradient's staging buffer in backward, one at a time
    per_block = whole + 12 * tokens * d // tp + args.batch_per_rank * (model.heads // tp) * T * 4 // compute_bytes
    if args.activation_checkpointing:  # each block keeps its input; one block's again while recomputed
        activations = ((model.layers + 1) * tokens * d // chunk + per_block + staging) * compute_bytes + head_act
    else:
        activations = (model.layers * per_block + tokens * d // chunk + staging) * compute_bytes + head_act
    if not with_activations:
        activations = head_act = 0
    unit_grads, reduce_buffer = block * compute_bytes, block * compute_bytes
    if root > block:
        unit_grads, reduce_buffer = root * compute_bytes, root * compute_bytes
    root_grads = model.root_params_local * compute_bytes
    in_flight_max = 2 if F > 1 else 0                 # kMaxReductionsInFlight
    replica_buffer = max(units) // F * compute_bytes if F > 1 and W // F > 1 else 0
    n = max(1, model.layers)
    spread = activations - min(head_act, activations)
    peak = head_unsharded + activations + root_grads
    for j in range(n):
        in_flight = min(j, in_flight_max) * (reduce_buffer + replica_buffer)
        during = spread * (n - j) // n + root_grads + unit_grads + in_flight
        after = spread * (n - j - 1) // n + root_grads + unit_grads + reduce_buffer + in_flight
        peak = max(peak, peak_unsharded + staging + during, peak_unsharded + staging + after)
    return {"peak": state + peak, "secondary_shards": secondary, "gather_staging": staging}


def memory_plan(model, args):
    """Per-rank peak, fp32 and bf16 columns as fsdp-train --plan prints them (GiB), with issue 26's
    hpZ secondary shards and gather staging (quantized records when quantized) among it: the
    library's plan where fsdp-train is built, else its transcription above."""
    if model.name not in PLANNED_PRESETS and model.name != "70b":
        return None
    plans = library_plan(args)
    source = "fsdp-train --plan"
    if plans is None:
        plans = {"fp32": python_plan(model, args, 4), "bf16": python_plan(model, args, 2)}
        source = "src/plan/memory_plan.cpp written out in fsdp_plan.py (fsdp-train not built)"
    out = {"source": source}
    for dt in ("fp32", "bf16"):
        out[dt] = {"peak_gib": plans[dt]["peak"] / GIB, "secondary_shards_gib": plans[dt]["secondary_shards"] / GIB,
                   "gather_staging_gib": plans[dt]["gather_staging"] / GIB}
    return out


def plan(args):
    v, seq, L, heads, d, dff = MODELS[args.model]
    if args.seq:
        seq = args.seq
    tp = args.tp
    if tp < 1 or args.world % tp or (args.world > args.ranks_per_host and args.ranks_per_host % tp) or heads % tp \
            or v % tp:
        raise SystemExit("fsdp-plan: --tp %d must divide the world (%d), the ranks per host (%d), the heads (%d) and the "
                         "vocabulary (%d)" % (tp, args.world, args.ranks_per_host, heads, v))
    model = Model(args.model, v, seq, L, heads, d, dff, t5=args.model.startswith("t5"), tp=tp)
    if args.strategy in ("full_shard", "shard_grad_op"):
        args.F = args.world // tp
    elif args.strategy == "no_shard":
        args.F = 1
    else:
        args.F = args.shard_size or max(1, args.ranks_per_host // tp)
    if args.hpz:
        args.reshard_after_forward_to = max(1, args.ranks_per_host // tp)
    check_issue26(args)
    net = Network(args.world, args.ranks_per_host, args.intra_gbs * 1e9, args.inter_gbs * 1e9, args.latency, args.backend,
                  args.framing, args.gloo_reduce_scatter)
    compute = calibrated_compute(model, args.calibration, args) if args.calibration else flops_compute(model, args)
    if args.activation_checkpointing:  # backward recomputes each block's forward first
        compute["bwd"] = {u: b + compute["fwd"][u] for u, b in compute["bwd"].items()}
    r = simulate(model, args, compute, net)
    tokens = args.batch_per_rank * model.seq
    flops = (3 * (model.layers * model.block_flops_per_token + model.head_flops_per_token)) * tokens
    flops /= tp  # each TP rank computes its share of its data-parallel rank's batch
    r.update({"model": args.model, "params": model.total_params(), "world": args.world, "F": args.F, "tp": tp,
              "strategy": args.strategy, "tflops_per_rank": flops / r["step_s"] / 1e12,
              "tokens_per_s_per_gpu": tokens / tp / r["step_s"], "tp_all_reduce_s": tp_all_reduce_s(model, args),
              "gloo_reduce_scatter": args.gloo_reduce_scatter if args.backend == "gloo" else None,
              "reshard_after_forward_to": args.reshard_after_forward_to, "quantize_all_gather": args.quantize_all_gather,
              "memory_plan": memory_plan(model, args) if args.memory else None})
    return r


def parser():
    ap = argparse.ArgumentParser(prog="fsdp-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", choices=sorted(MODELS))
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: the model's)")
    ap.add_argument("--batch-per-rank", type=int, default=1)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--ranks-per-host", type=int, default=8)
    ap.add_argument("--strategy", default="full_shard",
                    choices=["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"])
    ap.add_argument("--shard-size", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1, help="tensor parallelism inside a host (fsdp-train --tp)")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="with --tp: sequence parallelism (fsdp-train --sequence-parallel): the activations between "
                         "the split layers are each TP rank's chunk of the sequence")
    ap.add_argument("--hardware", choices=sorted(HARDWARE), help="a preset for the rates below")
    ap.add_argument("--tflops", type=float, default=1.0, help="compute throughput per rank, TFLOPS")
    ap.add_argument("--mfu", type=float, default=1.0, help="the share of --tflops a step's compute reaches")
    ap.add_argument("--intra-gbs", type=float, default=10.0, help="GB/s per rank inside a host")
    ap.add_argument("--inter-gbs", type=float, default=1.0, help="GB/s per host link, each direction")
    ap.add_argument("--latency", type=float, default=20e-6, help="seconds per message")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--framing", type=float, default=1.0, help="wire bytes per payload byte (1.07: TCP at MTU 1500)")
    ap.add_argument("--param-bytes", type=int, default=2, help="bytes per element gathered (2: bf16)")
    ap.add_argument("--reduce-bytes", type=int, default=2, help="bytes per element reduced")
    ap.add_argument("--no-backward-prefetch", dest="backward_prefetch", action="store_false")
    ap.add_argument("--forward-prefetch", action="store_true")
    ap.add_argument("--limit-all-gathers", type=int, default=2)
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="every block recomputed in backward (its forward's compute again; fsdp-train's activations)")
    ap.add_argument("--calibration", help="per-unit compute times measured on the device (JSON)")
    ap.add_argument("--memory", action="store_true",
                    help="add the per-rank memory plan (fsdp-train --plan's, and issue 26's additions)")
    # Issue 26, as fsdp-train has them.
    ap.add_argument("--gloo-reduce-scatter", default="ring", choices=["ring", "all_reduce"],
                    help="gloo: fsdp's ring reduce-scatter ((n-1)/n M per rank) or ProcessGroupGloo's all-reduce (twice)")
    ap.add_argument("--reshard-after-forward-to", type=int, default=0, metavar="N",
                    help="hpZ: keep a secondary shard over N consecutive ranks; backward gathers over them (0: off)")
    ap.add_argument("--hpz", action="store_true", help="--reshard-after-forward-to the ranks per host")
    ap.add_argument("--quantize-all-gather", default="none", choices=["none", "int8", "fp8"],
                    help="qwZ: parameter all-gathers as a byte per element and an fp32 scale per block")
    ap.add_argument("--quantize-block", type=int, default=64, help="elements per quantization scale")
    ap.add_argument("--quantize-s-per-element", type=float, default=0.0,
                    help="seconds to quantize or dequantize one element (default 0: not measured)")
    return ap


def apply_hardware(args):
    if args.hardware:
        h = HARDWARE[args.hardware]
        args.tflops, args.mfu, args.intra_gbs, args.inter_gbs = h["tflops"], h["mfu"], h["intra_gbs"], h["inter_gbs"]
        args.latency, args.backend = h["latency"], h["backend"]
    return args


def main(argv=None):
    args = apply_hardware(parser().parse_args(argv))
    print(json.dumps(plan(args), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
