#!/usr/bin/env python3
"""Train the same GPT with our fsdp (build/bin/fsdp-train), PyTorch FSDP2 (fully_shard) and
PyTorch FSDP1 (FullyShardedDataParallel, FULL_SHARD) at the same world size, and compare
(1) the per-step global losses, which must agree to float32 tolerance, and
(2) the median step time after warm-up.

All three start from the very same weights and see the very same batches: `fsdp-train
--export-init` writes its initial weights, every step's global batch and the optimizer settings,
and the Python side loads them, so no RNG or data pipeline has to be reproduced in Python.

Run with the project's interpreter, e.g.
    ~/.cache/fsdp/venv-torch-2.11.0/bin/python bench/vs_pytorch.py --model small --steps 5 --repeats 1
or bench/vs_pytorch (a wrapper that picks that interpreter). Exit status: 0 when every system
ran and the losses agree, 1 when the losses disagree, 2 when a system failed to run.
"""

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.jit._pickle
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("ours", "fsdp2", "fsdp1", "ours-local", "local")
# The floors (--floors): every rank trains the plain model on its own slice at the same time, with
# the same thread budget, without sharding or averaging gradients: the compute each system's FSDP
# adds its overhead to, with the cores shared as in the FSDP runs. Their losses are not the
# others' (no gradient averaging), and they are no peers.
FLOORS = ("ours-local", "local")
MIXED = {"bf16": torch.bfloat16, "fp16": torch.float16}
LABELS = {"ours": "ours (fsdp-train)", "fsdp2": "PyTorch FSDP2", "fsdp1": "PyTorch FSDP1",
          "ours-local": "libtorch, no fsdp", "local": "PyTorch, no FSDP"}
PHASES = ("forward", "backward", "clip", "optimizer", "rest")


# ---------------------------------------------------------------------------------------------
# The model: a line-by-line port of models/gpt.cpp. Module and parameter names match libtorch's
# so the exported state dict loads as is, and the operator sequence is the same so that float32
# results agree with ours up to reduction-order rounding.

class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head, fused=True):
        super().__init__()
        assert d_model % n_head == 0
        self.n_head = n_head
        self.fused = fused
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.n_head
        q, k, v = (t.reshape(B, T, self.n_head, hd).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.fused:  # as gpt.cpp: at::scaled_dot_product_attention, causal, no dropout
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(B, T, C))
        # fsdp-train --attention reference: written out, as gpt.cpp's reference form.
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))  # exact (erf) gelu, as torch::gelu's default


class Block(nn.Module):
    def __init__(self, d_model, n_head, fused_attention=True):
        super().__init__()
        # Registration order as in gpt.cpp (ln1, attn, ln2, mlp): it fixes the flat layouts.
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, fused_attention)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x):
        h = x + self.attn(self.ln1(x))
        return h + self.mlp(self.ln2(h))


class TiedLMHead(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight  # the embedding's own Parameter object: tied, not copied

    def forward(self, x):
        return F.linear(x, self.weight)


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, d_model, fused_attention=True):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, fused_attention) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = TiedLMHead(self.tok_emb.weight)

    def forward(self, idx):
        T = idx.size(1)
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def no_decay(name):
    # fsdp-train's rule, applied to the original (unwrapped) parameter name.
    return "bias" in name or "ln" in name


def fsdp_train_adamw(named_params, cfg, foreach=False):
    """fsdp-train's AdamW over (original name, parameter) pairs: weight decay except on biases and
    norms, the hyper-parameters of --export-init's config.json. Default foreach=False, fused=False:
    the single-tensor loop is libtorch AdamW's algorithm, op by op (up to lerp_ for the first
    moment, where libtorch does mul_ + add_)."""
    groups = {"decay": [], "no_decay": []}
    for name, p in named_params:
        groups["no_decay" if no_decay(name) else "decay"].append(p)
    adamw = cfg["adamw"]
    return torch.optim.AdamW(
        [{"params": groups["decay"], "weight_decay": cfg["weight_decay"]},
         {"params": groups["no_decay"], "weight_decay": 0.0}],
        lr=cfg["lr"], betas=(adamw["beta1"], adamw["beta2"]), eps=adamw["eps"], foreach=foreach, fused=False)


def load_pt(path):
    # The files are written by libtorch's pickle_save, whose tensors need this type-tag global.
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        return torch.load(path)


# ---------------------------------------------------------------------------------------------
# One rank of a PyTorch run (started by torch.multiprocessing.spawn)

def worker(local_rank, system, world_size, store_port, export_dir, device, adamw_impl, mixed, result_path):
    rank = local_rank  # single node
    # FSDP1 is deprecated in favour of FSDP2; the warning would be repeated by every rank.
    warnings.filterwarnings("ignore", category=FutureWarning)
    # The same thread budget as fsdp-train: the ranks share the cores instead of oversubscribing.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if device == "cuda":  # UNTESTED: no GPU on the development machine
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        result = train(system, rank, world_size, export_dir, dev, adamw_impl, mixed)
        if rank == 0:
            with open(result_path + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(result_path + ".tmp", result_path)  # complete or absent
        # Every rank done with its collectives before any tears its process group down.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train(system, rank, W, export_dir, dev, adamw_impl, mixed):
    with open(os.path.join(export_dir, "config.json")) as f:
        cfg = json.load(f)
    init = load_pt(os.path.join(export_dir, "init.pt"))
    batches = load_pt(os.path.join(export_dir, "batches.pt"))

    model = GPT(cfg["vocab_size"], cfg["block_size"], cfg["n_layer"], cfg["n_head"], cfg["d_model"],
                cfg.get("attention", "fused") == "fused")
    # strict: every exported name (head.weight included, as the tied alias) must exist here.
    model.load_state_dict(init, strict=True)
    assert model.head.weight is model.tok_emb.weight
    model.to(dev)
    expected_names = [n for n, _ in model.named_parameters()]  # tied weight once, as tok_emb.weight

    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
        # fsdp's --mixed-precision: compute and reduce in that dtype, fp32 master and optimizer.
        mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=MIXED[mixed], reduce_dtype=MIXED[mixed])} if mixed != "none" else {}
        mesh = init_device_mesh(dev.type, (W,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **mp)
        fully_shard(model, mesh=mesh, **mp)  # the root unit: embeddings, ln_f and the tied head
        wrapped = model
    elif system == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        # device_id must be given on CPU too: with None, FSDP1 looks for an accelerator and
        # refuses to run ("FSDP needs a non-CPU accelerator device") on a machine without one.
        from torch.distributed.fsdp import MixedPrecision
        mp = {"mixed_precision": MixedPrecision(param_dtype=MIXED[mixed], reduce_dtype=MIXED[mixed],
                                                buffer_dtype=MIXED[mixed])} if mixed != "none" else {}
        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **mp,
                       sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True,
                       device_id=dev)
    elif system == "local":
        wrapped = model  # the floor: this rank's slice, no sharding, no gradient averaging
    else:
        raise ValueError(system)

    # Parameter groups by original name, as fsdp-train builds them. FSDP1 prefixes wrapped modules.
    named = [(name.replace("_fsdp_wrapped_module.", ""), p) for name, p in wrapped.named_parameters()]
    assert sorted(n for n, _ in named) == sorted(expected_names), (named, expected_names)
    optim = fsdp_train_adamw(named, cfg, foreach=adamw_impl == "foreach")

    xs, ys = batches["x"], batches["y"]
    per_rank = cfg["global_batch"] // W
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    losses, step_ms, phases = [], [], []
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for step in range(cfg["steps"]):
        # Timed region = fsdp-train's: batch slice, zero_grad, forward, loss, backward, clip,
        # optimizer step, and the all-reduce of the loss for logging (whose .item() also waits
        # for a GPU to finish). The phases are fsdp-train's too (its JSONL "phases"): forward with
        # the loss, backward, clip, optimizer step, and the rest. On CPU every call returns when its
        # work is done (Gloo's waits included), so a timer around each call is the phase.
        t0 = time.perf_counter()
        x, y = xs[step, lo:hi].to(dev), ys[step, lo:hi].to(dev)
        optim.zero_grad()
        t1 = time.perf_counter()
        loss = lm_loss(wrapped(x), y)
        sync()
        t2 = time.perf_counter()
        loss.backward()
        sync()
        t3 = time.perf_counter()
        if cfg["clip"] > 0:
            if system == "fsdp1":
                wrapped.clip_grad_norm_(cfg["clip"])
            else:  # DTensor gradients: the norm's reduction runs over the mesh (local: plain tensors)
                torch.nn.utils.clip_grad_norm_(wrapped.parameters(), cfg["clip"])
        sync()
        t4 = time.perf_counter()
        optim.step()
        sync()
        t5 = time.perf_counter()
        l = loss.detach().reshape(1).clone()
        dist.all_reduce(l)
        global_loss = l.item() / W
        t6 = time.perf_counter()
        step_ms.append((t6 - t0) * 1000.0)
        phases.append({"forward": (t2 - t1) * 1e3, "backward": (t3 - t2) * 1e3, "clip": (t4 - t3) * 1e3,
                       "optimizer": (t5 - t4) * 1e3, "rest": ((t1 - t0) + (t6 - t5)) * 1e3})
        losses.append(global_loss)
    return {"losses": losses, "step_ms": step_ms, "phases": phases}


def run_pytorch(system, args, export_dir, workdir, run_index):
    result_path = os.path.join(workdir, f"{system}-{run_index}.json")
    # The rendezvous store lives in this process on a port the OS picks: unlike choosing a free
    # port and handing it to rank 0, nothing else on the machine can take it in between.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        mp.spawn(worker, nprocs=args.world_size, join=True,
                 args=(system, args.world_size, store.port, export_dir, args.device, args.adamw_impl, args.mixed_precision,
                       result_path))
    except Exception as e:  # a rank raised or died: spawn has stopped the others
        msg = str(e).strip().splitlines()
        if os.path.exists(result_path):
            # Training finished and rank 0 wrote its results; a rank died while shutting down
            # (seen now and then with Gloo on CPU: "terminate called without an active
            # exception" at exit). The measurements stand; say what happened.
            print(f"    note: {system} ranks finished training, then one crashed at shutdown "
                  f"({msg[-1] if msg else e!r}); its results are kept", flush=True)
            with open(result_path) as f:
                return json.load(f), None, None
        return None, (msg[-1] if msg else repr(e)), str(e)
    with open(result_path) as f:
        return json.load(f), None, None


# ---------------------------------------------------------------------------------------------
# Our fsdp

def common_train_flags(args):
    flags = ["--steps", str(args.steps), "--model", args.model,
             "--global-batch-size", str(args.global_batch_size), "--seed", str(args.seed)]
    if args.block_size:
        flags += ["--block-size", str(args.block_size)]
    flags += ["--attention", args.attention]
    if args.data:
        flags += ["--data", args.data]
    return flags


def export_init(args, export_dir):
    cmd = [args.fsdp_train, "--export-init", export_dir] + common_train_flags(args)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def run_ours_local(args, workdir, run_index):
    """The libtorch floor: W processes of fsdp-train --local at once, each on a per-rank batch with
    one rank's thread budget. Rank 0's JSONL (the first process) is the result."""
    W = args.world_size
    procs, metrics = [], []
    for r in range(W):
        m = os.path.join(workdir, f"ours-local-{run_index}-{r}.jsonl")
        metrics.append(m)
        flags = common_train_flags(args)
        flags[flags.index("--global-batch-size") + 1] = str(args.global_batch_size // W)
        cmd = ([args.fsdp_train, "--local", "--threads", str(max(1, (os.cpu_count() or 1) // W)), "--metrics-jsonl", m,
                "--log-every", "1000", "--run-dir", "none", "--sample-tokens", "0"] + flags)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate()[0] for p in procs]
    for p, out in zip(procs, outputs):
        if p.returncode != 0:
            return None, f"fsdp-train --local exit {p.returncode}", out
    return rows_of(args, metrics[0])


def run_ours(args, workdir, run_index):
    metrics = os.path.join(workdir, f"ours-{run_index}.jsonl")
    cmd = ([args.fsdp_train, "--nproc-per-node", str(args.world_size), "--strategy", "full_shard",
            "--metrics-jsonl", metrics, "--log-every", "1000", "--run-dir", "none", "--sample-tokens", "0"] +
           common_train_flags(args))
    if args.device == "cuda":
        cmd += ["--device", "cuda"]  # UNTESTED here
    if args.mixed_precision != "none":
        cmd += ["--mixed-precision", args.mixed_precision]
    cmd += shlex.split(args.ours_args)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        # libtorch errors end in a long C++ stack trace: the message is the line that says error.
        lines = [l for l in proc.stdout.strip().splitlines() if not l.lstrip().startswith("frame #")]
        said = [l for l in lines if "error" in l.lower()]
        return None, f"exit {proc.returncode}: " + (said or lines or [""])[0], "\n".join(lines)
    return rows_of(args, metrics)


def rows_of(args, metrics):
    """Rank 0's steps of an fsdp-train JSONL: losses, step times and phases."""
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    rows = sorted((r for r in rows if r["rank"] == 0 and "step_ms" in r), key=lambda r: r["step"])
    if [r["step"] for r in rows] != list(range(args.steps)):
        return None, f"{metrics} has rank 0 steps {[r['step'] for r in rows]}, not 0..{args.steps - 1}", ""
    def phases_of(r):
        ph = r["phases"]
        out = {p: ph[p]["ms"] for p in PHASES if p != "rest"}
        out["rest"] = ph["rest_ms"]
        for p in ("forward", "backward"):  # what of it the compute thread waited for communication
            out["exposed " + p] = ph[p]["exposed_all_gather_ms"] + ph[p]["exposed_reduce_ms"] + ph[p]["rate_limiter_wait_ms"]
        return out
    return {"losses": [r["loss"] for r in rows], "step_ms": [r["step_ms"] for r in rows],
            "phases": [phases_of(r) for r in rows]}, None, None


# ---------------------------------------------------------------------------------------------
# Driver

def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fsdp-train", default=os.path.join(REPO, "build", "bin", "fsdp-train"))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--world-sizes", default="", help="comma list, e.g. 2,4: every world size in one run (overrides --world-size)")
    p.add_argument("--model", default="default", help="GPT preset (see models/gpt.cpp)")
    p.add_argument("--models", default="", help="comma list, e.g. default,medium: every preset in one run (overrides --model)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--block-size", type=int, default=0, help="sequence length (0: the preset's)")
    p.add_argument("--attention", choices=("fused", "reference"), default="fused",
                   help="scaled_dot_product_attention on both sides, or the written-out form on both")
    p.add_argument("--data", default="", help="fsdp-train --data (default: its own corpus)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--repeats", type=int, default=3,
                   help="run the systems alternately this many times; report the median of medians")
    p.add_argument("--systems", default="ours,fsdp2,fsdp1", help="comma list, subset of " + ",".join(SYSTEMS))
    p.add_argument("--floors", action="store_true",
                   help="add the floors: " + " and ".join(LABELS[f] for f in FLOORS) + ", every rank its own slice")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: NCCL, one GPU per rank (UNTESTED)")
    p.add_argument("--ours-args", default="",
                   help="extra fsdp-train flags; write --ours-args=--flag for a lone flag; must not change the math")
    p.add_argument("--mixed-precision", choices=("none", "bf16"), default="none",
                   help="bf16 compute and reduction with an fp32 master in every system (losses then agree "
                        "to bf16, not fp32, tolerance: raise --loss-tol)")
    p.add_argument("--adamw-impl", choices=("single", "foreach"), default="single",
                   help="PyTorch AdamW loop (fused is not offered: one kernel, not libtorch's op sequence)")
    p.add_argument("--loss-tol", type=float, default=1e-4,
                   help="max |loss - ours| allowed over the first --check-steps steps")
    p.add_argument("--check-steps", type=int, default=3)
    p.add_argument("--show-steps", type=int, default=5, help="loss table and max |Δloss| over this many steps")
    p.add_argument("--markdown", action="store_true", help="also print a table for docs/performance.md")
    args = p.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()] + (list(FLOORS) if args.floors else [])
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        p.error(f"--systems: unknown {bad}; choose from {','.join(SYSTEMS)}")
    args.systems = [s for s in SYSTEMS if s in systems]  # fixed order, ours first
    args.world_sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()] or [args.world_size]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()] or [args.model]
    if any(args.global_batch_size % w for w in args.world_sizes):
        p.error("--global-batch-size must be a multiple of every world size")
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    if not os.access(args.fsdp_train, os.X_OK):
        p.error(f"{args.fsdp_train} is not an executable (build the project first)")
    return args


def median_after_warmup(step_ms, warmup):
    return statistics.median(step_ms[warmup:])


def this_command_line(script):
    """How this script was run, to print next to its figures: the interpreter as ~/... (left unquoted
    so that a shell expands it), the rest quoted."""
    home = os.path.expanduser("~")
    python = ("~" + shlex.quote(sys.executable[len(home):]) if sys.executable.startswith(home + "/")
              else shlex.quote(sys.executable))
    return python + " " + shlex.join([os.path.relpath(os.path.abspath(script), REPO)] + sys.argv[1:])


def phase_medians(runs, warmup):
    """Per phase: the median over the runs of each run's median after warm-up."""
    keys = runs[0]["phases"][0].keys()
    return {k: statistics.median(statistics.median(ph[k] for ph in res["phases"][warmup:]) for res in runs) for k in keys}


def run_world_size(args, W, command):
    """Every system at world size W, alternately, --repeats times. Returns (exit code, lines for the
    markdown, {system: median step ms}, {system: phase medians})."""
    args.world_size = W
    threads = max(1, (os.cpu_count() or 1) // W)
    print(f"vs_pytorch: torch {torch.__version__}, {args.device}, W={W}, "
          f"{threads} thread(s) per rank, model '{args.model}', {args.steps} steps "
          f"({args.warmup} warm-up), global batch {args.global_batch_size}, {args.repeats} repeat(s)",
          flush=True)
    t_start = time.time()
    runs = {s: [] for s in args.systems}  # per system: one result dict per repeat
    errors = {}
    with tempfile.TemporaryDirectory(prefix="vs_pytorch.") as workdir:
        export_dir = os.path.join(workdir, "export")
        export_init(args, export_dir)
        with open(os.path.join(export_dir, "config.json")) as f:
            cfg = json.load(f)
        for r in range(args.repeats):
            for s in args.systems:
                t0 = time.time()
                if s == "ours":
                    res, err, detail = run_ours(args, workdir, r)
                elif s == "ours-local":
                    res, err, detail = run_ours_local(args, workdir, r)
                else:
                    res, err, detail = run_pytorch(s, args, export_dir, workdir, r)
                if err:
                    # Kept trying in later repeats: a flaky crash should not drop a system.
                    errors.setdefault(s, err)
                    print(f"  run {r + 1}: {LABELS[s]} FAILED: {err}", flush=True)
                    print("    " + "\n    ".join(detail.strip().splitlines()[-15:]), file=sys.stderr)
                    continue
                runs[s].append(res)
                print(f"  run {r + 1}: {LABELS[s]:18s} median {median_after_warmup(res['step_ms'], args.warmup):8.1f} ms"
                      f"  ({time.time() - t0:.0f} s)", flush=True)
    ok = [s for s in args.systems if runs[s]]
    print(f"\nGPT {cfg['n_layer']} layers, d_model {cfg['d_model']}, {cfg['n_head']} heads, "
          f"block {cfg['block_size']}, vocab {cfg['vocab_size']}; total {time.time() - t_start:.0f} s")

    # (1) Losses. Every repeat computes the same math, so the first run of each system is shown
    # and the worst deviation over all repeats is checked.
    exit_code = 0
    shown = min(args.show_steps, args.steps)
    if ok:
        compared = [s for s in ok if s not in FLOORS]  # the floors train apart: other losses
        print(f"\nglobal loss per step (first {shown}):")
        print("step  " + "".join(f"{LABELS[s]:>20s}" for s in compared))
        for i in range(shown):
            print(f"{i:4d}  " + "".join(f"{runs[s][0]['losses'][i]:20.7f}" for s in compared))
    deltas = {}
    if "ours" in ok:
        for s in ok:
            if s == "ours" or s in FLOORS:
                continue
            def max_delta(n):  # over all repeats; a NaN anywhere counts as infinitely far
                d = [abs(a - b) for o, p in zip(runs["ours"], runs[s])
                     for a, b in zip(o["losses"][:n], p["losses"][:n])]
                return max((x if x == x else math.inf) for x in d)
            d_shown, d_check = max_delta(shown), max_delta(args.check_steps)
            deltas[s] = d_shown
            verdict = "ok" if d_check <= args.loss_tol else "MISMATCH"
            print(f"max |loss - ours|, {LABELS[s]}: first {shown} steps {d_shown:.2e}, "
                  f"first {args.check_steps} steps {d_check:.2e} (tolerance {args.loss_tol:g}) {verdict}")
            if d_check > args.loss_tol:
                exit_code = 1

    # (2) Step time: the median over repeats of each run's median after warm-up (rank 0).
    med = {s: statistics.median(median_after_warmup(res["step_ms"], args.warmup) for res in runs[s]) for s in ok}
    print(f"\nmedian step time after {args.warmup} warm-up steps, median over the runs that completed"
          f"{' (ratio < 1: ours is faster)' if 'ours' in ok and len(ok) > 1 else ''}:")
    for s in ok:
        ratio = f"   ours/{s} = {med['ours'] / med[s]:.2f}" if "ours" in ok and s != "ours" else ""
        print(f"  {LABELS[s]:18s} {med[s]:8.1f} ms{ratio}   ({len(runs[s])} of {args.repeats} runs)")
    for s, err in errors.items():
        if runs[s]:
            print(f"  {LABELS[s]:18s} {args.repeats - len(runs[s])} run(s) failed: {err}")
        else:
            print(f"  {LABELS[s]:18s} did not run: {err}")
        exit_code = max(exit_code, 2)

    # (3) Where each system's step goes: the same phases, timed around the same calls (ours from
    # its JSONL, with the communication the compute thread waited for inside forward and backward).
    phases = {s: phase_medians(runs[s], args.warmup) for s in ok}
    cols = list(PHASES) + ["exposed forward", "exposed backward"]
    print("\nphases (ms, medians):")
    print(f"  {'system':18s}" + "".join(f"{c:>18s}" for c in cols))
    for s in ok:
        print(f"  {LABELS[s]:18s}" + "".join(f"{phases[s][c]:18.1f}" if c in phases[s] else f"{'-':>18s}" for c in cols))

    md = []
    if args.markdown:
        md.append(f"torch {torch.__version__}, {args.device}, W = {W}, {threads} thread(s) per rank, GPT '{args.model}' "
                  f"({cfg['n_layer']} layers, d_model {cfg['d_model']}), global batch {args.global_batch_size} x "
                  f"{cfg['block_size']} tokens, {args.steps} steps of which {args.warmup} warm-up, "
                  f"median over the runs that completed.\n")
        md.append("| system | median step (ms) | ours / system | " + " | ".join(f"{c} (ms)" for c in cols) +
                  f" | max \\|Δloss\\| vs ours, first {shown} steps | runs completed |")
        md.append("|---|---|---|" + "---|" * len(cols) + "---|---|")
        for s in args.systems:
            if not runs[s]:
                md.append(f"| {LABELS[s]} | did not run: {errors[s].replace('|', '/')} | – |" + " – |" * len(cols) +
                          f" – | 0 of {args.repeats} |")
                continue
            ratio = f"{med['ours'] / med[s]:.2f}" if "ours" in ok else "–"
            delta = "(reference)" if s == "ours" else (f"{deltas[s]:.1e}" if s in deltas else "–")
            cells = " | ".join(f"{phases[s][c]:.1f}" if c in phases[s] else "–" for c in cols)
            md.append(f"| {LABELS[s]} | {med[s]:.1f} | {ratio} | {cells} | {delta} | {len(runs[s])} of {args.repeats} |")
        md.append("")
    return exit_code, md, med, phases


def main():
    args = parse_args()
    command = this_command_line(__file__)
    exit_code, md, summary = 0, [], []
    for model in args.models:
        args.model = model
        for W in args.world_sizes:
            code, lines, med, _ = run_world_size(args, W, command)
            exit_code = max(exit_code, code)
            md += lines
            peers = [s for s in med if s != "ours" and s not in FLOORS]
            if "ours" in med and peers:
                faster = min(peers, key=lambda s: med[s])
                summary.append((model, W, faster, med["ours"] / med[faster]))
            print(flush=True)
    if summary:
        print("ours / the faster peer (median step, medians of the repeats; goal 0.75):")
        for model, W, peer, ratio in summary:
            print(f"  {model}, W={W}: {ratio:.2f} (faster peer: {LABELS[peer]})")
    if args.markdown:
        print(f"\n```bash\n{command}\n```\n")
        print("\n".join(md))
        if summary:
            print("| model | W | ours / faster peer | faster peer |\n|---|---|---|---|")
            for model, W, peer, ratio in summary:
                print(f"| {model} | {W} | {ratio:.2f} | {LABELS[peer]} |")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
