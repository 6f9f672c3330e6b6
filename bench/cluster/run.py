"""fsdp on an emulated cluster (scripts/cluster): wire traffic per strategy and topology, and step
time against cross-host bandwidth.

    bench/cluster/run [--quick] [--out DIR] [--model small] [--repeats 3]

Part 1, traffic: each strategy at 2 hosts x 2 ranks, 4 x 1 and 2 x 4, links at 1 Gbit/s. Per host
and step: the bytes its link sent and received (the kernel's counters, less the idle baseline
measured first), the exact volume of the configuration (traffic_model.py: the groups, Gloo's
algorithms, TCP/IP framing) and what fsdp's comm_bytes of the host's ranks add up to.

Part 2, bandwidth: each strategy at 2 x 2 with links at 20, 100 and 1000 Mbit/s: the median step
time (of each run's steps after the first two, then the median over runs, run in interleaved
order), the peak live tensor bytes per rank, and the speedup of hybrid sharding over full
sharding. Writes results.json, results.md and bandwidth.svg (and .png) to --out.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import traffic  # noqa: E402

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"]


def cluster(hosts, per_host, rate, program, timeout=600, counters=None):
    cmd = ["bash", os.path.join(ROOT, "scripts", "cluster"), "--hosts", str(hosts), "--ranks-per-host",
           str(per_host), "--bandwidth", rate, "--timeout", str(timeout)]
    if counters:
        cmd += ["--counters", counters]
    p = subprocess.run(cmd + ["--"] + program, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit("cluster run failed (%d): %s\n%s" % (p.returncode, " ".join(program), p.stderr[-3000:]))
    return p


def idle_baseline(hosts):
    """Bytes per second a host's link carries with the ranks idle (ARP and nothing else, expected)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "idle.jsonl")
        cluster(hosts, 1, "1gbit", ["sleep", "4"], counters=path)
        rows = [json.loads(l) for l in open(path)]
    start = {r["host"]: r for r in rows if r["phase"] == "start"}
    end = {r["host"]: r for r in rows if r["phase"] == "end"}
    rates = [(end[h]["tx_bytes"] - start[h]["tx_bytes"]) / (end[h]["time"] - start[h]["time"]) for h in start]
    return max(rates)


def train(hosts, per_host, rate, strategy, model, steps, batch, extra=()):
    with tempfile.TemporaryDirectory() as d:
        metrics = os.path.join(d, "m.jsonl")
        program = [os.path.join(ROOT, "build", "bin", "fsdp-train"), "--model", model, "--steps", str(steps),
                   "--global-batch-size", str(batch), "--strategy", strategy, "--log-every", "1000",
                   "--metrics-jsonl", metrics, "--run-dir", "none", "--sample-tokens", "0"] + list(extra)
        if strategy.startswith("hybrid"):
            program += ["--shard-size", str(per_host)]
        cluster(hosts, per_host, rate, program)
        return traffic.read_rows(metrics)


def step_ms(rows, skip=2):
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r["step_ms"])
    return statistics.median(max(v) for s, v in by_step.items() if s >= skip)


def peak_bytes(rows):
    return max(r["memory"]["peak_live_tensor_bytes"] - r["memory"]["live_before_model"] for r in rows if r["step"] >= 1)


def part_traffic(args, idle, log):
    out = []
    topologies = [(2, 2), (4, 1)] + ([] if args.quick else [(2, 4)])
    for hosts, per_host in topologies:
        for s in STRATEGIES:
            if s.startswith("hybrid") and per_host == 1:
                continue  # one rank per host: hybrid sharding within a host is replication
            rows = train(hosts, per_host, "1gbit", s, args.model, args.steps, args.batch)
            a = traffic.analyze(rows, hosts, per_host, s, idle_bytes_per_s=idle)
            h0 = a["hosts"][0]
            rec = {"hosts": hosts, "per_host": per_host, "strategy": s, "F": a["F"],
                   "measured_tx": statistics.mean(h["measured_tx"] for h in a["hosts"]),
                   "measured_rx": statistics.mean(h["measured_rx"] for h in a["hosts"]),
                   "predicted_tx": statistics.mean(h["predicted_tx"] for h in a["hosts"]),
                   "predicted_rx": statistics.mean(h["predicted_rx"] for h in a["hosts"]),
                   "payload_tx": statistics.mean(h["payload_tx"] for h in a["hosts"]),
                   "comm_bytes_per_host": statistics.mean(h["comm_bytes_of_ranks"] for h in a["hosts"]),
                   "host0": h0}
            log("traffic %dx%d %-18s measured tx %9.0f  exact %9.0f  (%.3f)  comm_bytes %9.0f" %
                (hosts, per_host, s, rec["measured_tx"], rec["predicted_tx"], rec["measured_tx"] / rec["predicted_tx"],
                 rec["comm_bytes_per_host"]))
            out.append(rec)
    return out


def part_bandwidth(args, log):
    rates = ["20mbit", "100mbit", "1gbit"]
    runs = {}
    for rep in range(args.repeats):
        for rate in rates:
            for s in STRATEGIES:
                rows = train(2, 2, rate, s, args.model, args.bw_steps, args.batch)
                runs.setdefault((rate, s), []).append((step_ms(rows), peak_bytes(rows)))
                log("bandwidth rep %d %-8s %-18s step %.1f ms" % (rep, rate, s, runs[(rate, s)][-1][0]))
    out = []
    for (rate, s), v in runs.items():
        ms = [x[0] for x in v]
        out.append({"rate": rate, "strategy": s, "step_ms_median": statistics.median(ms), "step_ms_min": min(ms),
                    "step_ms_max": max(ms), "peak_live_bytes": max(x[1] for x in v), "runs": len(v)})
    return out


def mbit(rate):
    return {"20mbit": 20, "100mbit": 100, "1gbit": 1000}[rate]


def write_markdown(res, path):
    L = []
    t = res["traffic"]
    L.append("Per host link and training step, `%s` GPT, global batch %d, links at 1 Gbit/s; idle baseline %.0f B/s "
             "subtracted." % (res["model"], res["batch"], res["idle_bytes_per_s"]))
    L.append("")
    L.append("| hosts x ranks | strategy | F | measured tx | measured rx | exact volume | measured / exact | "
             "payload (collectives) | fsdp comm_bytes of the host's ranks |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for r in t:
        L.append("| %d x %d | %s | %d | %.1f KB | %.1f KB | %.1f KB | %.3f | %.1f KB | %.1f KB |" % (
            r["hosts"], r["per_host"], r["strategy"], r["F"], r["measured_tx"] / 1e3, r["measured_rx"] / 1e3,
            r["predicted_tx"] / 1e3, r["measured_tx"] / r["predicted_tx"], r["payload_tx"] / 1e3,
            r["comm_bytes_per_host"] / 1e3))
    L.append("")
    b = res["bandwidth"]
    L.append("Step time at 2 hosts x 2 ranks (median of %d runs; min-max in brackets) and peak live tensor bytes "
             "per rank:" % res["repeats"])
    L.append("")
    rates = ["20mbit", "100mbit", "1gbit"]
    L.append("| strategy | " + " | ".join("%d Mbit/s" % mbit(r) for r in rates) + " | peak per rank |")
    L.append("|---|" + "---|" * (len(rates) + 1))
    for s in STRATEGIES:
        cells = []
        for rate in rates:
            x = next(r for r in b if r["rate"] == rate and r["strategy"] == s)
            cells.append("%.0f ms [%.0f-%.0f]" % (x["step_ms_median"], x["step_ms_min"], x["step_ms_max"]))
        peak = max(r["peak_live_bytes"] for r in b if r["strategy"] == s)
        L.append("| %s | %s | %.2f MB |" % (s, " | ".join(cells), peak / 1e6))
    L.append("")
    L.append("| link | full_shard / hybrid_shard step time | shard_grad_op / hybrid_shard_zero2 |")
    L.append("|---|---|---|")
    for rate in rates:
        g = {r["strategy"]: r["step_ms_median"] for r in b if r["rate"] == rate}
        L.append("| %d Mbit/s | %.2f | %.2f |" % (mbit(rate), g["full_shard"] / g["hybrid_shard"],
                                                 g["shard_grad_op"] / g["hybrid_shard_zero2"]))
    open(path, "w").write("\n".join(L) + "\n")


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    rates = ["20mbit", "100mbit", "1gbit"]
    for s in STRATEGIES:
        ys = [next(r for r in res["bandwidth"] if r["rate"] == rate and r["strategy"] == s)["step_ms_median"]
              for rate in rates]
        ax1.plot([mbit(r) for r in rates], ys, marker="o", label=s)
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("cross-host link (Mbit/s, each direction)")
    ax1.set_ylabel("step time (ms, median)")
    ax1.set_title("2 hosts x 2 ranks, `%s` GPT" % res["model"])
    ax1.legend(fontsize=8)
    peaks = {s: max(r["peak_live_bytes"] for r in res["bandwidth"] if r["strategy"] == s) / 1e6 for s in STRATEGIES}
    slow = {s: next(r for r in res["bandwidth"] if r["rate"] == "20mbit" and r["strategy"] == s)["step_ms_median"]
            for s in STRATEGIES}
    for s in STRATEGIES:
        ax2.scatter(peaks[s], 1000.0 / slow[s], s=40)
        ax2.annotate(s, (peaks[s], 1000.0 / slow[s]), fontsize=8)
    ax2.set_xlabel("peak live tensor MB per rank")
    ax2.set_ylabel("steps per second at 20 Mbit/s")
    ax2.set_title("memory against throughput (the paper's Fig. 7 trade-off)")
    fig.tight_layout()
    fig.savefig(path + ".svg")
    fig.savefig(path + ".png", dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "bench-cluster"))
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--bw-steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="no 2 x 4 topology, one repeat")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 1
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()

    def log(msg):
        print("[%6.0f s] %s" % (time.time() - t0, msg), flush=True)

    idle = idle_baseline(2)
    log("idle baseline: %.1f bytes/s per host link" % idle)
    res = {"model": args.model, "batch": args.batch, "repeats": args.repeats, "idle_bytes_per_s": idle,
           "command": " ".join(["bench/cluster/run"] + sys.argv[1:])}
    res["traffic"] = part_traffic(args, idle, log)
    res["bandwidth"] = part_bandwidth(args, log)
    json.dump(res, open(os.path.join(args.out, "results.json"), "w"), indent=1)
    write_markdown(res, os.path.join(args.out, "results.md"))
    plot(res, os.path.join(args.out, "bandwidth"))
    log("wrote %s/results.json, results.md, bandwidth.svg and bandwidth.png" % args.out)


if __name__ == "__main__":
    main()
