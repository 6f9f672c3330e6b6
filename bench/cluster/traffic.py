"""Measured link bytes per step against fsdp's comm_bytes and the exact volume (traffic_model.py).

    python traffic.py --jsonl metrics.jsonl --hosts 2 --ranks-per-host 2 --strategy hybrid_shard \
        [--shard-size 2] [--idle-bytes-per-s 0] [--skip-steps 1]

reads the rows fsdp-train wrote (--metrics-jsonl; each row carries what this host's links carried
through the step, read from the kernel's counters) and prints one JSON object: per host, the
measured bytes per step (the mean over the steps after the first, less the idle baseline),
what the model predicts, and what fsdp's comm_bytes of the host's ranks add up to.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import traffic_model  # noqa: E402


def shard_size(strategy, W, G, F):
    if strategy in ("full_shard", "shard_grad_op"):
        return W
    if strategy == "no_shard":
        return 1
    return F or G


def analyze(rows, hosts, G, strategy, F=0, idle_bytes_per_s=0.0, skip_steps=1, clip=True, mtu=1500):
    W = hosts * G
    F = shard_size(strategy, W, G, F)
    by_step = {}
    for r in rows:
        if "step" in r:
            by_step.setdefault(r["step"], {})[r["rank"]] = r
    steps = sorted(s for s, rs in by_step.items() if s >= skip_steps + min(by_step) and len(rs) == W)
    if not steps:
        raise SystemExit("traffic: no complete step after the first %d in the metrics" % skip_steps)
    measured = {h: {"tx": 0.0, "rx": 0.0} for h in range(hosts)}
    predicted = {h: {"tx": 0.0, "rx": 0.0, "payload_tx": 0.0, "payload_rx": 0.0} for h in range(hosts)}
    counted = {h: 0.0 for h in range(hosts)}
    step_ms = []
    for s in steps:
        rs = by_step[s]
        p = traffic_model.predict(rs, W, G, F, strategy, clip=clip, mtu=mtu)
        for h in range(hosts):
            for k in predicted[h]:
                predicted[h][k] += p[h][k] / len(steps)
        for rank, row in rs.items():
            h = rank // G
            counted[h] += sum(row["comm_bytes"].values()) / len(steps)
            if row.get("local_rank", rank % G) == 0:
                links = row.get("links", {})
                if not links:
                    raise SystemExit("traffic: rank %d's rows carry no link counters (not run in a cluster?)" % rank)
                idle = idle_bytes_per_s * row["step_ms"] / 1000.0
                for k in ("tx", "rx"):
                    measured[h][k] += (sum(l[k + "_bytes"] for l in links.values()) - idle) / len(steps)
        step_ms.append(max(row["step_ms"] for row in rs.values()))
    out = {"W": W, "G": G, "F": F, "strategy": strategy, "steps": len(steps),
           "step_ms_median": sorted(step_ms)[len(step_ms) // 2], "hosts": []}
    for h in range(hosts):
        out["hosts"].append({
            "host": h,
            "measured_tx": measured[h]["tx"], "measured_rx": measured[h]["rx"],
            "predicted_tx": predicted[h]["tx"], "predicted_rx": predicted[h]["rx"],
            "payload_tx": predicted[h]["payload_tx"], "payload_rx": predicted[h]["payload_rx"],
            "comm_bytes_of_ranks": counted[h],
        })
    return out


def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jsonl", required=True)
    ap.add_argument("--hosts", type=int, required=True)
    ap.add_argument("--ranks-per-host", type=int, required=True)
    ap.add_argument("--strategy", required=True)
    ap.add_argument("--shard-size", type=int, default=0)
    ap.add_argument("--idle-bytes-per-s", type=float, default=0.0)
    ap.add_argument("--skip-steps", type=int, default=1)
    ap.add_argument("--no-clip", action="store_true")
    ap.add_argument("--mtu", type=int, default=1500)
    a = ap.parse_args()
    print(json.dumps(analyze(read_rows(a.jsonl), a.hosts, a.ranks_per_host, a.strategy, a.shard_size,
                             a.idle_bytes_per_s, a.skip_steps, not a.no_clip, a.mtu), indent=1))


if __name__ == "__main__":
    main()
