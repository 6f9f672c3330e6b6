"""fsdp-plan: predict one training step of a GPT-like model under fsdp on a cluster that may not
exist yet: per-rank memory (fsdp-train --plan, the library's own plan), per-host-link traffic and
step time, for any strategy, sharding factor, world size, hosts, link bandwidths and compute.

    scripts/fsdp-plan --model 175b --world 512 --ranks-per-host 8 --strategy full_shard \
        --batch-per-rank 1 --seq 2048 --hardware a100-roce

How the step time is predicted: the schedule the runtime follows, replayed as events. Compute is
one resource (the rank's device or cores), communication two more (a FIFO of the collectives
that cross host links, and one of those that stay inside a host: a hybrid strategy's shard
group works beside its replica group). Forward: each unit's all-gather is issued when the unit is reached
(or one unit ahead with forward prefetch), and its forward waits for it. Backward: with
BACKWARD_PRE prefetch the next unit's all-gather is issued before the current unit's gradient
computation; each unit's reduce-scatter (and, with replicas, the all-reduce of its shard) is
issued when its gradients are ready; the rate limiter keeps at most --limit-all-gathers gathers
in flight; the step ends when the last reduction is done and the optimizer has stepped.
A collective's time: the bytes on its busiest link (ring algorithms; Gloo's reduce-scatter is an
all-reduce of the whole input, NCCL's is a ring reduce-scatter) over that link's bandwidth, plus
a per-message latency. Compute per unit comes from a calibration (per-unit forward and backward
times measured on the target device, as bench/cluster/planner_check measures them) or from FLOPs at a stated
throughput (--tflops, --mfu).
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
}

# Hardware presets: compute throughput (TFLOPS in the compute dtype), the share of it a step
# reaches (MFU), bandwidth per GPU inside a host and per host between hosts (GB/s, each
# direction), per-message latency (s), and the collective library.
HARDWARE = {
    # The paper's: A100 80 GB, 312 TFLOPS bf16, 8 per host, NVLink (300 GB/s per GPU), RoCE 2 Tb/s per host.
    "a100-roce": dict(tflops=312.0, mfu=0.55, intra_gbs=300.0, inter_gbs=250.0, latency=8e-6, backend="nccl", G=8),
}


class Model:
    def __init__(self, name, vocab, seq, layers, heads, d, d_ff, t5=False):
        self.name, self.vocab, self.seq, self.layers, self.heads, self.d, self.d_ff = name, vocab, seq, layers, heads, d, d_ff
        extra = 0.25 if t5 else 0.0  # T5's decoder cross-attention, averaged over its 48 layers
        self.block_params = int((4 * d * d * (1 + extra)) + 2 * d * d_ff + 9 * d + d_ff)
        self.root_params = vocab * d + seq * d + 2 * d
        # Forward FLOPs per token: 2 per weight, plus attention's two T x d products per layer.
        self.block_flops_per_token = 2 * self.block_params + 4 * seq * d
        self.head_flops_per_token = 2 * vocab * d

    def total_params(self):
        return self.root_params + self.layers * self.block_params


def padded(n, F):
    return int(math.ceil(n / F) * F)


class Network:
    """Per-collective time from the bytes its busiest link carries (ring algorithms)."""

    def __init__(self, W, G, intra_bps, inter_bps, latency, backend, framing=1.0):
        self.W, self.G, self.intra, self.inter, self.latency, self.backend = W, G, intra_bps, inter_bps, latency, backend
        self.framing = framing  # wire bytes per payload byte (TCP/IP headers: 1.07 at MTU 1500)

    def _ring(self, groups, M_per_rank_send, messages):
        """Time of a ring collective that every group of `groups` runs at once (all shard groups,
        or all replica groups, do the same collective together), each member sending
        M_per_rank_send bytes to its neighbour: the busiest host link carries every edge that
        leaves its host, the ranks inside a host share nothing but their own links."""
        n = len(groups[0])
        if n == 1 or M_per_rank_send == 0:
            return 0.0, 0.0, 0.0
        host = lambda r: r // self.G  # noqa: E731
        leaving = {}
        for g in groups:
            for i in range(n):
                a, b = g[i], g[(i + 1) % n]
                if host(a) != host(b):
                    leaving[host(a)] = leaving.get(host(a), 0) + 1
        per_host_link = M_per_rank_send * max(leaving.values(), default=0) * self.framing
        t_inter = per_host_link / self.inter
        t_intra = M_per_rank_send / self.intra
        return max(t_inter, t_intra) + messages * self.latency, per_host_link, M_per_rank_send

    def all_gather(self, groups, M):
        n = len(groups[0])
        return self._ring(groups, M * (n - 1) / n, 2 * (n - 1))

    def all_reduce(self, groups, M):
        n = len(groups[0])
        return self._ring(groups, 2 * M * (n - 1) / n, 2 * (n - 1))

    def reduce_scatter(self, groups, M):
        n = len(groups[0])
        if self.backend == "gloo":  # ProcessGroupGloo: an all-reduce of the whole input
            return self.all_reduce(groups, M)
        return self._ring(groups, M * (n - 1) / n, n - 1)


def groups_of(W, F):
    """Every shard group (F consecutive ranks) and every replica group (the ranks at the same
    place in their shard groups; the world without sharding), in fsdp's mesh order."""
    shard = [list(range(s * F, (s + 1) * F)) for s in range(W // F)]
    replicate = [list(range(p, W, F)) for p in range(F)] if F > 1 else [list(range(W))]
    return shard, replicate


def simulate(model, args, compute, net):
    """One step's events for rank 0. Returns a dict of times (s) and per-host-link bytes."""
    W, F, strategy = args.world, args.F, args.strategy
    shard, replicate = groups_of(W, F)
    el_param = args.param_bytes
    el_reduce = args.reduce_bytes
    units = ["root"] + ["block%d" % i for i in range(model.layers)]
    numel = {"root": padded(model.root_params, F)}
    for i in range(model.layers):
        numel["block%d" % i] = padded(model.block_params, F)
    gathers = strategy in ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2") and F > 1
    reshard = strategy in ("full_shard", "hybrid_shard")
    replicas = W // F if F > 1 else W
    link_bytes = 0.0
    # Two FIFOs: collectives that cross host links queue for them; those inside a host (a hybrid
    # strategy's shard group) run beside them, as their process groups' threads do.
    free = {"inter": 0.0, "intra": 0.0}
    in_flight_gathers = []

    def comm(t_issue, duration, bytes_on_link):
        nonlocal link_bytes
        channel = "inter" if bytes_on_link > 0 else "intra"
        start = max(t_issue, free[channel])
        free[channel] = start + duration
        link_bytes += bytes_on_link
        return free[channel]

    t = 0.0
    exposed = 0.0
    ag_done = {}

    def gather(u, t_issue):
        if not gathers or u in ag_done:
            return
        # The rate limiter: at most limit gathers in flight; the issue waits for the oldest.
        if args.limit_all_gathers > 0:
            in_flight_gathers[:] = [x for x in in_flight_gathers if x > t_issue]
            while len(in_flight_gathers) >= args.limit_all_gathers:
                t_issue = max(t_issue, in_flight_gathers.pop(0))
        d, b, _ = net.all_gather(shard, numel[u] * el_param)
        ag_done[u] = comm(t_issue, d, b)
        in_flight_gathers.append(ag_done[u])

    def wait(u):
        nonlocal t, exposed
        if u in ag_done and ag_done[u] > t:
            exposed += ag_done[u] - t
            t = ag_done[u]

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
            gather(u, t)
        if args.backward_prefetch and reshard and k + 1 < len(rev):
            gather(rev[k + 1], t)
        wait(u)
        t += compute["bwd"][u]
        reductions_done = reduce(u, t, numel, shard, replicate, replicas, el_reduce, net, comm, F, strategy)
    reductions_done = reduce("root", t, numel, shard, replicate, replicas, el_reduce, net, comm, F, strategy)
    end_backward = t
    if reductions_done > t:
        exposed += reductions_done - t
        t = reductions_done
    t += compute["optimizer"]
    return {"step_s": t, "backward_end_s": end_backward, "exposed_comm_s": exposed, "link_bytes": link_bytes}


def reduce(u, t, numel, shard, replicate, replicas, el_reduce, net, comm, F, strategy):
    M = numel[u] * el_reduce
    done = t
    if F > 1:
        d, b, _ = net.reduce_scatter(shard, M)
        done = comm(t, d, b)
        if replicas > 1:
            d, b, _ = net.all_reduce(replicate, M / F)
            done = comm(done, d, b)
    else:
        d, b, _ = net.all_reduce(replicate, M)
        done = comm(t, d, b)
    return done


def flops_compute(model, args):
    tokens = args.batch_per_rank * model.seq
    rate = args.tflops * 1e12 * args.mfu
    fwd = {"block%d" % i: model.block_flops_per_token * tokens / rate for i in range(model.layers)}
    bwd = {u: 2 * v for u, v in fwd.items()}
    head = model.head_flops_per_token * tokens / rate
    return {"fwd": fwd, "bwd": bwd, "root_fwd": head, "root_bwd": 2 * head, "optimizer": 0.0}


def calibrated_compute(model, path):
    c = json.load(open(path))
    fwd = {"block%d" % i: c["block_fwd_s"] for i in range(model.layers)}
    bwd = {"block%d" % i: c["block_bwd_s"] for i in range(model.layers)}
    return {"fwd": fwd, "bwd": bwd, "root_fwd": c["root_fwd_s"], "root_bwd": c["root_bwd_s"], "optimizer": c["other_s"]}


def memory_plan(args):
    """The library's own per-rank plan (fsdp-train --plan), its peak row, for presets it knows."""
    exe = os.path.join(ROOT, "build", "bin", "fsdp-train")
    if args.model not in ("tiny", "small", "default", "medium", "1b", "175b") or not os.path.exists(exe):
        return None
    cmd = [exe, "--plan", "--model", args.model, "--world-size", str(args.world), "--ranks-per-node", str(args.ranks_per_host),
           "--strategy", args.strategy, "--global-batch-size", str(args.batch_per_rank * args.world)]
    if args.strategy.startswith("hybrid"):
        cmd += ["--shard-size", str(args.F)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("| **peak"):
            cells = [c.strip(" *") for c in line.split("|")[2:-1]]
            return {"fp32": cells[0], "bf16": cells[1]}
    return None


def plan(args):
    v, seq, L, heads, d, dff = MODELS[args.model]
    if args.seq:
        seq = args.seq
    model = Model(args.model, v, seq, L, heads, d, dff, t5=args.model.startswith("t5"))
    if args.strategy in ("full_shard", "shard_grad_op"):
        args.F = args.world
    elif args.strategy == "no_shard":
        args.F = 1
    else:
        args.F = args.shard_size or args.ranks_per_host
    net = Network(args.world, args.ranks_per_host, args.intra_gbs * 1e9, args.inter_gbs * 1e9, args.latency, args.backend,
                  args.framing)
    compute = calibrated_compute(model, args.calibration) if args.calibration else flops_compute(model, args)
    r = simulate(model, args, compute, net)
    tokens = args.batch_per_rank * model.seq
    flops = (3 * (model.layers * model.block_flops_per_token + model.head_flops_per_token)) * tokens
    r.update({"model": args.model, "params": model.total_params(), "world": args.world, "F": args.F,
              "strategy": args.strategy, "tflops_per_rank": flops / r["step_s"] / 1e12,
              "memory_plan": memory_plan(args) if args.memory else None})
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
    ap.add_argument("--calibration", help="per-unit compute times measured on the device (JSON)")
    ap.add_argument("--memory", action="store_true", help="add the library's memory plan (fsdp-train --plan)")
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
