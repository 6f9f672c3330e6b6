"""Measured link bytes per step against fsdp's comm_bytes and the exact volume (traffic_model.py).

    python traffic.py --jsonl metrics.jsonl --hosts 2 --ranks-per-host 2 --strategy hybrid_shard \
        [--shard-size 2] [--idle-bytes-per-s 0] [--skip-steps 1] \
        [--gloo-reduce-scatter ring|all_reduce] [--reshard-after-forward-to N | --hpz] \
        [--quantize-all-gather none|int8|fp8] [--quantize-block 64] [--model small]

reads the rows fsdp-train wrote (--metrics-jsonl; each row carries what this host's links carried
through the step, read from the kernel's counters) and prints one JSON object: per host, the
measured bytes per step (the mean over the steps after the first, less the idle baseline),
what the model predicts, and what fsdp's comm_bytes of the host's ranks add up to.

The communication flags are fsdp-train's, and must be those the run had. The exact volume comes
from the rows (what fsdp counted it issued) where the counters tell the calls apart, and from the
model's units (--model, a GPT preset) with hpZ or quantized all-gathers, whose all-gathers differ
in group and size within one counter; "exact_from" says which.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import traffic_model  # noqa: E402


shard_size = traffic_model.shard_size


def analyze(rows, hosts, G, strategy, F=0, idle_bytes_per_s=0.0, skip_steps=1, clip=True, mtu=1500, comm=None,
            model=None, from_units=None):
    """from_units: the exact volume from the model's units (True), from the rows (False), or from
    the units only where the rows cannot tell (None: with hpZ or quantized all-gathers)."""
    W = hosts * G
    F = shard_size(strategy, W, G, F)
    comm = comm or traffic_model.Comm()
    if from_units is None:
        from_units = bool(comm.hpz or comm.quantize != "none")
    if from_units and not model:
        raise SystemExit("traffic: with hpZ or quantized all-gathers the exact volume comes from the model's units: "
                         "give --model")
    if from_units:
        # Every step moves the same bytes: the configuration's, from the units.
        per_step = traffic_model.predict_config(model, hosts, G, strategy, comm, F=F, clip=clip, mtu=mtu)
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
        p = per_step if from_units else traffic_model.predict(rs, W, G, F, strategy, clip=clip, mtu=mtu, comm=comm)
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
    out = {"W": W, "G": G, "F": F, "strategy": strategy, "steps": len(steps), "exact_from": "units" if from_units else "rows",
           "gloo_reduce_scatter": comm.gloo_reduce_scatter, "reshard_after_forward_to": comm.hpz,
           "quantize_all_gather": comm.quantize, "quantize_block": comm.block,
           "step_ms_median": sorted(step_ms)[len(step_ms) // 2], "hosts": []}
    for h in range(hosts):
        out["hosts"].append({
            "host": h,
            "measured_tx": measured[h]["tx"], "measured_rx": measured[h]["rx"],
            "predicted_tx": predicted[h]["tx"], "predicted_rx": predicted[h]["rx"],
            "payload_tx": predicted[h]["payload_tx"], "payload_rx": predicted[h]["payload_rx"],
            "comm_bytes_of_ranks": counted[h],
        })
    if model:
        # What the counters should say, from the units: a check that fsdp counts as modelled.
        expected = traffic_model.counted_comm_bytes(model, hosts, G, strategy, comm, F=F, clip=clip)
        for h in out["hosts"]:
            h["comm_bytes_of_ranks_expected"] = G * expected
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
    ap.add_argument("--gloo-reduce-scatter", default="ring", choices=["ring", "all_reduce"])
    ap.add_argument("--reshard-after-forward-to", type=int, default=0, metavar="N")
    ap.add_argument("--hpz", action="store_true", help="--reshard-after-forward-to the ranks per host")
    ap.add_argument("--quantize-all-gather", default="none", choices=["none", "int8", "fp8"])
    ap.add_argument("--quantize-block", type=int, default=64)
    ap.add_argument("--model", help="the GPT preset the run trained (needed with hpZ or quantized all-gathers)")
    a = ap.parse_args()
    comm = traffic_model.Comm(a.gloo_reduce_scatter, a.ranks_per_host if a.hpz else a.reshard_after_forward_to,
                              a.quantize_all_gather, a.quantize_block)
    print(json.dumps(analyze(read_rows(a.jsonl), a.hosts, a.ranks_per_host, a.strategy, a.shard_size,
                             a.idle_bytes_per_s, a.skip_steps, not a.no_clip, a.mtu, comm, a.model), indent=1))


if __name__ == "__main__":
    main()
