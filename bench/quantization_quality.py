"""What a quantized all-gather (issue 26, qwZ) costs in training quality, measured.

Trains the default GPT (the main job's model and defaults) on 4 local ranks with full sharding,
once with exact (fp32) all-gathers and once per quantization, the same seed and batches; plots the
loss curves side by side and prints the final loss of each (the mean of the last 10 steps, and the
held-out loss at the end) with its difference from the exact run, and the largest error the
quantization put into a gathered parameter over the whole run (fsdp's Metrics::quantization, the
largest |dequantized - master| over every rank's shards, against the largest |master| of the
units it was measured on; tests/test_wire.cpp holds that metric equal to an independent
measurement).

    bench/quantization_quality --steps 300 --out docs/img/quantization/loss.png
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(quantize, args, workdir, flags=()):
    metrics = os.path.join(workdir, f"{quantize}-{len(flags)}.jsonl")
    cmd = [os.path.join(args.bin, "fsdp-train"), "--model", args.model, "--nproc-per-node", str(args.nproc),
           "--strategy", "full_shard", "--steps", str(args.steps), "--eval-every", str(args.steps),
           "--log-every", "50", "--run-dir", "none", "--sample-tokens", "0", "--metrics-jsonl", metrics,
           "--quantize-all-gather", quantize] + list(flags) + args.extra
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    rows = [json.loads(line) for line in open(metrics)]
    rank0 = sorted((r for r in rows if r["rank"] == 0), key=lambda r: r["step"])
    losses = [r["loss"] for r in rank0]
    evals = [r["eval"]["loss"] for r in rank0 if "eval" in r]
    q = [r["quantization"] for r in rows if "quantization" in r]
    worst = max(q, key=lambda x: x["max_abs_error"]) if q else None
    return {"losses": losses, "final": sum(losses[-10:]) / len(losses[-10:]), "eval": evals[-1] if evals else None,
            "max_abs_error": worst["max_abs_error"] if worst else 0.0,
            "max_abs_weight": max(x["max_abs_weight"] for x in q) if q else 0.0,
            "step_ms": sorted(r["step_ms"] for r in rank0[2:])[len(rank0[2:]) // 2]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--model", default="default")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--quantize", default="int8,fp8", help="comma-separated: int8, fp8")
    ap.add_argument("--noise-floor", action="store_true",
                    help="also train fp32 with Gloo's own reduce-scatter: the same math, summed in another order "
                         "(last-bit differences only), to show how far 300 steps carry a perturbation of one ulp")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "bench-quantization", "loss.png"))
    ap.add_argument("extra", nargs="*", help="more fsdp-train flags, after --")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for q in ["none"] + [x for x in args.quantize.split(",") if x]:
            results[q] = train(q, args, workdir)
        if args.noise_floor:
            results["fp32, other summation order"] = train("none", args, workdir, ["--gloo-reduce-scatter", "all_reduce"])
    exact = results["none"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for q, r in results.items():
        label = "fp32 all-gather" if q == "none" else q if q.startswith("fp32") else f"{q} all-gather"
        ax.plot(range(len(r["losses"])), r["losses"], label=label, linewidth=1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (rank 0's micro-batch)")
    ax.set_title(f"GPT '{args.model}', full_shard, W = {args.nproc}: quantized all-gathers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    fig.savefig(os.path.splitext(args.out)[0] + ".svg")
    print("\n| all-gather | final loss (mean of the last 10 steps) | vs fp32 | held-out loss | vs fp32 | "
          "largest |error| in a gathered parameter | largest |weight| there | median step |")
    print("|---|---|---|---|---|---|---|---|")
    for q, r in results.items():
        rel = (r["final"] - exact["final"]) / exact["final"]
        erel = (r["eval"] - exact["eval"]) / exact["eval"] if r["eval"] and exact["eval"] else float("nan")
        print(f"| {'fp32' if q == 'none' else q} | {r['final']:.4f} | {rel:+.2%} | {r['eval']:.4f} | {erel:+.2%} | "
              f"{r['max_abs_error']:.3g} | {r['max_abs_weight']:.3g} | {r['step_ms']:.0f} ms |")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    sys.exit(main())
