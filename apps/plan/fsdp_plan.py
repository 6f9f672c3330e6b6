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
import sys

# The planner's parts, one concept each (apps/plan/plan_*.py); their names stay importable from
# here (bench/cluster/planner_check.py and traffic_model.py import fsdp_plan).
from plan_compute import calibrated_compute, flops_compute, tp_all_reduce_s  # noqa: F401
from plan_memory import (GIB, PLANNED_PRESETS, ROOT, issue26_flags, library_plan, memory_plan,  # noqa: F401
                         parse_bytes, python_plan)
from plan_model import MODELS, Model, padded  # noqa: F401
from plan_network import (Cost, Network, groups_of, quantized_shard_bytes, secondary_groups,  # noqa: F401
                          world_ranks)
from plan_schedule import GLOO_THREADS_PER_GROUP, Link, simulate  # noqa: F401

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


def check_issue26(args):
    """fsdp-train's rules for hpZ, so the planner refuses what the library would."""
    N = args.reshard_after_forward_to
    if N and args.strategy not in ("full_shard", "hybrid_shard"):
        raise SystemExit("fsdp-plan: --reshard-after-forward-to needs a strategy that reshards after forward "
                         "(full_shard, hybrid_shard), not %s" % args.strategy)
    if N and (args.F % N or N >= args.F):
        raise SystemExit("fsdp-plan: --reshard-after-forward-to %d must divide F = %d and be less than it" % (N, args.F))


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