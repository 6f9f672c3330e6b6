#!/usr/bin/env python3
"""Checkpoint save and load, side by side: our fsdp (build/bin/fsdp-train) against PyTorch FSDP2
(fully_shard) with torch.distributed.checkpoint (DCP), on the same GPT at the same world size.

For each model, with full_shard over W ranks on CPU (Gloo), the median over --repeats runs of:

  fsdp  save, sharded, synchronous  the training loop's stall per save (fsdp-train's
                                    checkpoint_stall_ms, the slowest rank's per save)
  fsdp  save, sharded, asynchronous the stall only: the copy to host memory. The write itself runs
                                    on a background thread and is NOT in this number
  fsdp  save, full                  rank 0 gathers the whole model and writes one file
  fsdp  load, sharded               load_checkpoint's time as `fsdp-train --resume CKPT --steps K`
                                    reports it (K = the checkpoint's step, so no step runs)
  DCP   dcp.save                    get_state_dict + dcp.save with the default FileSystemWriter
  DCP   dcp.async_save              get_state_dict + dcp.async_save until it returns
  DCP   dcp.load                    get_state_dict + dcp.load + set_state_dict

MB is the size of one checkpoint folder (10^6 bytes), MB/s that size over the median seconds.
Both sides start from the very same weights (`fsdp-train --export-init`) and save after training
steps, so that the optimizer has its state.

Run with the project's interpreter, e.g.
    bench/checkpoint --models tiny --repeats 1
(a wrapper that picks ~/.cache/fsdp/venv-torch-2.11.0/bin/python). Exit status: 0 when every
measurement ran, 2 when one failed (its error and output tail are printed; the rest still runs).
"""

import argparse
import json
import re
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The GPT port, its loss, the loader for libtorch's files and fsdp-train's weight-decay rule come
# from the training comparison, so that both benchmarks run the very same PyTorch model.
from vs_pytorch import GPT, REPO, fsdp_train_adamw, load_pt, lm_loss, this_command_line

MB = 1e6
FSDP = "fsdp (fsdp-train)"
DCP = "PyTorch FSDP2 + DCP"


class RunFailed(Exception):
    """One measurement could not be taken: str() is a one-line reason, .detail the output's tail."""

    def __init__(self, message, detail=""):
        super().__init__(message)
        self.detail = detail


def log(msg):
    # Progress goes to stderr: stdout carries only the report, so that it can be redirected.
    print(msg, file=sys.stderr, flush=True)


def output_tail(text, n=25):
    # libtorch errors end in a long C++ stack trace whose frames say nothing a reader can act on.
    lines = [l for l in (text or "").strip().splitlines() if not l.lstrip().startswith("frame #")]
    return "\n".join(lines[-n:])


def folder_bytes(path):
    """Bytes of every file under path: for a checkpoint, manifest + model/ + optim/ (or DCP's
    .metadata + *.distcp). Apparent sizes, which is what was written, not what the file system
    rounds up to."""
    if not os.path.isdir(path):
        raise RunFailed(f"expected a checkpoint folder at {path}, found none")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------------
# Our fsdp: every measurement is one fsdp-train process tree

def run_fsdp_train(cmd, log_path, timeout):
    """Runs cmd; returns (wall seconds, stdout). Raises RunFailed with the stderr tail on failure."""
    t0 = time.perf_counter()
    # A session of its own: fsdp-train spawns its ranks, and on a timeout the whole tree must go,
    # not just the launcher (a left-over rank would keep its memory and cores).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RunFailed(f"timed out after {timeout} s: {shlex.join(cmd)}", output_tail(err) or output_tail(out))
    wall = time.perf_counter() - t0
    with open(log_path, "w") as f:
        f.write(out + ("\n--- stderr ---\n" + err if err else ""))
    if proc.returncode != 0:
        reason = f"exit {proc.returncode}"
        said = [l for l in (err + "\n" + out).splitlines() if "error" in l.lower() and not l.lstrip().startswith("frame #")]
        if said:
            reason += ": " + said[0].strip()
        raise RunFailed(f"{reason}\n  command: {shlex.join(cmd)}\n  log: {log_path}",
                        output_tail(err) or output_tail(out))
    return wall, out


def save_stalls(metrics_path, W, expected_steps):
    """Per save, in step order: the slowest rank's checkpoint_stall_ms, in seconds. A save
    holds the training loop of every rank until all have taken part, so the slowest rank is the
    stall the job sees."""
    per_step = {}
    with open(metrics_path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if "checkpoint_stall_ms" in r:
                    per_step.setdefault(r["step"], {})[r["rank"]] = r["checkpoint_stall_ms"]
    if sorted(per_step) != expected_steps:
        raise RunFailed(f"{metrics_path}: saves at steps {sorted(per_step)}, expected {expected_steps}")
    short = {s: sorted(ranks) for s, ranks in per_step.items() if len(ranks) != W}
    if short:
        raise RunFailed(f"{metrics_path}: not every one of {W} ranks recorded each save: {short}")
    return [max(per_step[s].values()) / 1000.0 for s in sorted(per_step)]


def measure_fsdp(args, model, mdir, commands):
    """Returns {operation: {"s": [seconds...], "bytes": [...]}} plus "params", "async_waiting"."""
    W = args.nproc
    common = [args.fsdp_train, "--model", model, "--nproc-per-node", str(W), "--strategy", "full_shard",
              "--global-batch-size", str(args.global_batch_size), "--block-size", str(args.block_size),
              "--seed", str(args.seed), "--log-every", "1000", "--run-dir", "none", "--sample-tokens", "0"]
    # fsdp-train saves every --save-every steps and after the last; the metrics must show exactly these.
    expected = sorted({s for s in range(args.steps)
                       if (args.save_every > 0 and (s + 1) % args.save_every == 0) or s + 1 == args.steps})
    last = f"step-{args.steps:08d}"  # fsdp's folder name for the checkpoint after the last step
    variants = [("sync", ["--checkpoint-kind", "sharded"]),
                ("async", ["--checkpoint-kind", "sharded", "--async-save"]),
                ("full", ["--checkpoint-kind", "full"])]
    res = {k: {"s": [], "bytes": []} for k in ("sync", "async", "full", "load")}
    res["async_waiting"] = []  # async stalls of later saves, which wait for the previous write
    res["params"] = None
    for r in range(args.repeats):
        # The variants alternate within a repeat, so that a slow spell of the machine hits all.
        for name, flags in variants:
            save_dir = os.path.join(mdir, f"fsdp-{name}-{r}")
            metrics = save_dir + ".jsonl"
            if os.path.exists(metrics):
                os.remove(metrics)  # fsdp-train appends
            cmd = common + ["--steps", str(args.steps), "--save-dir", save_dir, "--save-every", str(args.save_every),
                            "--metrics-jsonl", metrics] + flags
            if r == 0:
                commands.append(shlex.join(cmd))
            try:
                t0 = time.time()
                _, out = run_fsdp_train(cmd, save_dir + ".log", args.timeout)
                if res["params"] is None:
                    res["params"] = parse_params(out)
                stalls = save_stalls(metrics, W, expected)
                ckpt = os.path.join(save_dir, last)
                res[name]["bytes"].append(folder_bytes(ckpt))
                if name == "async":
                    # fsdp's save() first waits for the previous asynchronous write: only the first
                    # save of a run is the copy to host memory alone.
                    res["async"]["s"].append(stalls[0])
                    res["async_waiting"] += stalls[1:]
                else:
                    res[name]["s"] += stalls
                log(f"  {model} run {r + 1}: fsdp {name:5s} save stall(s) "
                    f"{', '.join(f'{s * 1000:.0f}' for s in stalls)} ms  ({time.time() - t0:.0f} s)")
                if name == "sync":
                    measure_fsdp_load(args, common, ckpt, res, commands if r == 0 else None, save_dir, model, r)
            finally:
                if not args.keep:
                    shutil.rmtree(save_dir, ignore_errors=True)
    return res


def measure_fsdp_load(args, common, ckpt, res, commands, save_dir, model, r):
    """The load time of ckpt as fsdp-train reports it: load_checkpoint on rank 0, from the call to
    its return (read the manifest, check sizes and checksums, read this rank's pieces, agree across
    ranks, copy into the shards and the optimizer). The ranks agree before returning, so rank 0's
    time is the slowest rank's. Like DCP's row below: the model is built before, and timed apart."""
    resume = common + ["--steps", str(args.steps), "--resume", ckpt]
    if commands is not None:
        commands.append(shlex.join(resume))
    times = []
    for _ in range(args.load_pairs):
        _, out = run_fsdp_train(resume, save_dir + ".resume.log", args.timeout)
        m = re.search(r"resumed from (\S+) at step (\d+) \(loaded in (\d+) ms\)", out)
        # A resume that silently started from scratch would look like an instant load.
        if not m or m.group(1) != ckpt or int(m.group(2)) != args.steps:
            raise RunFailed(f"fsdp-train --resume {ckpt} did not report resuming at step {args.steps}",
                            output_tail(out))
        times.append(int(m.group(3)) / 1000.0)
    res["load"]["s"].append(median(times))
    res["load"]["bytes"].append(folder_bytes(ckpt))
    log(f"  {model} run {r + 1}: fsdp load {median(times):.3f} s (median of {args.load_pairs})")


def parse_params(out):
    # "fsdp-train: GPT 'tiny' 34688 parameters, ..."
    for line in out.splitlines():
        if line.startswith("fsdp-train: GPT ") and " parameters" in line:
            return int(line.split(" parameters")[0].split()[-1])
    return None


# ---------------------------------------------------------------------------------------------
# PyTorch FSDP2 + DCP: one spawn per model, every repeat inside it (building a 200M-parameter model
# takes longer than checkpointing it)

def dcp_worker(local_rank, W, store_port, export_dir, ckpt_root, repeats, keep, result_path, label):
    rank = local_rank  # single node
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")
    # fsdp-train's thread budget: the ranks share the cores instead of oversubscribing them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // W))
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=W)
    try:
        model, optim, n_params = build_and_step(rank, W, export_dir)
        result = time_dcp(rank, model, optim, ckpt_root, repeats, keep, label)
        result["params"] = n_params
        if rank == 0:
            with open(result_path + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(result_path + ".tmp", result_path)  # complete or absent
        dist.barrier()  # every rank done before any tears the process group down
    finally:
        dist.destroy_process_group()


def build_and_step(rank, W, export_dir):
    """vs_pytorch.py's FSDP2 setup (fully_shard each Block, then the root; AdamW with fsdp-train's
    groups), then one training step so that AdamW has its moments to checkpoint."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with open(os.path.join(export_dir, "config.json")) as f:
        cfg = json.load(f)
    model = GPT(cfg["vocab_size"], cfg["block_size"], cfg["n_layer"], cfg["n_head"], cfg["d_model"])
    model.load_state_dict(load_pt(os.path.join(export_dir, "init.pt")), strict=True)
    n_params = sum(p.numel() for p in model.parameters())  # the tied weight once
    mesh = init_device_mesh("cpu", (W,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = fsdp_train_adamw(model.named_parameters(), cfg)
    batches = load_pt(os.path.join(export_dir, "batches.pt"))
    per_rank = cfg["global_batch"] // W
    x = batches["x"][0, rank * per_rank:(rank + 1) * per_rank]
    y = batches["y"][0, rank * per_rank:(rank + 1) * per_rank]
    optim.zero_grad()
    lm_loss(model(x), y).backward()
    if cfg["clip"] > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
    optim.step()
    return model, optim, n_params


def slowest(seconds):
    """The slowest rank's time: a checkpoint holds every rank until the last is done."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def local_checksum(model):
    return sum(p.to_local().double().sum().item() for p in model.parameters())


def time_dcp(rank, model, optim, ckpt_root, repeats, keep, label):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # The asynchronous upload runs collectives on a background thread. Its own group keeps them
    # apart from the main thread's (the timing's all-reduce here, FSDP's in a training loop), as
    # fsdp's checkpointer does; sharing one Gloo group between two threads can mismatch the ranks.
    async_group = dist.new_group(backend="gloo")
    res = {k: [] for k in ("save_s", "async_s", "async_total_s", "load_s", "save_bytes", "async_bytes")}

    def state():
        model_sd, optim_sd = get_state_dict(model, optim)
        return {"model": model_sd, "optim": optim_sd}

    for r in range(repeats):
        sync_dir = os.path.join(ckpt_root, f"dcp-sync-{r}")
        async_dir = os.path.join(ckpt_root, f"dcp-async-{r}")

        # Synchronous save: returns when every rank's files and rank 0's .metadata are written.
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state(), checkpoint_id=sync_dir)
        res["save_s"].append(slowest(time.perf_counter() - t0))

        # Asynchronous save: the blocking part is the copy to CPU staging memory (the stage) and
        # the hand-off to the upload thread. Its completion is waited for before anything else.
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(state(), checkpoint_id=async_dir, process_group=async_group)
        blocked = time.perf_counter() - t0
        future.result()
        total = time.perf_counter() - t0
        res["async_s"].append(slowest(blocked))
        res["async_total_s"].append(slowest(total))

        # Load the synchronous checkpoint into the same model and optimizer. The weights are
        # zeroed first (untimed) so that a load which read nothing cannot pass the check below.
        before = local_checksum(model)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        dist.barrier()
        t0 = time.perf_counter()
        sd = state()
        dcp.load(sd, checkpoint_id=sync_dir)
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        res["load_s"].append(slowest(time.perf_counter() - t0))
        after = local_checksum(model)
        if after != before:
            raise RuntimeError(f"rank {rank}: dcp.load did not restore the weights (checksum {after} != {before})")

        dist.barrier()  # every rank done with both folders
        if rank == 0:
            res["save_bytes"].append(folder_bytes(sync_dir))
            res["async_bytes"].append(folder_bytes(async_dir))
            if not keep:
                shutil.rmtree(sync_dir, ignore_errors=True)
                shutil.rmtree(async_dir, ignore_errors=True)
        dist.barrier()
        if rank == 0:
            log(f"  {label} run {r + 1}: dcp.save {res['save_s'][-1]:.3f} s, dcp.async_save {res['async_s'][-1]:.3f} s "
                f"(done after {res['async_total_s'][-1]:.3f} s), dcp.load {res['load_s'][-1]:.3f} s")
    return res


def measure_dcp(args, model, mdir, commands):
    export_dir = os.path.join(mdir, "export")
    # One step's batch is all the PyTorch side needs; the block size and batch are fsdp's.
    export = [args.fsdp_train, "--export-init", export_dir, "--model", model, "--steps", "1",
              "--global-batch-size", str(args.global_batch_size), "--block-size", str(args.block_size),
              "--seed", str(args.seed)]
    commands.append(shlex.join(export))
    result_path = os.path.join(mdir, "dcp-result.json")
    try:
        run_fsdp_train(export, os.path.join(mdir, "export.log"), args.timeout)
        log(f"  {model}: PyTorch FSDP2 + DCP, {args.repeats} repeat(s) in one spawn of {args.nproc} ranks")
        # The rendezvous store lives here, on a port the OS picks (nothing can take it in between).
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        try:
            mp.spawn(dcp_worker, nprocs=args.nproc, join=True,
                     args=(args.nproc, store.port, export_dir, mdir, args.repeats, args.keep, result_path, model))
        except Exception as e:  # a rank raised or died: spawn has stopped the others
            if not os.path.exists(result_path):
                msg = str(e).strip().splitlines()
                raise RunFailed(f"a PyTorch rank failed: {msg[-1] if msg else repr(e)}", output_tail(str(e)))
            # Everything was measured, then a rank died at shutdown (seen now and then with Gloo
            # on CPU: "terminate called without an active exception"). The numbers stand.
            log(f"    note: a PyTorch rank crashed at shutdown, after the measurements; they are kept")
        with open(result_path) as f:
            return json.load(f)
    finally:
        if not args.keep:
            shutil.rmtree(export_dir, ignore_errors=True)  # init.pt alone is 4 bytes a parameter
            for name in os.listdir(mdir):
                if name.startswith("dcp-") and os.path.isdir(os.path.join(mdir, name)):
                    shutil.rmtree(os.path.join(mdir, name), ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Report

def row(model, system, op, seconds, nbytes, n, rate=True):
    s = median(seconds)
    b = median(nbytes)
    mbs = f"{b / MB / s:.0f}" if rate and s > 0 else "–"
    secs = f"{s:.3f}" if s == s else "–"
    return f"| {model} | {system} | {op} | {secs} | {b / MB:.2f} | {mbs} | {n} |"


def ratio(a, b):
    a, b = median(a), median(b)
    # A non-positive time is a difference lost in noise (fsdp's load): no meaningful ratio.
    return f"{a / b:.2f}" if b > 0 and a > 0 else "–"


def report(args, results, failures, commands, command_line, t_total):
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    out = [f"# Checkpoint save and load: fsdp vs PyTorch FSDP2 + DCP", "",
           f"torch {torch.__version__}, CPU (Gloo), W = {args.nproc}, full_shard, {threads} thread(s) per rank, "
           f"global batch {args.global_batch_size} x {args.block_size} tokens, fsdp saves after each of "
           f"{args.steps} step(s) (--save-every {args.save_every}), DCP after 1 step; median over {args.repeats} "
           f"repeat(s); total {t_total:.0f} s. MB = 10^6 bytes of one checkpoint folder; MB/s = MB / median s.", "",
           "| model | system | operation | median s | MB | MB/s | samples |",
           "|---|---|---|---|---|---|---|"]
    ratios, notes = [], []
    for model in args.models:
        f, d = results.get((model, "fsdp")), results.get((model, "dcp"))
        name = model
        params = (f or {}).get("params") or (d or {}).get("params")
        if params:
            name = f"{model} ({params / 1e6:.1f} M params)" if params >= 1e6 else f"{model} ({params} params)"
        if f:
            out.append(row(name, FSDP, "save, sharded, synchronous (stall)", f["sync"]["s"], f["sync"]["bytes"], len(f["sync"]["s"])))
            out.append(row(name, FSDP, "save, sharded, asynchronous (stall: copy to host; write not included)",
                           f["async"]["s"], f["async"]["bytes"], len(f["async"]["s"]), rate=False))
            out.append(row(name, FSDP, "save, full (rank 0 gathers, writes one file; stall)", f["full"]["s"],
                           f["full"]["bytes"], len(f["full"]["s"])))
            out.append(row(name, FSDP, "load, sharded (load_checkpoint, as fsdp-train reports it)", f["load"]["s"],
                           f["load"]["bytes"], len(f["load"]["s"])))
            if f["async_waiting"]:
                notes.append(f"{model}: fsdp asynchronous saves after the first of a run stalled {median(f['async_waiting']):.3f} s "
                             f"(median of {len(f['async_waiting'])}): save() first waits for the previous background "
                             f"write, so these include whatever of it was left after --save-every {args.save_every} "
                             f"training step(s).")
        else:
            out.append(f"| {name} | {FSDP} | FAILED: {failures[(model, 'fsdp')].splitlines()[0].replace('|', '/')} | – | – | – | 0 |")
        if d:
            out.append(row(name, DCP, "dcp.save (get_state_dict + save)", d["save_s"], d["save_bytes"], len(d["save_s"])))
            out.append(row(name, DCP, "dcp.async_save (get_state_dict + until it returns; write not included)",
                           d["async_s"], d["async_bytes"], len(d["async_s"]), rate=False))
            out.append(row(name, DCP, "dcp.load (get_state_dict + load + set_state_dict)", d["load_s"],
                           d["save_bytes"], len(d["load_s"])))
            notes.append(f"{model}: the whole dcp.async_save, until its future completed, took "
                         f"{median(d['async_total_s']):.3f} s; fsdp's background write is not measured.")
        else:
            out.append(f"| {name} | {DCP} | FAILED: {failures[(model, 'dcp')].splitlines()[0].replace('|', '/')} | – | – | – | 0 |")
        if f and d:
            ratios.append(f"- {model}: save stall {ratio(f['sync']['s'], d['save_s'])}, "
                          f"async stall {ratio(f['async']['s'], d['async_s'])}, "
                          f"load {ratio(f['load']['s'], d['load_s'])}")
    if ratios:
        out += ["", "fsdp / PyTorch, median seconds (< 1: fsdp is faster):", ""] + ratios
    out += ["", "Notes:", ""] + [f"- {n}" for n in notes] + [
        "- fsdp's times come from fsdp-train (checkpoint_stall_ms, the slowest rank per save; the load as "
        "load_checkpoint's time on rank 0, which ends when every rank has loaded). DCP's are taken in-process "
        "around the calls, the slowest rank's. Both read back checkpoints just written, i.e. mostly from the page "
        "cache.",
        "", "Commands (first repeat; paths are under the work folder):", "", "```bash", command_line]
    out += commands + [f"# PyTorch FSDP2 + DCP: in-process, torch.multiprocessing.spawn of {args.nproc} ranks "
                       f"(bench/checkpoint.py dcp_worker)", "```"]
    if failures:
        out += ["", "Failed:", ""] + [f"- {m} / {s}: {e.splitlines()[0]}" for (m, s), e in failures.items()]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# Driver

def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["default", "200m"],
                   help="GPT presets, space or comma separated (default: default 200m)")
    p.add_argument("--nproc", type=int, default=2, help="world size W (ranks on this machine)")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement; the median is reported")
    p.add_argument("--steps", type=int, default=2, help="fsdp-train training steps per save run")
    p.add_argument("--save-every", type=int, default=1, help="fsdp-train --save-every")
    p.add_argument("--global-batch-size", type=int, default=0, help="default: W (one sequence per rank)")
    p.add_argument("--block-size", type=int, default=64,
                   help="sequence length (also sizes the position embedding, on both sides alike)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--load-pairs", type=int, default=2,
                   help="fsdp load: resumed runs per repeat (their median)")
    p.add_argument("--fsdp-train", default=os.path.join(REPO, "build", "bin", "fsdp-train"))
    p.add_argument("--workdir", default="", help="folder for checkpoints and logs (default: a fresh one under /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints, exports and the work folder")
    p.add_argument("--timeout", type=int, default=1800, help="seconds allowed to each fsdp-train run")
    p.add_argument("--out", default="", help="also write the Markdown report to this file")
    args = p.parse_args()
    args.models = [m for arg in args.models for m in arg.replace(",", " ").split()]
    if not args.models:
        p.error("--models: name at least one preset")
    if min(args.nproc, args.repeats, args.steps, args.load_pairs) < 1:
        p.error("--nproc, --repeats, --steps and --load-pairs must be at least 1")
    args.global_batch_size = args.global_batch_size or args.nproc
    if args.global_batch_size % args.nproc:
        p.error("--global-batch-size must be a multiple of --nproc")
    if not os.access(args.fsdp_train, os.X_OK):
        p.error(f"{args.fsdp_train} is not an executable (build the project first)")
    return args


def main():
    args = parse_args()
    command_line = this_command_line(__file__)
    fresh = not args.workdir
    workdir = tempfile.mkdtemp(prefix="bench-checkpoint.", dir="/tmp") if fresh else os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    log(f"checkpoint bench: models {' '.join(args.models)}, W={args.nproc}, {args.repeats} repeat(s), "
        f"work folder {workdir}")
    t_start = time.time()
    results, failures, commands = {}, {}, []
    for model in args.models:
        mdir = os.path.join(workdir, model)
        os.makedirs(mdir, exist_ok=True)
        for system, measure in (("fsdp", measure_fsdp), ("dcp", measure_dcp)):
            try:
                results[(model, system)] = measure(args, model, mdir, commands)
            except RunFailed as e:
                # Reported, and the remaining measurements still run: one refused preset or one
                # crashed rank should not cost the rest of a long benchmark.
                failures[(model, system)] = str(e)
                log(f"  {model}: {system} FAILED: {e}")
                if e.detail:
                    log("    " + "\n    ".join(e.detail.splitlines()))
    text = report(args, results, failures, commands, command_line, time.time() - t_start)
    print("\n" + text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.keep:
        log(f"kept everything under {workdir}")
    elif failures:
        log(f"logs of the failed runs are under {workdir} (checkpoints and exports are removed)")
    elif fresh:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        for model in args.models:
            shutil.rmtree(os.path.join(workdir, model), ignore_errors=True)
    return 2 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
