"""The bytes each host's link must carry per training step, from what fsdp reports it issued or
from the configuration alone.

fsdp's comm_bytes count what each collective was asked to move by the ring convention (an
all-gather or a reduce-scatter of M bytes over n ranks: (n-1)/n M per rank; an all-reduce: twice
that). What crosses a link between hosts depends on three more things, all modelled here:

1. Which rank talks to which. A shard group is F consecutive ranks and a replica group the ranks
   with the same place in their shard groups (fsdp's mesh); hosts hold G consecutive ranks. With
   hpZ (--reshard-after-forward-to N), backward's all-gathers run over a secondary group of N
   consecutive global ranks (the host when N = G).
2. Gloo's algorithms (torch 2.11, measured byte for byte on this machine with `ss -ti`):
   - all-gather: a ring, rank r sends to r+1 (group order): 2(n-1) messages of M/(2n) bytes.
   - all-reduce: a ring, rank r sends to r-1, in S = roundup(max(ceil(M / 1 MiB), 2n), n)
     segments: 2(S - S/n) messages of M/S bytes, 2(n-1)/n M in all.
   - reduce-scatter, two ways (fsdp-train --gloo-reduce-scatter):
     ring (the default): fsdp's own ring over Gloo send/recv, rank r sends to r+1, n-1 messages
       of M/n bytes: (n-1)/n M per rank, as NCCL's.
     all_reduce (before issue 26): ProcessGroupGloo's, an all-reduce of the whole input, then a
       copy of its chunk: 2(n-1)/n M per rank, twice the ring convention.
   - every message of N bytes costs N + 96 bytes forward (two 48-byte preambles) and 48 back
     (assumed the same for the ring reduce-scatter's unbound-buffer sends as for the all-gather's).
3. TCP/IP over Ethernet: each packet carries at most MSS = MTU - 52 bytes of payload under 66
   bytes of headers (Ethernet 14, IPv4 20, TCP 20 + 12 of timestamps); the receiver acknowledges
   about every second full segment with a 66-byte packet.

qwZ (--quantize-all-gather int8|fp8) changes what the parameter all-gathers move: each rank's
shard of s elements becomes P = s + 4 ceil(s / B) bytes (one byte per element, one fp32 scale per
block of B), gathered with the same ring all-gather (n P bytes). It applies to forward's gathers,
and to backward's when hpZ is off; hpZ's backward gathers move the secondary shards unquantized,
in the compute dtype.

Besides fsdp's collectives, fsdp-train all-reduces its loss (one float) over the world every step.

Two ways in: predict(rows, ...) from each rank's fsdp-train JSONL row (what fsdp counted), for
the configurations whose calls the counters tell apart; predict_config(...) from the model's units
alone, for every configuration. `python traffic_model.py` prints the issue-26 table (--help).
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "apps", "plan"))
import fsdp_plan  # noqa: E402  (fsdp's mesh, the GPT presets' units)
from fsdp_plan import groups_of  # noqa: E402  (fsdp's mesh: shard and replica groups)

MIB = 1 << 20
HEADERS = 66          # Ethernet + IPv4 + TCP with timestamps
GLOO_SEND = 96        # two 48-byte preambles ahead of a message's payload
GLOO_ACK = 48         # the receiver's notification back
ACK_EVERY = 2         # delayed ACK: one per two full segments


class Comm:
    """fsdp-train's communication options (issue 26), with its defaults.

    gloo_reduce_scatter: "ring" (fsdp's own ring, the default) or "all_reduce" (ProcessGroupGloo's,
    the behaviour before issue 26). hpz: N of --reshard-after-forward-to (0: off). quantize: the
    parameter all-gathers' format, "none", "int8" or "fp8" (both one byte per element); block: B."""

    def __init__(self, gloo_reduce_scatter="ring", hpz=0, quantize="none", block=64):
        self.gloo_reduce_scatter, self.hpz, self.quantize, self.block = gloo_reduce_scatter, hpz, quantize, block


def groups(kind, W, F, N=0):
    """The process groups a collective runs over, each a list of global ranks in group order."""
    shard, replicate = groups_of(W, F)
    if kind == "secondary":  # hpZ: N consecutive global ranks
        return [list(range(k * N, (k + 1) * N)) for k in range(W // N)]
    return {"shard": shard, "replicate": replicate}.get(kind, [list(range(W))])


def messages(op, n, M, gloo_reduce_scatter="ring"):
    """(destination offset in the group ring, number of messages, payload bytes each) per rank."""
    if n == 1 or M == 0:
        return None
    if op == "all_gather":
        return (+1, 2 * (n - 1), M / (2 * n))
    if op == "reduce_scatter" and gloo_reduce_scatter == "ring":
        return (+1, n - 1, M / n)
    # all_reduce, and reduce_scatter run as ProcessGroupGloo's (an all-reduce of the whole input)
    S = math.ceil(max(math.ceil(M / MIB), 2 * n) / n) * n
    return (-1, 2 * (S - S // n), M / S)


def quantized_shard_bytes(shard_numel, block):
    """qwZ: what one rank contributes to a quantized all-gather, P: an fp32 scale per block of
    `block` elements and a byte per element, the record padded to a multiple of 4 bytes so that
    every rank's scales stay aligned (src/comm/quantized_all_gather.h)."""
    return (4 * math.ceil(shard_numel / block) + shard_numel + 3) // 4 * 4


class Links:
    """Per directed pair of hosts: payload, Gloo framing, TCP segments."""

    def __init__(self, mss):
        self.mss = mss
        self.flows = {}   # (src_host, dst_host) -> dict

    def add(self, src, dst, count, payload_each):
        # Forward: the message and its preambles; back: Gloo's 48-byte notification.
        fwd = self.flows.setdefault((src, dst), {"payload": 0.0, "gloo": 0.0, "segments": 0.0})
        fwd["payload"] += count * payload_each
        fwd["gloo"] += count * GLOO_SEND
        fwd["segments"] += count * max(1, math.ceil((payload_each + GLOO_SEND) / self.mss))
        back = self.flows.setdefault((dst, src), {"payload": 0.0, "gloo": 0.0, "segments": 0.0})
        back["gloo"] += count * GLOO_ACK
        back["segments"] += count

    def host_bytes(self, hosts):
        """{host: {"tx": bytes, "rx": bytes, "payload_tx": ..}} on each host's link."""
        out = {h: {"tx": 0.0, "rx": 0.0, "payload_tx": 0.0, "payload_rx": 0.0} for h in range(hosts)}
        for (s, d), f in self.flows.items():
            wire = f["payload"] + f["gloo"] + HEADERS * f["segments"]
            acks = HEADERS * f["segments"] / ACK_EVERY   # from d back to s
            out[s]["tx"] += wire
            out[d]["rx"] += wire
            out[d]["tx"] += acks
            out[s]["rx"] += acks
            out[s]["payload_tx"] += f["payload"]
            out[d]["payload_rx"] += f["payload"]
        return out


def ring_convention_to_size(op, counted, n):
    """The collective's size M from the bytes fsdp counted for it on one rank (ring convention)."""
    if n == 1:
        return 0.0
    return counted * n / ((2 if op == "all_reduce" else 1) * (n - 1))


def add_calls(links, calls, W, G, F, r, comm):
    """Load `links` with rank r's calls: (op, group kind, n, M bytes per call, number of calls)."""
    host_of = lambda x: x // G  # noqa: E731
    for op, kind, n, M, count in calls:
        if count <= 0 or n == 1:
            continue
        m = messages(op, n, M, comm.gloo_reduce_scatter)
        if m is None:
            continue
        offset, msgs, each = m
        group = next(g for g in groups(kind, W, F, comm.hpz) if r in g)
        dst = group[(group.index(r) + offset) % n]
        if host_of(dst) != host_of(r):
            links.add(host_of(r), host_of(dst), count * msgs, each)


def small_calls(W, F, clip, sequence_check=16, loss=True):
    """The gradient norm (one fp32 over the shard group, with clipping and F > 1), the end-of-backward
    sequence check (two int64 over the world) and fsdp-train's loss (one fp32 over the world; not
    fsdp's, so not in its comm_bytes)."""
    calls = []
    if clip and F > 1:
        calls.append(("all_reduce", "shard", F, 4, 1))
    if sequence_check:
        calls.append(("all_reduce", "world", W, sequence_check, 1))
    if loss:
        calls.append(("all_reduce", "world", W, 4, 1))
    return calls


def predict(rows, W, G, F, strategy, clip=True, mtu=1500, comm=None):
    """Per-host link bytes for one step, from each rank's fsdp-train JSONL row of that step.

    `rows`: {rank: row}, with comm_bytes and comm_calls per kind. Each kind's calls run over the
    groups fsdp uses: all-gathers and reduce-scatters over the shard group, the gradient all-reduce
    over the replicas (the world for no_shard), the gradient norm's over the shard group, the
    sequence check over the world. The counters sum every all-gather of a step into one figure, so
    this way in takes only configurations whose all-gathers are all alike (no hpZ, no quantized
    gathers: predict_config takes those); the reduce-scatter's algorithm comes from `comm`."""
    comm = comm or Comm()
    if comm.hpz or comm.quantize != "none":
        raise ValueError("traffic_model.predict: hpZ and quantized all-gathers need predict_config (the model's units)")
    hosts = W // G
    links = Links(mtu - 52)
    replicate_n = W // F if F > 1 else W
    for r in range(W):
        row = rows[r]
        cb, cc = row["comm_bytes"], row["comm_calls"]
        calls = []  # (op, group kind, n, M of the average call, number of calls)

        def counted(op, kind, n, total, count):
            if count > 0 and n > 1:
                calls.append((op, kind, n, ring_convention_to_size(op, total / count, n), count))

        counted("all_gather", "shard", F, cb["all_gather"], cc["all_gather"])
        counted("reduce_scatter", "shard", F, cb["reduce_scatter"], cc["reduce_scatter"])
        ar_calls, ar_bytes = cc["all_reduce"], cb["all_reduce"]
        if clip and F > 1:
            # The gradient norm: one fp32 scalar over the shard group (added below).
            ar_calls -= 1
            ar_bytes -= 2 * 4 * (F - 1) / F
        counted("all_reduce", "replicate" if F > 1 else "world", replicate_n, ar_bytes, ar_calls)
        seq = ring_convention_to_size("all_reduce", cb.get("sequence_check", 0), W) if W > 1 else 0
        calls += small_calls(W, F, clip, sequence_check=seq)
        add_calls(links, calls, W, G, F, r, comm)
    return links.host_bytes(hosts)


def shard_size(strategy, W, G, F=0):
    """fsdp's F for a strategy (the hybrid ones shard within --shard-size, default the host)."""
    if strategy in ("full_shard", "shard_grad_op"):
        return W
    if strategy == "no_shard":
        return 1
    return F or G


def unit_numels(model_name, F):
    """[(padded numel, is root)] of a GPT preset's units (the root: embeddings and ln_f; a unit per
    block), each padded to a multiple of F as fsdp's flat parameters are."""
    v, seq, L, heads, d, dff = fsdp_plan.MODELS[model_name]
    m = fsdp_plan.Model(model_name, v, seq, L, heads, d, dff, t5=model_name.startswith("t5"))
    return [(fsdp_plan.padded(m.root_params, F), True)] + [(fsdp_plan.padded(m.block_params, F), False)] * L


def check_comm(strategy, F, comm):
    N = comm.hpz
    if N and (strategy not in ("full_shard", "hybrid_shard") or F % N or N >= F):
        raise ValueError("hpZ: --reshard-after-forward-to %d needs full_shard or hybrid_shard and N dividing F = %d, "
                         "N < F" % (N, F))


def config_calls(units, W, F, strategy, comm, clip=True, compute_bytes=4, reduce_bytes=4, loss=True):
    """Every collective one rank issues in one step of fsdp-train, from the units alone:
    (op, group kind, n, M bytes, number of calls). `compute_bytes`: the compute dtype's element size
    (what unquantized gathers move: 4 in fp32, 2 with bf16 mixed precision); `reduce_bytes`: the
    reduce dtype's."""
    check_comm(strategy, F, comm)
    calls = []
    gathers = F > 1 and strategy != "no_shard"
    reshard = strategy in ("full_shard", "hybrid_shard")
    replicate_n = W // F if F > 1 else W

    def param_gather(padded, quantized):
        if quantized:  # each rank's P bytes, gathered into F P
            return F * quantized_shard_bytes(padded // F, comm.block)
        return padded * compute_bytes

    quantize = comm.quantize != "none"
    for padded, root in units:
        if gathers:
            calls.append(("all_gather", "shard", F, param_gather(padded, quantize), 1))  # forward
            if reshard and not root:  # backward gathers again what forward freed (never the root)
                if comm.hpz:
                    calls.append(("all_gather", "secondary", comm.hpz, padded * compute_bytes, 1))
                else:
                    calls.append(("all_gather", "shard", F, param_gather(padded, quantize), 1))
        if F > 1:
            calls.append(("reduce_scatter", "shard", F, padded * reduce_bytes, 1))
            if replicate_n > 1:  # the replicas all-reduce each unit's gradient shard
                calls.append(("all_reduce", "replicate", replicate_n, padded // F * reduce_bytes, 1))
        else:
            calls.append(("all_reduce", "world", W, padded * reduce_bytes, 1))
    return calls + small_calls(W, F, clip, sequence_check=16 if W > 1 else 0, loss=loss)


def predict_config(model_name, hosts, G, strategy, comm=None, F=0, clip=True, mtu=1500, compute_bytes=4,
                   reduce_bytes=4):
    """Per-host link bytes for one step of a GPT preset, from its units and the configuration."""
    comm = comm or Comm()
    W = hosts * G
    F = shard_size(strategy, W, G, F)
    units = unit_numels(model_name, F)
    links = Links(mtu - 52)
    calls = config_calls(units, W, F, strategy, comm, clip, compute_bytes, reduce_bytes)
    for r in range(W):
        add_calls(links, calls, W, G, F, r, comm)
    return links.host_bytes(hosts)


def counted_comm_bytes(model_name, hosts, G, strategy, comm=None, F=0, clip=True, compute_bytes=4, reduce_bytes=4):
    """What fsdp's comm_bytes of one rank should add up to per step (the ring convention, whatever
    the algorithm: (n-1)/n M for an all-gather or a reduce-scatter, twice that for an all-reduce;
    quantized all-gathers count their packed bytes): a check of the counters against the model."""
    comm = comm or Comm()
    W = hosts * G
    F = shard_size(strategy, W, G, F)
    calls = config_calls(unit_numels(model_name, F), W, F, strategy, comm, clip, compute_bytes, reduce_bytes, loss=False)
    return sum(M * count * (2 if op == "all_reduce" else 1) * (n - 1) / n for op, _, n, M, count in calls)


# The issue-26 configurations: (label, strategy, Comm).
ISSUE26 = [
    ("full_shard, all_reduce reduce-scatter (before)", "full_shard", Comm(gloo_reduce_scatter="all_reduce")),
    ("full_shard, ring reduce-scatter", "full_shard", Comm()),
    ("full_shard + hpZ (N = ranks per host)", "full_shard", "hpz"),
    ("full_shard + int8 all-gather", "full_shard", Comm(quantize="int8")),
    ("full_shard + ring RS + hpZ + int8", "full_shard", "all"),
    ("hybrid_shard (ring reduce-scatter)", "hybrid_shard", Comm()),
]


def issue26_comm(spec, G):
    """The Comm of an ISSUE26 entry on hosts of G ranks ("hpz": N = G)."""
    if spec == "hpz":
        return Comm(hpz=G)
    if spec == "all":
        return Comm(hpz=G, quantize="int8")
    return spec


def issue26_table(model_name="small", topologies=((2, 2), (2, 4)), mtu=1500):
    """Rows of the issue-26 table: predicted bytes per host link and step (the mean over hosts; they
    are symmetric), the collectives' payload among them, and both over M (the fp32 parameters)."""
    M = sum(n for n, _ in unit_numels(model_name, 1)) * 4
    rows = []
    for hosts, G in topologies:
        for label, strategy, spec in ISSUE26:
            comm = issue26_comm(spec, G)
            h = predict_config(model_name, hosts, G, strategy, comm, mtu=mtu)
            tx = sum(x["tx"] for x in h.values()) / hosts
            payload = sum(x["payload_tx"] for x in h.values()) / hosts
            rows.append({"hosts": hosts, "per_host": G, "label": label, "strategy": strategy, "tx": tx,
                         "payload": payload, "M": M, "tx_over_M": tx / M, "payload_over_M": payload / M})
    return rows


# docs/performance.md, "Bytes on the wire" (issue 12): the exact volume per host link, in KB, of
# each configuration as Gloo ran it then (its reduce-scatter an all-reduce), for --check-old.
ISSUE12_EXACT_KB = {
    (2, 2, "full_shard"): 1510.9, (2, 2, "shard_grad_op"): 1185.5, (2, 2, "no_shard"): 790.3,
    (2, 2, "hybrid_shard"): 529.6, (2, 2, "hybrid_shard_zero2"): 529.6,
    (4, 1, "full_shard"): 1510.9, (4, 1, "shard_grad_op"): 1185.5, (4, 1, "no_shard"): 790.3,
    (2, 4, "full_shard"): 1804.1, (2, 4, "shard_grad_op"): 1425.2, (2, 4, "no_shard"): 950.2,
    (2, 4, "hybrid_shard"): 551.2, (2, 4, "hybrid_shard_zero2"): 551.2,
}


def main():
    ap = argparse.ArgumentParser(description="Predicted bytes per host link and step (issue 26's configurations, or "
                                             "issue 12's with the reduce-scatter Gloo ran then).")
    ap.add_argument("--model", default="small", choices=sorted(fsdp_plan.MODELS))
    ap.add_argument("--check-old", action="store_true",
                    help="issue 12's configurations with --gloo-reduce-scatter all_reduce, against docs/performance.md")
    ap.add_argument("--mtu", type=int, default=1500)
    a = ap.parse_args()
    if a.check_old:
        print("| hosts x ranks | strategy | exact volume (docs, issue 12) | from the units, all_reduce RS | ratio | "
              "ring RS |")
        print("|---|---|---|---|---|---|")
        for (hosts, G, strategy), kb in ISSUE12_EXACT_KB.items():
            old = predict_config(a.model, hosts, G, strategy, Comm(gloo_reduce_scatter="all_reduce"), mtu=a.mtu)
            new = predict_config(a.model, hosts, G, strategy, Comm(), mtu=a.mtu)
            tx_old = sum(x["tx"] for x in old.values()) / hosts / 1e3
            tx_new = sum(x["tx"] for x in new.values()) / hosts / 1e3
            print("| %d x %d | %s | %.1f KB | %.1f KB | %.4f | %.1f KB |" % (hosts, G, strategy, kb, tx_old, tx_old / kb,
                                                                          tx_new))
        return
    rows = issue26_table(a.model, mtu=a.mtu)
    print("`%s` GPT, fp32, M = %.1f KB of parameters; bytes per host link and step (tx; rx is the same), Gloo, "
          "MTU %d:\n" % (a.model, rows[0]["M"] / 1e3, a.mtu))
    print("| hosts x ranks | configuration | exact volume | / M | payload (collectives) | / M |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| %d x %d | %s | %.1f KB | %.2f | %.1f KB | %.2f |" % (r["hosts"], r["per_host"], r["label"], r["tx"] / 1e3,
                                                                    r["tx_over_M"], r["payload"] / 1e3, r["payload_over_M"]))


if __name__ == "__main__":
    main()
