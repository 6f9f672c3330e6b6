#!/usr/bin/env python3
"""Exposed communication as a share of the step, per configuration of fsdp-train, from its JSONL.

Runs each configuration --repeats times, alternately (A B A B ...), and prints for each the median
step time, the median share of the step the compute thread waited for communication
(exposed_comm_ms / step_ms), per rank and over all ranks, and where that wait was (the JSONL's
phases: all-gathers in forward and backward, reductions in backward, the rate limiter). Steps
before --warmup are left out.

    python3 bench/exposed_share.py --world-size 4 --repeats 5 \\
        --config base= --config keep-last="--keep-gathered-after-forward blocks.3"

A configuration is NAME=FLAGS (extra fsdp-train flags; empty for the defaults).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fsdp-train", default=os.path.join(REPO, "build", "bin", "fsdp-train"))
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="default")
    p.add_argument("--config", action="append", default=[], help="NAME=FLAGS; repeat for each configuration")
    args = p.parse_args()
    if not args.config:
        args.config = ["default="]
    configs = []
    for c in args.config:
        if "=" not in c:
            p.error(f"--config {c!r}: write NAME=FLAGS (NAME= for the defaults)")
        name, flags = c.split("=", 1)
        configs.append((name, shlex.split(flags)))
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    return args, configs


def main():
    args, configs = parse_args()
    rows = {name: [] for name, _ in configs}
    with tempfile.TemporaryDirectory(prefix="exposed_share.") as tmp:
        for r in range(args.repeats):
            for name, flags in configs:
                metrics = os.path.join(tmp, f"{name}-{r}.jsonl")
                cmd = [args.fsdp_train, "--nproc-per-node", str(args.world_size), "--model", args.model,
                       "--steps", str(args.steps), "--log-every", "1000", "--run-dir", "none", "--sample-tokens", "0",
                       "--metrics-jsonl", metrics] + flags
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                if proc.returncode != 0:
                    print(f"{name}: fsdp-train failed ({proc.returncode}):\n{proc.stdout[-2000:]}", file=sys.stderr)
                    return 1
                for line in open(metrics):
                    j = json.loads(line)
                    if "step_ms" in j and j["step"] >= args.warmup:
                        rows[name].append(j)
            print(f"round {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    med = statistics.median
    print(f"fsdp-train --nproc-per-node {args.world_size} --model {args.model}, {args.repeats} runs x "
          f"{args.steps - args.warmup} steps each, every rank; medians (ms, %)")
    print("| configuration | step | exposed share, all ranks | per rank | all-gather in forward | all-gather in backward "
          "| reduction in backward | rate limiter |")
    print("|---|---|---|---|---|---|---|---|")
    for name, flags in configs:
        rs = rows[name]
        share = lambda js: 100 * med(j["exposed_comm_ms"] / j["step_ms"] for j in js)
        ranks = sorted({j["rank"] for j in rs})
        per_rank = " / ".join(f"{share([j for j in rs if j['rank'] == k]):.1f}" for k in ranks)
        ph = lambda p, k: med(j["phases"][p][k] for j in rs)
        label = name + (f" (`{shlex.join(flags)}`)" if flags else "")
        print(f"| {label} | {med(j['step_ms'] for j in rs):.1f} | {share(rs):.1f} % | {per_rank} | "
              f"{ph('forward', 'exposed_all_gather_ms'):.1f} | {ph('backward', 'exposed_all_gather_ms'):.1f} | "
              f"{ph('backward', 'exposed_reduce_ms'):.1f} | {med(j['rate_limiter_wait_ms'] for j in rs):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
