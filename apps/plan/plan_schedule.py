"""fsdp-plan's step time: one training step replayed as events, the runtime's schedule of
all-gathers, computation and reductions on each group's workers and the shared host link."""

from plan_model import padded
from plan_network import groups_of, quantized_shard_bytes, secondary_groups

# Gloo process groups run this many collectives at once (src/comm/mesh_state.h, kGlooThreadsPerGroup).
GLOO_THREADS_PER_GROUP = 2


class Link:
    """A host link's time on the wire: when its busiest direction carries bytes. The links are full
    duplex and every ring loads a host's two directions alike (what its edges send out of the host
    equals what its other edges bring in), so one calendar per link stands for both directions.

    The link is busy only while bytes cross it. A collective's transfer is placed in the link's idle
    time from when it is ready, around the transfers placed before it (the bytes of collectives that
    run at once, on different threads, interleave on the wire), so the link's busy time is the sum
    of every transfer's bytes over its rate, whatever else each collective waits for."""

    def __init__(self):
        self.busy = []  # sorted, disjoint (start, end)

    def transfer(self, ready, duration):
        """Carries `duration` seconds of bytes from `ready` on, in the gaps between what is there;
        returns when the last byte has crossed."""
        if duration <= 0:
            return ready
        t, left, placed = ready, duration, []
        for a, b in self.busy:
            if b <= t:
                continue
            if a > t:
                take = min(a - t, left)
                placed.append((t, t + take))
                left -= take
                t += take
                if left <= 0:
                    break
            t = max(t, b)
        if left > 0:
            placed.append((t, t + left))
            t += left
        merged = []
        for a, b in sorted(self.busy + placed):
            if merged and a <= merged[-1][1] + 1e-15:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.busy = merged
        return t


def simulate(model, args, compute, net):
    """One step's events for rank 0. Returns a dict of times (s) and per-host-link bytes.

    Where a collective runs, as the runtime runs it. Each process group has its workers: NCCL runs
    one communicator's collectives one after another (one worker per group: an all-gather waits
    behind the reduce-scatter issued before it, which is why the paper prefetches in backward); ProcessGroupGloo runs up to
    kGlooThreadsPerGroup = 2 of a group's collectives at once, each on its own thread
    (src/comm/mesh_state.h), and fsdp's ring reduce-scatter runs on its own executor thread, one per
    Gloo group, one job after another (src/comm/ring_reduce_scatter.h). A collective starts when it
    is issued and a worker of its group is free. What it sends across hosts goes through the host
    link (Link): collectives running at once share the wire, each link's busy time being the sum
    of their bytes. A collective is done when its last byte has crossed and its per-message costs
    are paid (Cost.overlaps_wire: with Gloo over TCP these are the ranks' CPU time, which runs
    while the kernel drains the sockets' buffers onto the wire, so they overlap the wire time; with
    NCCL each ring step's latency comes before the step's transfer).

    Until issue 26's check the planner queued every collective that crossed a host link in one
    FIFO, each holding it for its wire time plus its per-message costs. On Gloo that serialized
    what the runtime runs at once. The per-message cost is CPU time, not wire time: full_shard at
    2 x 2 measured 76 ms a step at 1 Gbit/s and 92 ms at 100 Mbit/s, where its 1095 KB per host
    link take 87.6 ms on the wire alone, so the step is the wire time and the 39 messages' costs
    (35 ms in the FIFO with that day's calibration, 0.9 ms a message) hide under it, even in
    forward, where each gather runs alone. Adding them put the planner 27-43 % over every
    full_shard configuration at 100 Mbit/s; at 20 Mbit/s, with wire times 5x longer, they were a
    small error. Where a gather's bytes are few (int8 records: 41 KB per host link for a block,
    3.3 ms at 100 Mbit/s), its 6 messages' CPU cost is the longer of the two and sets its time.
    The threads matter less at this scale (a reduce-scatter's bytes can go under the next gather's
    per-message costs) but are what the runtime does."""
    W, F, strategy = args.world // args.tp, args.F, args.strategy  # fsdp's world: the data-parallel ranks
    shard, replicate = groups_of(W, F, args.tp)
    el_param = args.param_bytes
    el_reduce = args.reduce_bytes
    units = ["root"] + ["block%d" % i for i in range(model.layers)]
    numel = {"root": padded(model.root_params_local, F)}
    for i in range(model.layers):
        numel["block%d" % i] = padded(model.block_params_local, F)
    gathers = strategy in ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2") and F > 1
    reshard = strategy in ("full_shard", "hybrid_shard")
    replicas = W // F if F > 1 else W
    N = args.reshard_after_forward_to
    secondary = secondary_groups(W, N, args.tp) if N else None
    quantized = args.quantize_all_gather != "none"
    gloo = net.backend == "gloo"
    link_bytes = 0.0
    link = Link()
    # Each group's workers: when each is next free. The ring reduce-scatter's executor ("ring") is
    # a worker of its own beside the shard group's Gloo threads.
    per_group = GLOO_THREADS_PER_GROUP if gloo else 1
    workers = {"shard": [0.0] * per_group, "replicate": [0.0] * per_group, "secondary": [0.0] * per_group,
               "ring": [0.0]}
    in_flight_gathers = []

    def comm(t_issue, cost, group):
        """Runs collective `cost` (Network's) issued at t_issue on `group`'s next free worker;
        returns when it is done."""
        nonlocal link_bytes
        free = workers[group]
        i = min(range(len(free)), key=free.__getitem__)
        start = max(t_issue, free[i])
        if cost.overlaps_wire:
            # The CPU's per-message work beside the wire: done when both are.
            wire_done = link.transfer(start, cost.t_inter)
            done = max(wire_done, start + max(cost.t_intra, cost.t_messages))
        else:
            # Each ring step's latency, then its transfer: the link idles through the latencies,
            # which other groups' transfers may use.
            wire_done = link.transfer(start + cost.t_messages, cost.t_inter)
            done = max(wire_done, start + cost.t_messages + cost.t_intra)
        done += cost.t_after
        free[i] = done
        link_bytes += cost.link_bytes
        return done

    t = 0.0
    exposed = 0.0
    ag_done = {}

    def gather(u, t_issue, backward=False):
        if not gathers or u in ag_done:
            return
        # The rate limiter: at most limit gathers in flight; the issue waits for the oldest.
        if args.limit_all_gathers > 0:
            in_flight_gathers[:] = [x for x in in_flight_gathers if x > t_issue]
            while len(in_flight_gathers) >= args.limit_all_gathers:
                t_issue = max(t_issue, in_flight_gathers.pop(0))
        if backward and N:
            # hpZ: from the secondary shards, over N ranks, in the compute dtype.
            cost, group = net.all_gather(secondary, numel[u] * el_param), "secondary"
        elif quantized:
            # qwZ: each rank's P bytes gathered into F P; quantizing the shard and dequantizing
            # the whole unit delay the gather's completion (charged as part of it).
            cost, group = net.all_gather(shard, F * quantized_shard_bytes(numel[u] // F, args.quantize_block)), "shard"
            cost.t_after = (numel[u] // F + numel[u]) * args.quantize_s_per_element
        else:
            cost, group = net.all_gather(shard, numel[u] * el_param), "shard"
        ag_done[u] = comm(t_issue, cost, group)
        in_flight_gathers.append(ag_done[u])

    def wait(u):
        nonlocal t, exposed
        if u in ag_done and ag_done[u] > t:
            exposed += ag_done[u] - t
            t = ag_done[u]

    def reduce(u, t):
        M = numel[u] * el_reduce
        if F == 1:
            return comm(t, net.all_reduce(replicate, M), "replicate")
        ring = gloo and net.gloo_reduce_scatter == "ring"
        done = comm(t, net.reduce_scatter(shard, M), "ring" if ring else "shard")
        if replicas > 1:
            done = comm(done, net.all_reduce(replicate, M / F), "replicate")
        return done

    # Forward: the root (embeddings) first, then the blocks, then the head (root again).
    order = units[1:]
    gather("root", t)
    wait("root")
    t += compute["root_fwd"]
    for k, u in enumerate(order):
        gather(u, t)
        if args.forward_prefetch and k + 1 < len(order):
            gather(order[k + 1], t)
        wait(u)
        t += compute["fwd"][u]
        if reshard:
            ag_done.pop(u, None)
    # Backward: the head (root) first, then the blocks in reverse.
    t += compute["root_bwd"]
    reductions_done = 0.0
    rev = list(reversed(order))
    for k, u in enumerate(rev):
        if reshard:
            gather(u, t, backward=True)
        if args.backward_prefetch and reshard and k + 1 < len(rev):
            gather(rev[k + 1], t, backward=True)
        wait(u)
        t += compute["bwd"][u]
        reductions_done = max(reductions_done, reduce(u, t))
    reductions_done = max(reductions_done, reduce("root", t))
    end_backward = t
    if reductions_done > t:
        exposed += reductions_done - t
        t = reductions_done
    t += compute["optimizer"]
    return {"step_s": t, "backward_end_s": end_backward, "exposed_comm_s": exposed, "link_bytes": link_bytes}

