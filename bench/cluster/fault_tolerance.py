#!/usr/bin/env python3
"""Step efficiency under failures, live replica groups against restart from checkpoints (issue 28).

Three runs of the same job on the emulated cluster (scripts/cluster, root), each for the same wall
time: without failures; with a host killed at random every --kill-every seconds and the job
restarting from its newest checkpoint (--max-restarts, a spare host at once); and the same kills
with live replica groups (fsdp-coordinator on a host of its own, a replacement started at once
that joins live). The step efficiency of a run is the steps it completed (kept: a restart's redone
steps count once) over the failure-free run's; with live groups a step without a group holds fewer
samples, so the sample efficiency is given too.

    bench/cluster/fault_tolerance.py --minutes 10 --kill-every 60 --out docs/img/cluster/issue28/efficiency

Writes OUT.json (every figure) and OUT.md (the table docs/performance.md shows).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rows(path):
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a rank killed mid-write
    return out


def run(name, args, a, work):
    metrics = os.path.join(work, name + ".jsonl")
    events = os.path.join(work, name + "-coordinator.jsonl")
    save = os.path.join(work, name + "-ckpt")
    train = [os.path.join(ROOT, "build/bin/fsdp-train"), "--run-dir", "none", "--sample-tokens", "0",
             "--model", a.model, "--strategy", "hybrid_shard", "--global-batch-size", str(a.global_batch),
             "--steps", "1000000", "--log-every", "1000", "--metrics-jsonl", metrics]
    cluster = ["bash", os.path.join(ROOT, "scripts/cluster"), "--hosts", str(a.hosts), "--ranks-per-host",
               str(a.ranks_per_host), "--bandwidth", a.bandwidth, "--timeout", str(int(a.minutes * 60))]
    if name != "failure_free":
        cluster += ["--kill-every", str(a.kill_every), "--kill-seed", str(a.seed), "--max-restarts", "1000"]
    if name == "live":
        cluster += ["--coordinator", os.path.join(ROOT, "build/bin/fsdp-coordinator"),
                    "--coordinator-args", "--events " + events]
        train += ["--live-replicas"]
    if name == "restart":
        train += ["--save-dir", save, "--save-every", str(a.save_every)]
    log = os.path.join(work, name + ".log")
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(cluster + ["--"] + train, stdout=f, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    return summarize(name, rows(metrics), rows(events), a, rc, wall, log)


def summarize(name, all_rows, coordinator, a, rc, wall, log):
    steps = [r for r in all_rows if "event" not in r and "loss" in r]
    events = [r for r in all_rows if "event" in r]
    replicas = a.hosts
    F = a.ranks_per_host
    # The last time each step was completed (a restart redoes steps; the last pass is the kept one),
    # and the replica groups in it.
    last = {}
    for r in steps:
        s = r["step"]
        t = r["time"]
        g = r["rank"] // F
        if s not in last or t > last[s]["time"] + 1.0:
            last[s] = {"time": t, "groups": {g}}
        else:
            last[s]["time"] = max(last[s]["time"], t)
            last[s]["groups"].add(g)
    # Kept steps: 0 .. the step of the newest row (a restart rolls back to its checkpoint).
    if steps:
        newest = max(steps, key=lambda r: r["time"])
        kept = newest["step"] + 1
    else:
        kept = 0
    samples = sum(len(last[s]["groups"]) / replicas for s in range(kept) if s in last)
    kills = [l for l in open(log) if "killed host" in l]
    restarts = [e for e in events if e["event"] == "restarted" and e.get("rank") == 0]
    left = [e for e in events if e["event"] == "replica_left"]
    # Seen by the groups that were already in (a replacement logs its own arrival as its first step).
    joined = [e for e in events if e["event"] == "replica_joined" and not e.get("i_joined")]
    pauses = sorted({round(e["pause_ms"]) for e in left})
    return {
        "run": name, "exit_code": rc, "wall_s": round(wall, 1), "kept_steps": kept,
        "samples_in_kept_steps": round(samples, 1), "kills": len(kills), "restarts": len(restarts),
        "replica_left_events": len(left), "joins": len({(tuple(e["replicas"]), e["step"]) for e in joined}),
        "pause_ms": pauses,
        "median_step_ms": sorted(r["step_ms"] for r in steps)[len(steps) // 2] if steps else None,
        "discarded_steps": len({(e["replica"], e["time"] // 1) for e in events if e["event"] == "step_discarded"}),
        "coordinator_rounds": len([e for e in coordinator if e.get("event") == "round"]),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--kill-every", type=int, default=60)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--model", default="default")
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--save-every", type=int, default=10, help="the restart run's checkpoint interval, in steps")
    p.add_argument("--only", choices=["failure_free", "restart", "live"], action="append")
    p.add_argument("--out", default=os.path.join(ROOT, "docs/img/cluster/issue28/efficiency"))
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="fsdp-ft-")
    results = {}
    for name in a.only or ["failure_free", "restart", "live"]:
        print(f"fault_tolerance: {name}: {a.minutes} min ...", file=sys.stderr, flush=True)
        results[name] = run(name, None, a, work)
        print(json.dumps(results[name]), file=sys.stderr, flush=True)
    base = results.get("failure_free")
    for r in results.values():
        if base and base["kept_steps"]:
            r["step_efficiency"] = round(r["kept_steps"] / base["kept_steps"], 3)
            r["sample_efficiency"] = round(r["samples_in_kept_steps"] / base["samples_in_kept_steps"], 3)
    out = {"settings": vars(a), "results": results, "work": work}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump(out, f, indent=2)
    lines = [f"{a.hosts} hosts x {a.ranks_per_host} ranks, GPT '{a.model}', hybrid_shard F = {a.ranks_per_host}, "
             f"{a.minutes:g} min each, a random host killed every {a.kill_every} s (seed {a.seed})", "",
             "| run | kept steps | step efficiency | sample efficiency | kills | restarts / joins | pauses (ms) |",
             "|---|---|---|---|---|---|---|"]
    for r in results.values():
        rj = r["restarts"] if r["run"] == "restart" else r["joins"]
        pauses = ", ".join(str(x) for x in r["pause_ms"][:12]) if r["pause_ms"] else "-"
        lines.append(f"| {r['run']} | {r['kept_steps']} | {r.get('step_efficiency', '-')} | "
                     f"{r.get('sample_efficiency', '-')} | {r['kills']} | {rj} | {pauses} |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
