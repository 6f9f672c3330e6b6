"""The planner (apps/plan/fsdp_plan.py) against the emulated cluster, then the paper's figures
redrawn from it with the paper's hardware.

    bench/cluster/planner_check [--results build/bench-cluster/results.json]
                                [--comm-results build/bench-cluster/comm_features.json] [--out DIR]
                                [--calibration build/bench-cluster/calibration.json]
    bench/cluster/planner_check --at-scale      # only the 512-GPU table of issue 26's options (no root)

1. Calibration, under the same sharing of the 2 cores as the runs it predicts: one run of
   full_shard at 2 hosts x 2 ranks, 1 Gbit/s, traced (fsdp-train --trace): each block's forward
   and backward compute, and the rest of the step (embeddings, head, loss, optimizer) from the
   step time less the blocks and the exposed waits. The loopback's rate and per-collective cost,
   from traced runs of 2 ranks on one host (every collective on loopback): Gloo's per-message cost,
   CPU time, is that cost over the messages of a collective there, times how many more ranks share
   the cores on the cluster (cpu_share: its 4 ranks run on the same 2 cores). The one fitted figure,
   the cross-host rate the cores can drive, makes the planner reproduce the calibration run's step.
2. Validation: the planner's step time and per-link bytes for every strategy at 20, 100 and
   1000 Mbit/s against what bench/cluster/run measured (its results.json): only full_shard at
   1 Gbit/s took part in the calibration. And issue 26's configurations (comm_features.json, from
   bench/cluster/run's part 3, where it exists): step time at 20 and 100 Mbit/s, bytes per host
   link at 2 x 2 and 2 x 4; each must be within 15 %.
3. The paper's figures with its hardware (A100 at 312 TFLOPS bf16, 8 per host, NVLink, 2 Tb/s
   RoCE per host): GPT-175B TFLOPS per GPU at 128-512 GPUs with and without backward prefetch
   (paper Fig. 6b/9), T5-11B at 8-512 GPUs, full against hybrid sharding's cross-host traffic,
   and what issue 26's options change for GPT-175B on 512 GPUs (at_scale()).
Writes planner.json, planner.md and paper_figures.svg/.png to --out, and the calibration's
measurements to calibration.json there (step 1 only: --calibration FILE reuses such a file, so the
model can be checked again without the cluster; the one fitted figure is always fitted anew).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "apps", "plan"))
sys.path.insert(0, HERE)
import fsdp_plan  # noqa: E402
import run as cluster_run  # noqa: E402

TRAIN = os.path.join(ROOT, "build", "bin", "fsdp-train")
# What a results.json without "flags" was measured with: fsdp-train before issue 26, whose Gloo
# reduce-scatter was ProcessGroupGloo's all-reduce (docs/img/cluster/results.json).
LEGACY_FLAGS = ["--gloo-reduce-scatter", "all_reduce"]
# The calibration's loopback runs: this many ranks on one host (this machine).
LOOPBACK_RANKS = 2
# The planner's spelling of fsdp-train's issue-26 flags (the same names; --hpz alike).
PLANNER_FLAGS = ("--tp", "--gloo-reduce-scatter", "--reshard-after-forward-to", "--hpz", "--quantize-all-gather",
                 "--quantize-block")


def trace_events(path):
    ev = json.load(open(path))
    return ev["traceEvents"] if isinstance(ev, dict) else ev


def block_spans(events):
    fwd = [e["dur"] for e in events if e.get("ph") == "X" and e["cat"] == "forward" and "blocks." in e["name"]]
    bwd = [e["dur"] for e in events if e.get("ph") == "X" and e["cat"] == "backward" and "blocks." in e["name"]]
    waits = [e["dur"] for e in events if e.get("ph") == "X" and e["cat"] in ("wait", "rate-limit")]
    return fwd, bwd, waits


def calibrate(model, batch, steps=12, trace_step=6):
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "m.jsonl")
        cluster_run.cluster(2, 2, "1gbit", [TRAIN, "--model", model, "--steps", str(steps), "--global-batch-size", str(batch),
                                            "--strategy", "full_shard", "--log-every", "1000", "--metrics-jsonl", metrics,
                                            "--trace", d, "--trace-step", str(trace_step), "--run-dir", "none", "--sample-tokens", "0"])
        rows = [json.loads(l) for l in open(metrics)]
        per_rank = []
        for rank in range(4):
            fwd, bwd, waits = block_spans(trace_events(os.path.join(d, "trace-rank%d.json" % rank)))
            step_ms = next(r["step_ms"] for r in rows if r["rank"] == rank and r["step"] == trace_step)
            per_rank.append((sum(fwd) / 1e3, sum(bwd) / 1e3, sum(waits) / 1e3, step_ms, len(fwd)))
        # The step the calibration must reproduce: the median over the steps after the second.
        calib_step_ms = statistics.median(max(r["step_ms"] for r in rows if r["step"] == s) for s in range(2, steps))
        # Loopback: traced runs on one host, every collective over loopback. A collective's time
        # is fitted as a fixed cost plus bytes over a rate (least squares over every all-gather
        # and reduce-scatter of both ranks, three runs). These runs have fsdp-train's default ring
        # reduce-scatter, which sends what fsdp counts for it (ProcessGroupGloo's all-reduce, before
        # issue 26, sent twice that). The fixed cost is per collective; the planner charges it per
        # message, so the messages of each are counted too (at 2 ranks: an all-gather's 2(n-1) = 2,
        # the ring reduce-scatter's n-1 = 1).
        points = []
        for run in range(3):
            local_dir = os.path.join(d, "local%d" % run)
            os.makedirs(local_dir)
            subprocess.run([TRAIN, "--model", model, "--steps", str(steps), "--global-batch-size", str(batch),
                            "--strategy", "full_shard", "--nproc-per-node", str(LOOPBACK_RANKS), "--log-every", "1000",
                            "--trace", local_dir, "--trace-step", str(trace_step), "--run-dir", "none",
                            "--sample-tokens", "0"], check=True, capture_output=True)
            for rank in range(LOOPBACK_RANKS):
                for e in trace_events(os.path.join(local_dir, "trace-rank%d.json" % rank)):
                    if e.get("ph") == "X" and e["cat"] in ("all-gather", "reduce-scatter") and e["args"].get("bytes", 0) > 0:
                        messages = 2 * (LOOPBACK_RANKS - 1) if e["cat"] == "all-gather" else LOOPBACK_RANKS - 1
                        points.append((e["args"]["bytes"], e["dur"] / 1e6, messages))
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sum((p[0] - mx) ** 2 for p in points)
    fixed = max(0.0, my - slope * mx)
    L = per_rank[0][4]
    fwd_ms = statistics.median(p[0] for p in per_rank) / L
    bwd_ms = statistics.median(p[1] for p in per_rank) / L
    other_ms = statistics.median(p[3] - p[0] - p[1] - p[2] for p in per_rank)
    return {"block_fwd_s": fwd_ms / 1e3, "block_bwd_s": bwd_ms / 1e3, "root_fwd_s": 0.0, "root_bwd_s": 0.0,
            "other_s": other_ms / 1e3, "loopback_bytes_per_s": 1.0 / slope if slope > 0 else 1e10,
            "collective_fixed_s": fixed, "calibration_step_s": calib_step_ms / 1e3,
            "loopback_messages_per_collective": sum(p[2] for p in points) / n, "loopback_ranks": LOOPBACK_RANKS,
            "cores": os.cpu_count()}


def planner_flags(flags):
    """fsdp-train's issue-26 flags among `flags`, as the planner takes them."""
    out = []
    for i, f in enumerate(flags):
        if f in PLANNER_FLAGS:
            out += [f] if f == "--hpz" else [f, flags[i + 1]]
    return out


def cpu_share(calib, world):
    """How much longer a rank's CPU work takes on the emulated cluster than in the loopback runs:
    every host of the cluster is a namespace of this machine, so all `world` ranks share its cores,
    where the loopback runs had LOOPBACK_RANKS ranks on them (4 ranks on 2 cores against 2: twice)."""
    cores = calib.get("cores") or os.cpu_count() or 1
    return max(1.0, world / cores) / max(1.0, calib.get("loopback_ranks", LOOPBACK_RANKS) / cores)


def predict(model_name, strategy, rate_mbit, calib, batch_per_rank, flags=(), hosts=2, per_host=2):
    """The planner's step for a run on the emulated cluster; `flags`: the run's fsdp-train flags."""
    # What crosses hosts runs at the link's rate or at what the cores can drive, whichever is less.
    rate_mbit = min(rate_mbit, calib.get("drivable_mbit", rate_mbit))
    # Gloo's per-message cost and its loopback copies are CPU time, measured on loopback with
    # fewer ranks on the cores than the cluster has (cpu_share). Per message: the fixed cost per
    # collective over the loopback runs' messages per collective (13/8 with the ring reduce-scatter,
    # for calibrations that did not count them: a step's 5 all-gathers of 2 messages and 3
    # reduce-scatters of 1; it was 2 when the reduce-scatter was Gloo's all-reduce).
    share = cpu_share(calib, hosts * per_host)
    per_message = calib["collective_fixed_s"] / calib.get("loopback_messages_per_collective", 13.0 / 8.0)
    args = fsdp_plan.parser().parse_args([
        "--model", model_name, "--world", str(hosts * per_host), "--ranks-per-host", str(per_host), "--strategy", strategy,
        "--batch-per-rank", str(batch_per_rank), "--backend", "gloo", "--framing", "1.07",
        "--param-bytes", "4", "--reduce-bytes", "4",
        "--inter-gbs", str(rate_mbit / 8 / 1000.0), "--intra-gbs", str(calib["loopback_bytes_per_s"] / share / 1e9),
        "--latency", str(per_message * share)] + planner_flags(flags))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(calib, f)
    args.calibration = f.name
    r = fsdp_plan.plan(args)
    os.unlink(f.name)
    return r


# Issue 26 at the paper's scale: (label, planner flags). NCCL there: its reduce-scatter is a ring
# already, so --gloo-reduce-scatter changes nothing and is not a row.
AT_SCALE = [
    ("baseline", []),
    ("+ hpZ (N = 8, the host)", ["--hpz"]),
    ("+ int8 all-gather", ["--quantize-all-gather", "int8"]),
    ("+ hpZ + int8 (all three)", ["--hpz", "--quantize-all-gather", "int8"]),
]


# The paper's 2 Tb/s per host, and a fifth of it, where backward's gathers no longer hide.
AT_SCALE_LINKS = (250.0, 50.0)


def at_scale(W=512, model="175b", inter_gbs=None):
    """GPT-175B on W A100s, 8 per host (the paper's Fig. 9/10 setting, bf16, batch 1 per GPU):
    predicted step, TFLOPS per GPU, exposed communication, bytes per host link and the per-rank
    memory (bf16 column: without activations, and with checkpointed activations) of each option.
    inter_gbs: GB/s per host link instead of the paper's 250 (2 Tb/s RoCE). Memory comes from
    fsdp_plan's transcription of the library's plan, so the table needs no build."""
    rows = []
    for label, flags in AT_SCALE:
        argv = ["--model", model, "--world", str(W), "--ranks-per-host", "8", "--hardware", "a100-roce",
                "--batch-per-rank", "1", "--strategy", "full_shard"] + flags
        args = fsdp_plan.apply_hardware(fsdp_plan.parser().parse_args(argv))
        if inter_gbs:
            args.inter_gbs = inter_gbs
        r = fsdp_plan.plan(args)
        m = fsdp_plan.Model(model, *fsdp_plan.MODELS[model])
        bare = fsdp_plan.python_plan(m, args, 2, with_activations=False)
        args.activation_checkpointing = True
        checkpointed = fsdp_plan.python_plan(m, args, 2)
        rows.append({"label": label, "flags": flags, "W": W, "inter_gbs": args.inter_gbs, "step_s": r["step_s"],
                     "tflops": r["tflops_per_rank"], "exposed_s": r["exposed_comm_s"], "link_bytes": r["link_bytes"],
                     "secondary_gib": bare["secondary_shards"] / fsdp_plan.GIB,
                     "staging_gib": bare["gather_staging"] / fsdp_plan.GIB,
                     "memory_gib": bare["peak"] / fsdp_plan.GIB,
                     "memory_checkpointed_gib": checkpointed["peak"] / fsdp_plan.GIB})
    return rows


def at_scale_markdown(rows):
    L = ["| GPT-175B, %d A100s (8 per host, %.0f Gb/s per host link), full_shard, bf16 | step | TFLOPS/GPU | exposed comm | bytes per host link "
         "| per-rank memory, no activations | with checkpointed activations (batch 1; memory only) "
         "| of which hpZ's secondary shards | of which quantized records in flight |"
         % (rows[0]["W"], rows[0]["inter_gbs"] * 8), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append("| %s | %.2f s | %.0f | %.2f s | %.0f GB | %.1f GiB | %.1f GiB | %.1f GiB | %.1f GiB |" % (
            r["label"], r["step_s"], r["tflops"], r["exposed_s"], r["link_bytes"] / 1e9, r["memory_gib"],
            r["memory_checkpointed_gib"], r["secondary_gib"], r["staging_gib"]))
    return L


def paper_figures(out):
    fig_rows = []
    for prefetch in (True, False):
        for W in (128, 256, 512):
            argv = ["--model", "175b", "--world", str(W), "--ranks-per-host", "8", "--hardware", "a100-roce",
                    "--batch-per-rank", "1", "--strategy", "full_shard"]
            if not prefetch:
                argv.append("--no-backward-prefetch")
            r = fsdp_plan.plan(fsdp_plan.apply_hardware(fsdp_plan.parser().parse_args(argv)))
            fig_rows.append({"figure": "gpt175b", "W": W, "prefetch": prefetch, "tflops": r["tflops_per_rank"],
                             "step_s": r["step_s"], "exposed_s": r["exposed_comm_s"]})
    for W in (8, 16, 32, 64, 128, 256, 512):
        argv = ["--model", "t5-11b", "--world", str(W), "--ranks-per-host", "8", "--hardware", "a100-roce",
                "--batch-per-rank", "8", "--strategy", "full_shard"]
        r = fsdp_plan.plan(fsdp_plan.apply_hardware(fsdp_plan.parser().parse_args(argv)))
        fig_rows.append({"figure": "t5-11b", "W": W, "tflops": r["tflops_per_rank"], "step_s": r["step_s"],
                         "exposed_s": r["exposed_comm_s"]})
    for strategy in ("full_shard", "hybrid_shard"):
        for W in (16, 64, 256, 512):
            argv = ["--model", "175b", "--world", str(W), "--ranks-per-host", "8", "--hardware", "a100-roce",
                    "--batch-per-rank", "1", "--strategy", strategy]
            r = fsdp_plan.plan(fsdp_plan.apply_hardware(fsdp_plan.parser().parse_args(argv)))
            fig_rows.append({"figure": "traffic", "W": W, "strategy": strategy, "link_bytes": r["link_bytes"],
                             "tflops": r["tflops_per_rank"], "step_s": r["step_s"]})
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for prefetch in (True, False):
        xs = [r["W"] for r in fig_rows if r["figure"] == "gpt175b" and r["prefetch"] == prefetch]
        ys = [r["tflops"] for r in fig_rows if r["figure"] == "gpt175b" and r["prefetch"] == prefetch]
        axes[0].plot(xs, ys, marker="o", label="backward prefetch" if prefetch else "no prefetch")
    axes[0].set_title("GPT-175B, full sharding (paper Fig. 9)")
    axes[0].set_xlabel("GPUs")
    axes[0].set_ylabel("predicted TFLOPS per GPU")
    axes[0].set_xscale("log", base=2)
    axes[0].legend()
    xs = [r["W"] for r in fig_rows if r["figure"] == "t5-11b"]
    axes[1].plot(xs, [r["tflops"] for r in fig_rows if r["figure"] == "t5-11b"], marker="o")
    axes[1].set_title("T5-11B, full sharding, batch 8 per GPU")
    axes[1].set_xlabel("GPUs")
    axes[1].set_xscale("log", base=2)
    axes[1].set_ylabel("predicted TFLOPS per GPU")
    for strategy in ("full_shard", "hybrid_shard"):
        xs = [r["W"] for r in fig_rows if r["figure"] == "traffic" and r["strategy"] == strategy]
        axes[2].plot(xs, [r["link_bytes"] / 1e9 for r in fig_rows if r["figure"] == "traffic" and r["strategy"] == strategy],
                     marker="o", label=strategy)
    axes[2].set_title("GPT-175B: bytes per host link per step")
    axes[2].set_xlabel("GPUs")
    axes[2].set_xscale("log", base=2)
    axes[2].set_ylabel("GB")
    axes[2].legend()
    fig.tight_layout()
    fig_rows += [dict(r, figure="issue26") for gbs in AT_SCALE_LINKS for r in at_scale(inter_gbs=gbs)]
    fig.savefig(os.path.join(out, "paper_figures.svg"))
    fig.savefig(os.path.join(out, "paper_figures.png"), dpi=110)
    return fig_rows


def comm_check(path, model, batch, calib):
    """Issue 26's configurations, predicted against bench/cluster/run's part 3: step time at 2 x 2
    (20 and 100 Mbit/s) and bytes per host link (2 x 2 and 2 x 4)."""
    measured = json.load(open(path))
    rows = []
    for m in measured["bandwidth"]:
        rate = cluster_run.mbit(m["rate"])
        p = predict(model, m["strategy"], rate, calib, batch // 4, m["flags"])
        rows.append({"kind": "step", "label": m["label"], "topology": "2 x 2", "link": "%d Mbit/s" % rate,
                     "measured": m["step_ms_median"], "predicted": p["step_s"] * 1e3})
    for t in measured["traffic"]:
        W = t["hosts"] * t["per_host"]
        p = predict(model, t["strategy"], 1000, calib, batch // W, t["flags"], t["hosts"], t["per_host"])
        rows.append({"kind": "bytes", "label": t["label"], "topology": "%d x %d" % (t["hosts"], t["per_host"]),
                     "link": "1000 Mbit/s", "measured": t["measured_tx"], "predicted": p["link_bytes"]})
    for r in rows:
        r["ratio"] = r["predicted"] / r["measured"]
    return rows


def tp_check(path, model, batch, calib):
    """Issue 27's configurations, predicted against bench/cluster/run's part 4 (tp.json): step time
    at 2 x 2 (20 and 100 Mbit/s) and bytes per host link at 1 Gbit/s. --batch-per-rank is per
    data-parallel rank (its TP ranks share it)."""
    measured = json.load(open(path))
    configs = {label: (s, flags) for label, s, flags in cluster_run.TP_CONFIGS}

    def dp_batch(flags):
        tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
        return batch // (4 // tp)

    rows = []
    for m in measured["bandwidth"]:
        s, flags = configs[m["label"]]
        rate = cluster_run.mbit(m["rate"])
        p = predict(model, s, rate, calib, dp_batch(flags), flags)
        rows.append({"kind": "step", "label": m["label"], "topology": "2 x 2", "link": "%d Mbit/s" % rate,
                     "measured": m["step_ms_median"], "predicted": p["step_s"] * 1e3})
    for t in measured["traffic"]:
        s, flags = configs[t["label"]]
        p = predict(model, s, 1000, calib, dp_batch(flags), flags)
        rows.append({"kind": "bytes", "label": t["label"], "topology": "2 x 2", "link": "1000 Mbit/s",
                     "measured": t["measured_tx"], "predicted": p["link_bytes"]})
    for r in rows:
        r["ratio"] = r["predicted"] / r["measured"]
    return rows


# Issue 27 at scale: a 70B-class GPT (fsdp_plan.MODELS["70b"]) on 256 H100s, 8 per host, as
# torchtitan ran Llama 3.1 70B (benchmarks/llama3_h100_202412_torchtitan.md, Table 4: FSDP 32 x TP 8,
# local batch 16 of 8192 tokens, full activation checkpointing, torch.compile and Float8: 829
# tokens/s per GPU at 71.9 GiB; 876 with async TP).
TORCHTITAN_70B = {"tps_per_gpu": 829, "tps_per_gpu_async_tp": 876, "memory_gib": 71.9}


def tp_at_scale():
    rows = []
    for label, tp, batch, sp in [("FSDP 32 x TP 8 + sequence parallelism, local batch 16 (torchtitan's)", 8, 16, True),
                                 ("FSDP 32 x TP 8 without sequence parallelism, local batch 16", 8, 16, False),
                                 ("FSDP 32 x TP 8 + sequence parallelism, local batch 2", 8, 2, True),
                                 ("FSDP 256 alone, batch 2 per GPU (16 per 8 GPUs)", 1, 2, False)]:
        argv = ["--model", "70b", "--world", "256", "--ranks-per-host", "8", "--hardware", "h100-grand-teton",
                "--batch-per-rank", str(batch), "--strategy", "full_shard", "--tp", str(tp), "--activation-checkpointing"]
        if sp:
            argv.append("--sequence-parallel")
        args = fsdp_plan.apply_hardware(fsdp_plan.parser().parse_args(argv))
        r = fsdp_plan.plan(args)
        m = fsdp_plan.Model("70b", *fsdp_plan.MODELS["70b"], tp=tp)
        mem = fsdp_plan.python_plan(m, args, 2)
        rows.append({"label": label, "tp": tp, "batch": batch, "sequence_parallel": sp, "step_s": r["step_s"], "tps": r["tokens_per_s_per_gpu"],
                     "tflops": r["tflops_per_rank"], "exposed_s": r["exposed_comm_s"], "link_bytes": r["link_bytes"],
                     "tp_all_reduce_s": r["tp_all_reduce_s"], "memory_gib": mem["peak"] / fsdp_plan.GIB})
    return rows


def tp_at_scale_markdown(rows):
    L = ["| 70B-class GPT (65.5 B), 256 H100s (8 per host, 400 GB/s per host), bf16, MFU 0.40, full activation "
         "checkpointing | step | tokens/s per GPU | model TFLOPS per GPU | exposed fsdp comm | one TP all-reduce "
         "| bytes per host link | per-rank memory (plan) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append("| %s | %.2f s | %.0f | %.0f | %.2f s | %.1f ms | %.0f GB | %.1f GiB |" % (
            r["label"], r["step_s"], r["tps"], r["tflops"], r["exposed_s"], r["tp_all_reduce_s"] * 1e3,
            r["link_bytes"] / 1e9, r["memory_gib"]))
    L.append("| torchtitan, Llama 3.1 70B, FSDP 32 x TP 8, local batch 16, Float8 + torch.compile (published) | | "
             "%d (%d with async TP) | | | | | %.1f GiB |" % (TORCHTITAN_70B["tps_per_gpu"], TORCHTITAN_70B["tps_per_gpu_async_tp"],
                                                             TORCHTITAN_70B["memory_gib"]))
    return L


def comm_markdown(rows):
    L = ["| issue 26 configuration | hosts x ranks | link | measured | predicted | predicted / measured |",
         "|---|---|---|---|---|---|"]
    for r in rows:
        unit = (lambda v: "%.0f ms" % v) if r["kind"] == "step" else (lambda v: "%.1f KB per host link" % (v / 1e3))
        L.append("| %s | %s | %s | %s | %s | %.2f%s |" % (r["label"], r["topology"], r["link"], unit(r["measured"]),
                                                        unit(r["predicted"]), r["ratio"],
                                                        "" if abs(r["ratio"] - 1) <= 0.15 else " (beyond 15 %)"))
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    L += ["", "Worst: %s, %s, %s: %.2f (%s 15 %%)." % (worst["label"], worst["topology"], worst["link"], worst["ratio"],
                                                      "within" if abs(worst["ratio"] - 1) <= 0.15 else "NOT within")]
    return L


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(ROOT, "build", "bench-cluster", "results.json"))
    ap.add_argument("--comm-results", default=os.path.join(ROOT, "build", "bench-cluster", "comm_features.json"),
                    help="bench/cluster/run's part 3 (issue 26); left out where it does not exist")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "bench-cluster"))
    ap.add_argument("--calibration", metavar="FILE",
                    help="reuse a calibration (the measured dict printed as 'calibration: {...}', saved by every "
                         "calibrating run as OUT/calibration.json) instead of running the cluster; the drivable "
                         "rate is fitted again")
    ap.add_argument("--tp-results", default=os.path.join(ROOT, "build", "bench-cluster", "tp.json"),
                    help="bench/cluster/run's part 4 (issue 27); left out where it does not exist")
    ap.add_argument("--tp-at-scale", action="store_true",
                    help="print only the 70B table of issue 27 (FSDP 32 x TP 8 on 256 H100s; no cluster, no root)")
    ap.add_argument("--at-scale", action="store_true",
                    help="print only the 512-GPU table of issue 26's options (no cluster, no root)")
    a = ap.parse_args()
    if a.tp_at_scale:
        print("\n".join(tp_at_scale_markdown(tp_at_scale())))
        return
    if a.at_scale:
        for gbs in AT_SCALE_LINKS:
            print("\n".join(at_scale_markdown(at_scale(inter_gbs=gbs))) + "\n")
        return
    measured = json.load(open(a.results))
    flags = measured.get("flags", LEGACY_FLAGS)
    model, batch = measured["model"], measured["batch"]
    if a.calibration:
        # What an earlier run measured (its "calibration: {...}" line, or the file it saved). The
        # drivable rate is the planner's fit, not a measurement: fitted again below, with this
        # version of the model.
        calib = json.load(open(a.calibration))
        calib.pop("drivable_mbit", None)
    else:
        calib = calibrate(model, batch)
        os.makedirs(a.out, exist_ok=True)
        json.dump(calib, open(os.path.join(a.out, "calibration.json"), "w"), indent=1)
    # The one fitted figure: the cross-host rate that 4 ranks on 2 cores can drive through Gloo
    # (TCP over veth costs CPU time the ranks also compute with). Bisection, so that the planner
    # reproduces the calibration run's step (full_shard at 1 Gbit/s).
    lo, hi = 1.0, 1000.0
    if predict(model, "full_shard", 1000, calib, batch // 4)["step_s"] < calib["calibration_step_s"]:
        for _ in range(40):
            mid = (lo * hi) ** 0.5
            calib["drivable_mbit"] = mid
            if predict(model, "full_shard", 1000, calib, batch // 4)["step_s"] > calib["calibration_step_s"]:
                lo = mid
            else:
                hi = mid
        calib["drivable_mbit"] = (lo * hi) ** 0.5
    print("calibration:", json.dumps(calib))
    rows = []
    for m in measured["bandwidth"]:
        rate = cluster_run.mbit(m["rate"])
        p = predict(model, m["strategy"], rate, calib, batch // 4, flags)
        rows.append({"strategy": m["strategy"], "mbit": rate, "measured_ms": m["step_ms_median"],
                     "predicted_ms": p["step_s"] * 1e3, "ratio": p["step_s"] * 1e3 / m["step_ms_median"],
                     "predicted_link_bytes": p["link_bytes"],
                     "in_calibration": m["strategy"] == "full_shard" and rate == 1000})
    traffic_rows = []
    for t in measured["traffic"]:
        if t["hosts"] != 2 or t["per_host"] != 2:
            continue
        p = predict(model, t["strategy"], 1000, calib, batch // 4, flags)
        traffic_rows.append({"strategy": t["strategy"], "measured_tx": t["measured_tx"], "predicted": p["link_bytes"],
                             "ratio": p["link_bytes"] / t["measured_tx"]})
    comm_rows = comm_check(a.comm_results, model, batch, calib) if os.path.exists(a.comm_results) else None
    tp_rows = tp_check(a.tp_results, model, batch, calib) if os.path.exists(a.tp_results) else None
    figs = paper_figures(a.out)
    res = {"calibration": calib, "step_time": rows, "traffic": traffic_rows, "paper": figs, "comm_features": comm_rows,
           "tensor_parallel": tp_rows, "tensor_parallel_at_scale": tp_at_scale(),
           "measured_with": flags, "command": "bench/cluster/planner_check " + " ".join(sys.argv[1:])}
    json.dump(res, open(os.path.join(a.out, "planner.json"), "w"), indent=1)
    L = ["| strategy | link | measured step | predicted | predicted / measured |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["strategy"], r["mbit"])):
        L.append("| %s | %d Mbit/s | %.0f ms | %.0f ms | %.2f%s |" % (r["strategy"], r["mbit"], r["measured_ms"],
                                                                     r["predicted_ms"], r["ratio"],
                                                                     " (calibration)" if r["in_calibration"] else ""))
    L += ["", "| strategy | measured bytes per host link and step (tx) | planner | planner / measured |", "|---|---|---|---|"]
    for r in traffic_rows:
        L.append("| %s | %.1f KB | %.1f KB | %.2f |" % (r["strategy"], r["measured_tx"] / 1e3, r["predicted"] / 1e3, r["ratio"]))
    if comm_rows:
        L += [""] + comm_markdown(comm_rows)
    if tp_rows:
        L += [""] + [l.replace("issue 26 configuration", "issue 27 configuration") for l in comm_markdown(tp_rows)]
    L += [""] + tp_at_scale_markdown(res["tensor_parallel_at_scale"])
    L += ["", "| figure | GPUs | variant | predicted TFLOPS/GPU | step | exposed communication |", "|---|---|---|---|---|---|"]
    for r in (r for r in figs if r["figure"] != "issue26"):
        variant = r.get("strategy") or ("prefetch" if r.get("prefetch") else ("no prefetch" if "prefetch" in r else ""))
        L.append("| %s | %d | %s | %.0f | %.2f s | %s |" % (r["figure"], r["W"], variant, r["tflops"], r["step_s"],
                                                          "%.2f s" % r["exposed_s"] if "exposed_s" in r else
                                                          "%.1f GB per host link" % (r["link_bytes"] / 1e9)))
    for gbs in AT_SCALE_LINKS:
        L += [""] + at_scale_markdown([r for r in figs if r["figure"] == "issue26" and r["inter_gbs"] == gbs])
    open(os.path.join(a.out, "planner.md"), "w").write("\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main()
