"""Memory through one training iteration, per strategy: the paper's Fig. 8, measured.

Runs fsdp-train once per strategy with --memory-timeline (each rank samples its live tensor bytes
and anonymous resident memory every millisecond through step --trace-step), then plots rank 0's
samples over time with the phases shaded, and prints each strategy's peaks.

    bench/memory_over_iteration --model default --nproc 4 --out docs/img/memory-default-w4.png
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASE_COLORS = {"forward": "#dbe9f6", "backward": "#fbe3d6", "step": "#e2f0d9"}


def run(strategy, args, workdir):
    out = os.path.join(workdir, strategy)
    os.makedirs(out, exist_ok=True)
    metrics = os.path.join(out, "metrics.jsonl")
    cmd = [os.path.join(args.bin, "fsdp-train"), "--model", args.model, "--strategy", strategy,
           "--nproc-per-node", str(args.nproc), "--global-batch-size", str(args.global_batch),
           "--steps", str(args.step + 1), "--trace-step", str(args.step), "--log-every", "100",
           "--memory-timeline", out, "--metrics-jsonl", metrics, "--run-dir", "none", "--sample-tokens", "0"] + args.extra
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "memory-rank0.csv")) as f:
        samples = list(csv.DictReader(f))
    rows = [json.loads(line) for line in open(metrics)]
    plan = max(r["memory"]["plan_bytes"] for r in rows)
    return samples, plan


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--step", type=int, default=2, help="the step sampled (after warm-up)")
    p.add_argument("--strategies", default="full_shard,shard_grad_op,no_shard")
    p.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "img", "memory-over-iteration.png"))
    p.add_argument("extra", nargs="*", help="more fsdp-train flags, after --")
    args = p.parse_args()
    strategies = args.strategies.split(",")
    fig, axes = plt.subplots(len(strategies), 1, figsize=(9, 2.6 * len(strategies)), sharey=True)
    if len(strategies) == 1:
        axes = [axes]
    print(f"| strategy | plan (MB) | peak live tensors (MB) | peak anonymous resident (MB) |")
    print(f"|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for ax, strategy in zip(axes, strategies):
            samples, plan = run(strategy, args, work)
            t = [float(s["t_ms"]) for s in samples]
            live = [int(s["live_tensor_bytes"]) / 1e6 for s in samples]
            anon = [int(s["anon_resident_bytes"]) / 1e6 for s in samples]
            start = 0
            for i in range(1, len(samples) + 1):
                if i == len(samples) or samples[i]["phase"] != samples[start]["phase"]:
                    color = PHASE_COLORS.get(samples[start]["phase"])
                    if color:
                        ax.axvspan(t[start], t[i - 1], color=color, lw=0)
                    start = i
            ax.plot(t, live, label="live tensor bytes", color="#1f4e79")
            ax.plot(t, anon, label="anonymous resident", color="#c55a11")
            ax.axhline(plan / 1e6, ls="--", color="gray", lw=1, label="plan")
            ax.set_title(f"{strategy}: GPT '{args.model}', W = {args.nproc}, rank 0", fontsize=10)
            ax.set_ylabel("MB")
            print(f"| {strategy} | {plan / 1e6:.0f} | {max(live):.0f} | {max(anon):.0f} |")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("ms into the step (shaded: forward, backward, optimizer step)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
