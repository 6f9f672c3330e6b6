"""The bytes each host's link must carry per training step, from what fsdp reports it issued.

fsdp's comm_bytes count what each collective was asked to move by the ring convention (an
all-gather or a reduce-scatter of M bytes over n ranks: (n-1)/n M per rank; an all-reduce: twice
that). What crosses a link between hosts depends on three more things, all modelled here:

1. Which rank talks to which. A shard group is F consecutive ranks and a replica group the ranks
   with the same place in their shard groups (fsdp's mesh); hosts hold G consecutive ranks.
2. Gloo's algorithms (torch 2.11, measured byte for byte on this machine with `ss -ti`):
   - all-gather: a ring, rank r sends to r+1 (group order): 2(n-1) messages of M/(2n) bytes.
   - all-reduce: a ring, rank r sends to r-1, in S = roundup(max(ceil(M / 1 MiB), 2n), n)
     segments: 2(S - S/n) messages of M/S bytes, 2(n-1)/n M in all.
   - reduce-scatter: ProcessGroupGloo runs it as an all-reduce of the whole input, then copies
     its chunk out: 2(n-1)/n M per rank, twice the ring convention (and twice NCCL's).
   - every message of N bytes costs N + 96 bytes forward (two 48-byte preambles) and 48 back.
3. TCP/IP over Ethernet: each packet carries at most MSS = MTU - 52 bytes of payload under 66
   bytes of headers (Ethernet 14, IPv4 20, TCP 20 + 12 of timestamps); the receiver acknowledges
   about every second full segment with a 66-byte packet.

Besides fsdp's collectives, fsdp-train all-reduces its loss (one float) over the world every step.
"""

import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "apps", "plan"))
from fsdp_plan import groups_of  # noqa: E402  (fsdp's mesh: shard and replica groups)

MIB = 1 << 20
HEADERS = 66          # Ethernet + IPv4 + TCP with timestamps
GLOO_SEND = 96        # two 48-byte preambles ahead of a message's payload
GLOO_ACK = 48         # the receiver's notification back
ACK_EVERY = 2         # delayed ACK: one per two full segments


def groups(kind, W, F):
    """The process groups a collective runs over, each a list of global ranks in group order."""
    shard, replicate = groups_of(W, F)
    return {"shard": shard, "replicate": replicate}.get(kind, [list(range(W))])


def messages(op, n, M):
    """(destination offset in the group ring, number of messages, payload bytes each) per rank."""
    if n == 1 or M == 0:
        return None
    if op == "all_gather":
        return (+1, 2 * (n - 1), M / (2 * n))
    # all_reduce, and reduce_scatter (Gloo: an all-reduce of the whole input)
    S = math.ceil(max(math.ceil(M / MIB), 2 * n) / n) * n
    return (-1, 2 * (S - S // n), M / S)


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


def predict(rows, W, G, F, strategy, clip=True, mtu=1500):
    """Per-host link bytes for one step, from each rank's fsdp-train JSONL row of that step.

    `rows`: {rank: row}, with comm_bytes and comm_calls per kind. Each kind's calls run over the
    groups fsdp uses: all-gathers and reduce-scatters over the shard group, the gradient all-reduce
    over the replicas (the world for no_shard), the gradient norm's over the shard group, the
    sequence check over the world."""
    hosts = W // G
    links = Links(mtu - 52)
    host_of = lambda r: r // G  # noqa: E731
    replicate_n = W // F if F > 1 else W
    for r in range(W):
        row = rows[r]
        cb, cc = row["comm_bytes"], row["comm_calls"]
        calls = []  # (op, group kind, n, total counted bytes, number of calls)
        calls.append(("all_gather", "shard", F, cb["all_gather"], cc["all_gather"]))
        calls.append(("reduce_scatter", "shard", F, cb["reduce_scatter"], cc["reduce_scatter"]))
        ar_calls, ar_bytes = cc["all_reduce"], cb["all_reduce"]
        if clip and F > 1:
            # The gradient norm: one fp32 scalar over the shard group.
            norm = 2 * 4 * (F - 1) / F
            calls.append(("all_reduce", "shard", F, norm, 1))
            ar_calls -= 1
            ar_bytes -= norm
        calls.append(("all_reduce", "replicate" if F > 1 else "world", replicate_n, ar_bytes, ar_calls))
        if cb.get("sequence_check", 0):
            calls.append(("all_reduce", "world", W, cb["sequence_check"], 1))
        calls.append(("all_reduce", "world", W, 2 * 4 * (W - 1) / W, 1))  # fsdp-train's loss
        for op, kind, n, counted, count in calls:
            if count <= 0 or n == 1:
                continue
            M = ring_convention_to_size(op, counted / count, n)  # the average call's size
            m = messages(op, n, M)
            if m is None:
                continue
            offset, msgs, each = m
            group = next(g for g in groups(kind, W, F) if r in g)
            dst = group[(group.index(r) + offset) % n]
            if host_of(dst) != host_of(r):
                links.add(host_of(r), host_of(dst), count * msgs, each)
    return links.host_bytes(hosts)
