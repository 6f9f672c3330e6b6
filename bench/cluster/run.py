"""fsdp on an emulated cluster (scripts/cluster): wire traffic per strategy and topology, and step
time against cross-host bandwidth.

    bench/cluster/run [--quick] [--out DIR] [--model small] [--repeats 3] [--only-comm | --no-comm]

Part 1, traffic: each strategy at 2 hosts x 2 ranks, 4 x 1 and 2 x 4, links at 1 Gbit/s. Per host
and step: the bytes its link sent and received (the kernel's counters, less the idle baseline
measured first), the exact volume of the configuration (traffic_model.py: the groups, Gloo's
algorithms, TCP/IP framing) and what fsdp's comm_bytes of the host's ranks add up to.

Part 2, bandwidth: each strategy at 2 x 2 with links at 20, 100 and 1000 Mbit/s: the median step
time (of each run's steps after the first two, then the median over runs, run in interleaved
order), the peak live tensor bytes per rank, and the speedup of hybrid sharding over full
sharding. Writes results.json, results.md and bandwidth.svg (and .png) to --out.

Part 3, issue 26's communication options (COMM_CONFIGS: full_shard with Gloo's old all-reduce
reduce-scatter beside fsdp's ring, the new default; + hpZ; + int8 all-gathers; all three; and
hybrid_shard): bytes per host link at 2 x 2 and 2 x 4 (1 Gbit/s) against the exact volume and M
(the fp32 parameters), step times at 2 x 2 with links at 20 and 100 Mbit/s. Writes
comm_features.json and comm_features.md. --only-comm runs this part alone (parts 1 and 2 take
most of the time); --no-comm leaves it out.

Part 4, issue 27's two dimensions (TP_CONFIGS): tensor parallelism inside each host (--tp 2, the
TP group on the host's loopback) with fsdp across the hosts, against full_shard and hybrid_shard
over all 4 ranks: bytes per host link at 2 x 2 (1 Gbit/s; the kernel's counters; fsdp's
comm_bytes of the host's ranks beside them, which count only fsdp's collectives, not TP's) and
the step time at 20 and 100 Mbit/s. Writes tp.json and tp.md. --only-tp runs this part alone.

Runs use the fsdp-train in build/bin with its defaults: since issue 26 its Gloo reduce-scatter is
the ring, so parts 1 and 2 measure that (the results record the flags the runs had).
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
import traffic_model  # noqa: E402

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"]

# Issue 26: (label, strategy, fsdp-train flags). "All three" is the ring reduce-scatter (the
# default), hpZ within the host and int8 all-gathers.
COMM_CONFIGS = [
    ("full_shard, all_reduce RS (before)", "full_shard", ["--gloo-reduce-scatter", "all_reduce"]),
    ("full_shard (ring RS)", "full_shard", []),
    ("full_shard + hpZ", "full_shard", ["--hpz"]),
    ("full_shard + int8 AG", "full_shard", ["--quantize-all-gather", "int8"]),
    ("full_shard + ring RS + hpZ + int8 AG", "full_shard", ["--hpz", "--quantize-all-gather", "int8"]),
    ("hybrid_shard", "hybrid_shard", []),
]
# Issue 27: (label, strategy, fsdp-train flags) at 2 hosts x 2 ranks.
TP_CONFIGS = [
    ("full_shard over 4 ranks", "full_shard", []),
    ("hybrid_shard (F = 2 in a host)", "hybrid_shard", []),
    ("TP 2 x DP 2, full_shard across hosts", "full_shard", ["--tp", "2"]),
    ("TP 2 x DP 2, no_shard across hosts", "no_shard", ["--tp", "2"]),
]
# The target: full_shard with all three at or below this many M per host link and step.
TARGET_M = 1.3


def comm_of(flags, per_host):
    """traffic_model.Comm of an fsdp-train command line's communication flags."""
    def value(name, default):
        return flags[flags.index(name) + 1] if name in flags else default
    hpz = per_host if "--hpz" in flags else int(value("--reshard-after-forward-to", 0))
    return traffic_model.Comm(value("--gloo-reduce-scatter", "ring"), hpz, value("--quantize-all-gather", "none"),
                              int(value("--quantize-block", 64)))


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


def part_comm_traffic(args, idle, log):
    out = []
    M = sum(n for n, _ in traffic_model.unit_numels(args.model, 1)) * 4  # the fp32 parameters
    for hosts, per_host in [(2, 2)] + ([] if args.quick else [(2, 4)]):
        for label, s, flags in COMM_CONFIGS:
            rows = train(hosts, per_host, "1gbit", s, args.model, args.steps, args.batch, flags)
            # Every row's exact volume from the model's units, so the configurations compare alike.
            a = traffic.analyze(rows, hosts, per_host, s, idle_bytes_per_s=idle, comm=comm_of(flags, per_host),
                                model=args.model, from_units=True)
            mean = lambda k: statistics.mean(h[k] for h in a["hosts"])  # noqa: E731
            rec = {"hosts": hosts, "per_host": per_host, "label": label, "strategy": s, "flags": flags, "F": a["F"],
                   "measured_tx": mean("measured_tx"), "measured_rx": mean("measured_rx"),
                   "predicted_tx": mean("predicted_tx"), "predicted_rx": mean("predicted_rx"),
                   "payload_tx": mean("payload_tx"), "comm_bytes_per_host": mean("comm_bytes_of_ranks"),
                   "comm_bytes_expected": mean("comm_bytes_of_ranks_expected"), "exact_from": a["exact_from"], "M": M}
            log("comm traffic %dx%d %-38s measured tx %9.0f (%.2f M)  exact %9.0f  (%.3f)" %
                (hosts, per_host, label, rec["measured_tx"], rec["measured_tx"] / M, rec["predicted_tx"],
                 rec["measured_tx"] / rec["predicted_tx"]))
            out.append(rec)
    return out


def configs_bandwidth(args, log, configs, what):
    """Each (label, strategy, flags) of `configs` at 2 x 2 with links at 20 and 100 Mbit/s, the
    configurations interleaved in each of --repeats rounds: median step (min, max) and peak."""
    rates = ["20mbit", "100mbit"]
    runs = {}
    for rep in range(args.repeats):
        for rate in rates:
            for label, s, flags in configs:
                rows = train(2, 2, rate, s, args.model, args.bw_steps, args.batch, flags)
                runs.setdefault((rate, label), []).append((step_ms(rows), peak_bytes(rows)))
                log("%s bandwidth rep %d %-8s %-40s step %.1f ms" % (what, rep, rate, label, runs[(rate, label)][-1][0]))
    out = []
    for label, s, flags in configs:
        for rate in rates:
            v = runs[(rate, label)]
            ms = [x[0] for x in v]
            out.append({"rate": rate, "label": label, "strategy": s, "flags": flags,
                        "step_ms_median": statistics.median(ms), "step_ms_min": min(ms), "step_ms_max": max(ms),
                        "peak_live_bytes": max(x[1] for x in v), "runs": len(v)})
    return out


def part_comm_bandwidth(args, log):
    return configs_bandwidth(args, log, COMM_CONFIGS, "comm")


def link_bytes(rows, hosts, G, idle, skip=1):
    """Mean bytes each host's link sent and received per step (the kernel's counters, read by the
    host's local rank 0, less the idle baseline), and what fsdp counted for the host's ranks."""
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], {})[r["rank"]] = r
    steps = [s for s in sorted(by_step) if s >= skip + min(by_step) and len(by_step[s]) == hosts * G]
    tx = rx = counted = 0.0
    for s in steps:
        for rank, row in by_step[s].items():
            counted += sum(row["comm_bytes"].values()) / len(steps) / hosts
            if row.get("local_rank", rank % G) == 0:
                idle_bytes = idle * row["step_ms"] / 1000.0
                tx += (sum(l["tx_bytes"] for l in row["links"].values()) - idle_bytes) / len(steps) / hosts
                rx += (sum(l["rx_bytes"] for l in row["links"].values()) - idle_bytes) / len(steps) / hosts
    return tx, rx, counted


def part_tp(args, idle, log):
    M = sum(n for n, _ in traffic_model.unit_numels(args.model, 1)) * 4  # the fp32 parameters
    out = {"traffic": [], "bandwidth": []}
    for label, s, flags in TP_CONFIGS:
        rows = train(2, 2, "1gbit", s, args.model, args.steps, args.batch, flags)
        tx, rx, counted = link_bytes(rows, 2, 2, idle)
        out["traffic"].append({"label": label, "strategy": s, "flags": flags, "measured_tx": tx, "measured_rx": rx,
                               "comm_bytes_per_host": counted, "M": M})
        log("tp traffic %-40s measured tx %9.0f (%.2f M)  fsdp counted %9.0f" % (label, tx, tx / M, counted))
    out["bandwidth"] = configs_bandwidth(args, log, TP_CONFIGS, "tp")
    return out


def step_time_table(bandwidth, configs, rates=("20mbit", "100mbit")):
    """Markdown rows: each configuration's median step (min-max) per link rate and its peak."""
    L = ["| configuration | " + " | ".join("%d Mbit/s" % mbit(r) for r in rates) + " | peak per rank |",
         "|---|" + "---|" * (len(rates) + 1)]
    for label, _, _ in configs:
        xs = [next(r for r in bandwidth if r["rate"] == rate and r["label"] == label) for rate in rates]
        L.append("| %s | %s | %.2f MB |" % (label, " | ".join("%.0f ms [%.0f-%.0f]" % (x["step_ms_median"], x["step_ms_min"],
                                                                                     x["step_ms_max"]) for x in xs),
                                            max(x["peak_live_bytes"] for x in xs) / 1e6))
    return L


def write_tp_markdown(res, path):
    L = ["Issue 27: 2 hosts x 2 ranks, `%s` GPT (M = %.1f KB of fp32 parameters), global batch %d; bytes per host "
         "link and step at 1 Gbit/s (idle baseline %.0f B/s subtracted)." % (res["model"], res["traffic"][0]["M"] / 1e3,
                                                                              res["batch"], res["idle_bytes_per_s"]), ""]
    L.append("| configuration | measured tx | measured rx | measured / M | fsdp comm_bytes of the host's ranks |")
    L.append("|---|---|---|---|---|")
    for r in res["traffic"]:
        L.append("| %s | %.1f KB | %.1f KB | %.2f | %.1f KB |" % (r["label"], r["measured_tx"] / 1e3, r["measured_rx"] / 1e3,
                                                               r["measured_tx"] / r["M"], r["comm_bytes_per_host"] / 1e3))
    L += ["", "Step time (median of %d runs; min-max in brackets) and peak live tensor bytes per rank:" % res["repeats"], ""]
    L += step_time_table(res["bandwidth"], TP_CONFIGS)
    open(path, "w").write("\n".join(L) + "\n")


def write_comm_markdown(res, path):
    L = ["Issue 26: per host link and training step, `%s` GPT (M = %.1f KB of fp32 parameters), global batch %d, "
         "links at 1 Gbit/s; idle baseline %.0f B/s subtracted." % (res["model"], res["traffic"][0]["M"] / 1e3,
                                                                   res["batch"], res["idle_bytes_per_s"]), ""]
    L.append("| hosts x ranks | configuration | measured tx | measured rx | exact volume | measured / exact | "
             "measured / M | payload (collectives) | fsdp comm_bytes of the host's ranks | the same, modelled |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["traffic"]:
        L.append("| %d x %d | %s | %.1f KB | %.1f KB | %.1f KB | %.3f | %.2f | %.1f KB | %.1f KB | %.1f KB |" % (
            r["hosts"], r["per_host"], r["label"], r["measured_tx"] / 1e3, r["measured_rx"] / 1e3,
            r["predicted_tx"] / 1e3, r["measured_tx"] / r["predicted_tx"], r["measured_tx"] / r["M"],
            r["payload_tx"] / 1e3, r["comm_bytes_per_host"] / 1e3, r["comm_bytes_expected"] / 1e3))
    L.append("")
    for r in res["traffic"]:
        if r["label"] == COMM_CONFIGS[4][0]:
            ratio = r["measured_tx"] / r["M"]
            L.append("Target (full_shard with all three at or below %.1f M per host link and step), %d x %d: "
                     "%.2f M, %s." % (TARGET_M, r["hosts"], r["per_host"], ratio, "met" if ratio <= TARGET_M else "NOT met"))
    L += ["", "Step time at 2 hosts x 2 ranks (median of %d runs; min-max in brackets) and peak live tensor bytes "
          "per rank:" % res["repeats"], ""]
    L += step_time_table(res["bandwidth"], COMM_CONFIGS)
    open(path, "w").write("\n".join(L) + "\n")


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
    ap.add_argument("--only-comm", action="store_true", help="only part 3 (issue 26's configurations)")
    ap.add_argument("--no-comm", action="store_true", help="parts 1 and 2 only (the strategies)")
    ap.add_argument("--only-tp", action="store_true", help="only part 4 (issue 27's tensor parallelism)")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 1
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()

    def log(msg):
        print("[%6.0f s] %s" % (time.time() - t0, msg), flush=True)

    idle = idle_baseline(2)
    log("idle baseline: %.1f bytes/s per host link" % idle)
    common = {"model": args.model, "batch": args.batch, "repeats": args.repeats, "idle_bytes_per_s": idle,
              "command": " ".join(["bench/cluster/run"] + sys.argv[1:])}
    if args.only_tp:
        res = dict(common)
        res.update(part_tp(args, idle, log))
        json.dump(res, open(os.path.join(args.out, "tp.json"), "w"), indent=1)
        write_tp_markdown(res, os.path.join(args.out, "tp.md"))
        log("wrote %s/tp.json and tp.md" % args.out)
        return
    if not args.only_comm:
        # Every run with fsdp-train's defaults (planner_check predicts them with these flags).
        res = dict(common, flags=[])
        res["traffic"] = part_traffic(args, idle, log)
        res["bandwidth"] = part_bandwidth(args, log)
        json.dump(res, open(os.path.join(args.out, "results.json"), "w"), indent=1)
        write_markdown(res, os.path.join(args.out, "results.md"))
        plot(res, os.path.join(args.out, "bandwidth"))
        log("wrote %s/results.json, results.md, bandwidth.svg and bandwidth.png" % args.out)
    if not args.no_comm:
        res = dict(common)
        res["traffic"] = part_comm_traffic(args, idle, log)
        res["bandwidth"] = part_comm_bandwidth(args, log)
        json.dump(res, open(os.path.join(args.out, "comm_features.json"), "w"), indent=1)
        write_comm_markdown(res, os.path.join(args.out, "comm_features.md"))
        log("wrote %s/comm_features.json and comm_features.md" % args.out)


if __name__ == "__main__":
    main()
