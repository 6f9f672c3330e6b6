"""A training run with its AdamW state between fsdp-train and PyTorch FSDP2, both ways.

  resume    (fsdp -> PyTorch) load a SHARDED fsdp checkpoint (model and AdamW state) into the GPT
            port of bench/vs_pytorch.py wrapped with FSDP2 (2 processes, gloo, CPU), check that the
            state arrived, and train on: the losses must follow fsdp-train's own resume
  save      (PyTorch -> fsdp) train the port with FSDP2 from fsdp-train's exported initial weights
            and save model + flattened optimizer state with torch.distributed.checkpoint's
            HuggingFaceStorageWriter (one folder), the hyper-parameters in optimizer_groups.json
  describe  list what a folder of DCP Hugging Face safetensors files holds: per file, every
            tensor's dtype, shape and DCP_SHARDING_INFO saved_offsets

Every command prints one JSON object on its last line. The PyTorch side is bench/vs_pytorch.py's
(model, FSDP2 wrapping, AdamW groups, clipping, batch split), so that its losses follow
fsdp-train's to float32 rounding.
"""
import argparse
import glob
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from vs_pytorch import GPT, fsdp_train_adamw, lm_loss, load_pt  # noqa: E402  (the port the benchmark trains)

WORLD_SIZE = 2
# The hyper-parameters fsdp's manifest records per group (manifest.json optimizer.groups[i].options).
MANIFEST_OPTIONS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
# The optimizer state dict in flat form: state.<fqn>.<key> and param_groups.<fqn>.<option>.
FLATTEN = StateDictOptions(flatten_optimizer_state_dict=True)


# ---------------------------------------------------------------------------------------------
# Running the ranks

def spawn(fn, *args):
    """Runs fn(rank, world_size, *args) in WORLD_SIZE processes and returns what rank 0 returned."""
    with tempfile.TemporaryDirectory(prefix="optimizer_interop.") as tmp:
        result_path = os.path.join(tmp, "result.json")
        # The rendezvous store lives here on a port the OS picks (as vs_pytorch.py does): no race
        # for a "free" port between choosing it and binding it.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        try:
            mp.spawn(_rank_main, nprocs=WORLD_SIZE, join=True, args=(store.port, result_path, fn, args))
        except Exception:
            # Gloo on CPU now and then crashes a rank at exit, after the work is done ("terminate
            # called without an active exception", seen by vs_pytorch.py): a finished result stands.
            if not os.path.exists(result_path):
                raise
            print("note: a rank crashed at shutdown after rank 0 wrote its result", file=sys.stderr)
        with open(result_path) as f:
            return json.load(f)


def _rank_main(rank, store_port, result_path, fn, args):
    # The two ranks share the machine's cores, as fsdp-train's ranks do.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD_SIZE))
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    try:
        result = fn(rank, WORLD_SIZE, *args)
        if rank == 0:
            with open(result_path + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(result_path + ".tmp", result_path)  # complete or absent
        dist.barrier()  # every rank done with its collectives before any tears the group down
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The PyTorch run: bench/vs_pytorch.py's train(), system "fsdp2", float32, single-tensor AdamW,
# taken apart so that a run can start from a checkpoint and stop to save one.

def build(export_dir, W, init_weights):
    """The port, wrapped with FSDP2, and its AdamW; with init_weights, fsdp-train's initial ones."""
    with open(os.path.join(export_dir, "config.json")) as f:
        cfg = json.load(f)
    model = GPT(cfg["vocab_size"], cfg["block_size"], cfg["n_layer"], cfg["n_head"], cfg["d_model"],
                cfg.get("attention", "fused") == "fused")
    if init_weights:
        model.load_state_dict(load_pt(os.path.join(export_dir, "init.pt")), strict=True)
    assert model.head.weight is model.tok_emb.weight
    mesh = init_device_mesh("cpu", (W,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root unit: embeddings, ln_f and the tied head
    # named_parameters() yields the tied weight once, as tok_emb.weight: fsdp's rule too.
    optim = fsdp_train_adamw(model.named_parameters(), cfg)
    return cfg, model, optim


def train(cfg, model, optim, batches, rank, W, first, last):
    """Steps first..last-1 on the exported global batches; returns each step's global mean loss."""
    xs, ys = batches["x"], batches["y"]
    if xs.size(0) < last:
        raise ValueError(f"the export holds {xs.size(0)} steps' batches, not {last}: re-export with --steps {last}")
    per_rank = cfg["global_batch"] // W
    lo, hi = rank * per_rank, (rank + 1) * per_rank  # each rank its contiguous half, as vs_pytorch
    losses = []
    for step in range(first, last):
        optim.zero_grad()
        loss = lm_loss(model(xs[step, lo:hi]), ys[step, lo:hi])
        loss.backward()
        if cfg["clip"] > 0:  # DTensor gradients: the norm's reduction runs over the mesh
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        optim.step()
        l = loss.detach().reshape(1).clone()
        dist.all_reduce(l)
        losses.append(l.item() / W)
    return losses


# ---------------------------------------------------------------------------------------------
# Reading DCP Hugging Face folders without DCP: the independent check of what a load put in place

def read_folder(folder):
    """{key: [(file, shape, saved_offsets)]} over the folder's safetensors files: a key is in as many
    files as it has boxes (a rank's piece may be several boxes, a file holds each key once)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            info = json.loads((f.metadata() or {}).get("DCP_SHARDING_INFO", "{}"))
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                offsets = info[key]["saved_offsets"] if key in info else [0] * len(shape)
                out.setdefault(key, []).append((path, shape, offsets))
    return out


def assemble(pieces, key):
    """The whole tensor `key`, its boxes placed at their saved_offsets; every element exactly once."""
    size = [max(offs[d] + shape[d] for (_, shape, offs) in pieces) for d in range(len(pieces[0][1]))]
    whole, seen = None, None
    for path, shape, offs in pieces:
        with safe_open(path, framework="pt") as f:
            t = f.get_tensor(key)
        if whole is None:
            whole, seen = torch.empty(size, dtype=t.dtype), torch.zeros(size, dtype=torch.int32)
        box = tuple(slice(o, o + s) for o, s in zip(offs, shape))
        whole[box] = t
        seen[box] += 1
    if not bool((seen == 1).all()):
        raise AssertionError(f"{key}: the saved boxes do not cover the tensor exactly once")
    return whole


# ---------------------------------------------------------------------------------------------
# resume: fsdp checkpoint -> PyTorch FSDP2

def resume_rank(rank, W, checkpoint, export_dir, first, last, model_only):
    with open(os.path.join(checkpoint, "manifest.json")) as f:
        manifest = json.load(f)
    cfg, model, optim = build(export_dir, W, init_weights=False)

    # The model. get_model_state_dict names the tied weight twice (tok_emb.weight, head.weight);
    # fsdp stores it once under its first name and lists the others as aliases, so the aliases are
    # left out of the load (which would otherwise miss them) and filled from the stored name.
    msd = get_model_state_dict(model)
    aliases = {a: name for name, meta in manifest["model"]["params"].items() for a in meta["aliases"]}
    stored = {k: v for k, v in msd.items() if k not in aliases}
    dcp.load(stored, storage_reader=HuggingFaceStorageReader(os.path.join(checkpoint, "model")))
    for alias, name in aliases.items():
        stored[alias] = stored[name]
    set_model_state_dict(model, stored)  # strict: every name of the model must be there
    assert model.head.weight is model.tok_emb.weight, "the load must keep the tie"

    names = {p: n for n, p in model.named_parameters()}  # the tied weight once, as fsdp names it
    checked = {"model": check_against_files(os.path.join(checkpoint, "model"),
                                            {n: p for p, n in names.items()})}
    if not model_only:
        # The optimizer, as a flattened state dict (state.<fqn>.<key>, param_groups.<fqn>.<option>).
        # Its key set comes from PyTorch itself: get_optimizer_state_dict first initializes the
        # empty AdamW state (one step with zero gradients and lr 0, which leaves the weights as
        # they are), so every key set_optimizer_state_dict expects is there, the tied weight's
        # once. Each value is then replaced by the checkpoint's.
        osd = get_optimizer_state_dict(model, optim, options=FLATTEN)
        # exp_avg and exp_avg_sq are DTensors sharded like their parameter: DCP reads into each
        # rank's shard whichever saved boxes overlap it (fsdp's flat ranges, FSDP2's row chunks).
        tensors = {k: v for k, v in osd.items() if k.startswith("state.") and not k.endswith(".step")}
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(os.path.join(checkpoint, "optim")))
        osd.update(tensors)
        # The step counts are integers in the manifest; PyTorch's AdamW (not capturable, not fused)
        # keeps each as a 0-d float32 tensor on the CPU: the dtype of the one it just made.
        for fqn, n in manifest["optimizer"]["steps"].items():
            key = f"state.{fqn}.step"
            assert osd[key].shape == (), (key, osd[key].shape)
            osd[key] = torch.tensor(float(n), dtype=osd[key].dtype)
        # The groups' hyper-parameters, under every parameter of the group. The manifest's groups
        # must be this optimizer's groups (fsdp-train and vs_pytorch group by the same rule).
        by_name = {n: p for p, n in names.items()}
        ours = [{id(by_name[n]) for n in g["params"]} for g in manifest["optimizer"]["groups"]]
        theirs = [{id(p) for p in g["params"]} for g in optim.param_groups]
        if ours != theirs:
            raise ValueError("the manifest's optimizer groups are not this optimizer's groups")
        for group in manifest["optimizer"]["groups"]:
            for fqn in group["params"]:
                for option, value in group["options"].items():
                    key = f"param_groups.{fqn}.{option}"
                    if key not in osd:
                        raise ValueError(f"{key}: PyTorch's AdamW has no option {option!r}")
                    osd[key] = tuple(value) if option == "betas" else value
        set_optimizer_state_dict(model, optim, osd, options=FLATTEN)
        checked["optim"] = check_optimizer(checkpoint, manifest, optim, names)

    batches = load_pt(os.path.join(export_dir, "batches.pt"))
    return {"losses": train(cfg, model, optim, batches, rank, W, first, last), "checked": checked}


def check_against_files(folder, tensors):
    """Every name in `tensors` (DTensors) against the folder's files, whole tensor by whole tensor,
    read with safetensors alone (not DCP). Collective (full_tensor). Returns the count checked."""
    pieces = read_folder(folder)
    for name, t in tensors.items():
        if not torch.equal(t.full_tensor(), assemble(pieces[name], name)):
            raise AssertionError(f"{folder}: {name} differs from the file after the load")
    return len(tensors)


def check_optimizer(checkpoint, manifest, optim, names):
    """The loaded AdamW state against the checkpoint: every exp_avg and exp_avg_sq bitwise, every
    step count, every group's hyper-parameters. Returns the counts checked."""
    state = {}
    for p, name in names.items():
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"state.{name}.{key}"] = optim.state[p][key]
        step = optim.state[p]["step"]
        if step.dtype != torch.float32 or step.item() != manifest["optimizer"]["steps"][name]:
            raise AssertionError(f"{name}: step {step!r}, the manifest says {manifest['optimizer']['steps'][name]}")
    tensors = check_against_files(os.path.join(checkpoint, "optim"), state)
    for group, saved in zip(optim.param_groups, manifest["optimizer"]["groups"]):
        for option, value in saved["options"].items():
            if (list(group[option]) if option == "betas" else group[option]) != value:
                raise AssertionError(f"group option {option}: {group[option]} loaded, {value} saved")
    return {"tensors": tensors, "steps": len(names), "groups": len(optim.param_groups)}


def resume(args):
    res = spawn(resume_rank, os.path.abspath(args.checkpoint), os.path.abspath(args.export_dir),
                args.first, args.last, args.model_only)
    for i, loss in enumerate(res["losses"]):
        print(f"step {args.first + i:4d}  loss {loss:.7f}")
    print(json.dumps(res))


# ---------------------------------------------------------------------------------------------
# save: PyTorch FSDP2 -> a DCP Hugging Face folder

def save_rank(rank, W, export_dir, steps, out, continue_to):
    cfg, model, optim = build(export_dir, W, init_weights=True)
    batches = load_pt(os.path.join(export_dir, "batches.pt"))
    losses = train(cfg, model, optim, batches, rank, W, 0, steps)

    # get_model_state_dict names the tied weight twice (tok_emb.weight, head.weight), and the HF
    # writer's safetensors.save refuses tensors that share memory ("Some tensors share memory"):
    # the save fails on every rank, leaving empty files. So the tied weight is saved once, under
    # the name named_parameters() yields first, as fsdp stores it; the other names (the aliases)
    # are listed in optimizer_groups.json.
    first_names = {p: n for n, p in model.named_parameters()}
    aliases = {n: first_names[p] for n, p in model.named_parameters(remove_duplicate=False)
               if first_names[p] != n}
    msd = {k: v for k, v in get_model_state_dict(model).items() if k not in aliases}
    osd = get_optimizer_state_dict(model, optim, options=FLATTEN)
    # Only tensors go to the files. torch 2.11's HuggingFaceStorageWriter does not refuse the
    # non-tensor entries (param_groups.<fqn>.lr, .betas, ...): it writes each as a torch.save zip
    # archive at the start of the file, before the safetensors header, and the save "succeeds"
    # with a file that neither safetensors nor HuggingFaceStorageReader can open ("header too
    # large"). The hyper-parameters go to optimizer_groups.json instead.
    tensors = {k: v for k, v in osd.items() if isinstance(v, torch.Tensor)}
    dropped = sorted({k.split(".")[-1] for k in osd if k not in tensors})
    assert all(k.startswith("param_groups.") for k in osd if k not in tensors)
    # Model and optimizer keys cannot collide (the optimizer's start with state.), so one folder
    # holds both. save_distributed: every rank writes its own shard-<rank+1>-... file.
    sd = {**msd, **tensors}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))

    if rank == 0:
        # The groups as fsdp's manifest writes them (optimizer.groups), and the tied names.
        groups = [{"params": [first_names[p] for p in g["params"]],
                   "options": {o: (list(g[o]) if o == "betas" else g[o]) for o in MANIFEST_OPTIONS}}
                  for g in optim.param_groups]
        with open(os.path.join(out, "optimizer_groups.json"), "w") as f:
            json.dump({"type": "AdamW", "groups": groups, "aliases": aliases}, f, indent=1)
    dist.barrier()  # the JSON is there before anyone reads the folder back

    # Round trip: the folder, read back by PyTorch's own Hugging Face reader into fresh tensors
    # sharded the same way, equals what was saved, bit for bit.
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp.load(back, storage_reader=HuggingFaceStorageReader(out))
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    differ = [k for k in sd if not torch.equal(local(back[k]), local(sd[k]))]
    if differ:
        raise AssertionError(f"read back differently: {differ}")

    result = {"losses": losses, "saved": len(sd), "model_keys": len(msd), "optim_keys": len(tensors),
              "dropped_options": dropped}
    if continue_to:
        result["continued_losses"] = train(cfg, model, optim, batches, rank, W, steps, continue_to)
    return result


def save(args):
    if os.path.exists(args.out) and os.listdir(args.out):
        raise SystemExit(f"{args.out} is not empty: DCP would mix old and new files")
    if args.continue_to and args.continue_to <= args.steps:
        raise SystemExit("--continue-to must be after --steps")
    res = spawn(save_rank, os.path.abspath(args.export_dir), args.steps, os.path.abspath(args.out),
                args.continue_to)
    for i, loss in enumerate(res["losses"] + res.get("continued_losses", [])):
        print(f"step {i:4d}  loss {loss:.7f}")
    print(json.dumps(res))


# ---------------------------------------------------------------------------------------------
# describe

def describe(args):
    files = {}
    for path in sorted(glob.glob(os.path.join(args.path, "*"))):
        name = os.path.basename(path)
        if not name.endswith(".safetensors"):
            files[name] = {"bytes": os.path.getsize(path)}
            continue
        try:
            with safe_open(path, framework="pt") as f:
                meta = dict(f.metadata() or {})
                info = json.loads(meta.pop("DCP_SHARDING_INFO", "{}"))
                tensors = {k: {"dtype": f.get_slice(k).get_dtype(), "shape": f.get_slice(k).get_shape(),
                               "saved_offsets": info.get(k, {}).get("saved_offsets")} for k in sorted(f.keys())}
        except Exception as e:  # e.g. a file the HF writer wrote non-tensors into
            files[name] = {"bytes": os.path.getsize(path), "error": f"{type(e).__name__}: {e}"}
            print(f"{name}: cannot be read: {e}")
            continue
        files[name] = {"bytes": os.path.getsize(path), "metadata": meta, "tensors": tensors}
        print(f"{name}  ({os.path.getsize(path)} bytes, metadata {meta})")
        for k, t in tensors.items():
            print(f"  {k:45s} {t['dtype']:5s} {str(t['shape']):12s} saved_offsets {t['saved_offsets']}")
    print(json.dumps({"path": args.path, "files": files}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("resume", help="train on in PyTorch FSDP2 from a SHARDED fsdp checkpoint")
    s.add_argument("--checkpoint", required=True, help="a SHARDED checkpoint folder (step-N)")
    s.add_argument("--export-dir", required=True, help="fsdp-train --export-init's folder")
    s.add_argument("--first", type=int, required=True, help="the first step to train (the checkpoint's step)")
    s.add_argument("--last", type=int, required=True, help="train steps first..last-1")
    s.add_argument("--model-only", action="store_true",
                   help="load the weights but not the optimizer state (a control: the losses must then differ)")
    s = sub.add_parser("save", help="train in PyTorch FSDP2 and save model + AdamW state as DCP HF safetensors")
    s.add_argument("--export-dir", required=True)
    s.add_argument("--steps", type=int, required=True, help="train steps 0..steps-1, then save")
    s.add_argument("--out", required=True, help="the folder to save into (new or empty)")
    s.add_argument("--continue-to", type=int, default=0, help="after the save, train on to this step")
    s = sub.add_parser("describe", help="list a folder's safetensors tensors and their DCP_SHARDING_INFO")
    s.add_argument("--path", required=True)
    args = p.parse_args()
    {"resume": resume, "save": save, "describe": describe}[args.cmd](args)


if __name__ == "__main__":
    main()
