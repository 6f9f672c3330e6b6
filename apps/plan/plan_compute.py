"""fsdp-plan's compute per unit: from FLOPs at a stated throughput or from a calibration measured
on the device, with tensor parallelism's all-reduces charged to each block."""

import json


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

