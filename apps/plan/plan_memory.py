"""fsdp-plan's per-rank memory: the library's own plan (fsdp-train --plan) where it is built, else
src/plan/memory_plan.cpp written out again, with issue 26's hpZ shards and gather staging."""

import os
import subprocess

from plan_model import padded
from plan_network import quantized_shard_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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

