"""Python's side of fsdp's checkpoints (tests/test_checkpoint.cpp drives it; docs/checkpoints.md).

  full-loss   load a FULL checkpoint's model file with safetensors.torch.load_file into the GPT
              port of bench/vs_pytorch.py (load_state_dict) and print its loss on one exported batch
  dcp-load    load a SHARDED checkpoint's folders with torch.distributed.checkpoint's Hugging Face
              reader into plain shaped tensors (one process: another world size than the save's) and
              compare them bitwise with a FULL checkpoint's files of the same step (and, with
              --export, the model with an export_full file of it); --table NAME lists the pieces
              the rank files hold of NAME (file, saved_offsets, shape)
  save        write a freshly initialized GPT port's weights as safetensors, as torch.save of a
              dict, and as torch.save of model.state_dict() (an OrderedDict)
  compare     compare two safetensors model files bitwise, name by name (aliases resolved)

Every command prints one JSON object on its last line.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from vs_pytorch import GPT, lm_loss, load_pt  # noqa: E402  (the port the benchmark trains)
from safetensors.torch import load_file, save_file, save_model  # noqa: E402


def make_model(export_dir):
    with open(os.path.join(export_dir, "config.json")) as f:
        cfg = json.load(f)
    return GPT(cfg["vocab_size"], cfg["block_size"], cfg["n_layer"], cfg["n_head"], cfg["d_model"])


def full_loss(args):
    with open(os.path.join(args.checkpoint, "manifest.json")) as f:
        manifest = json.load(f)
    sd = load_file(os.path.join(args.checkpoint, "model", "model.safetensors"))
    # A tied weight is stored once; the manifest lists its other names.
    for name, meta in manifest["model"]["params"].items():
        for alias in meta["aliases"]:
            sd[alias] = sd[name]
    model = make_model(args.export_dir)
    model.load_state_dict(sd, strict=True)
    assert model.head.weight is model.tok_emb.weight, "load_state_dict must keep the tie"
    batches = load_pt(os.path.join(args.export_dir, "batches.pt"))
    with torch.no_grad():
        loss = lm_loss(model(batches["x"][args.step]), batches["y"][args.step]).item()
    print(json.dumps({"loss": loss}))


def dcp_load(args):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with open(os.path.join(args.sharded, "manifest.json")) as f:
        manifest = json.load(f)
    params = manifest["model"]["params"]
    checked, differ, keys = 0, [], []
    for folder, full_file in (("model", "model/model.safetensors"), ("optim", "optim/optim.safetensors")):
        full = load_file(os.path.join(args.full, full_file))
        # Plain tensors of the whole shapes, which the reader fills from the rank files' pieces.
        sd = {}
        for key in full:
            sd[key] = torch.empty_like(full[key]).fill_(float("nan"))
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(path=os.path.join(args.sharded, folder)), no_dist=True)
        exported = load_file(args.export) if args.export and folder == "model" else {}
        for key, t in sd.items():
            checked += 1
            keys.append(key)
            if not torch.equal(t, full[key]):
                differ.append(key)
            if exported and not torch.equal(t, exported[key]):
                differ.append(key + " (against " + args.export + ")")
    pieces = []
    if args.table:
        from safetensors import safe_open
        folder = os.path.join(args.sharded, "model")
        for name in sorted(os.listdir(folder)):
            with safe_open(os.path.join(folder, name), "pt") as f:
                info = json.loads((f.metadata() or {}).get("DCP_SHARDING_INFO", "{}"))
                if args.table in f.keys():
                    shape = list(f.get_slice(args.table).get_shape())
                    pieces.append({"file": name, "saved_offsets": info[args.table]["saved_offsets"], "shape": shape})
    print(json.dumps({"checked": checked, "differ": differ, "params": len(params), "keys": keys, "pieces": pieces}))


def save(args):
    torch.manual_seed(args.seed)
    model = make_model(args.export_dir)
    os.makedirs(args.out, exist_ok=True)
    save_model(model, os.path.join(args.out, "model.safetensors"))  # one name of the tied pair
    torch.save(dict(model.state_dict()), os.path.join(args.out, "model_dict.pt"))
    torch.save(model.state_dict(), os.path.join(args.out, "model_ordered.pt"))
    # The reference for `compare`: every tensor once, under the names safetensors keeps.
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"},
              os.path.join(args.out, "reference.safetensors"))
    print(json.dumps({"saved": sorted(os.listdir(args.out))}))


def compare(args):
    a, b = load_file(args.a), load_file(args.b)
    tied = {"head.weight": "tok_emb.weight"}
    keys = {tied.get(k, k) for k in a} | {tied.get(k, k) for k in b}
    get = lambda d, k: d[k] if k in d else d[[x for x, v in tied.items() if v == k][0]]  # noqa: E731
    differ = [k for k in sorted(keys) if not torch.equal(get(a, k), get(b, k))]
    print(json.dumps({"compared": len(keys), "differ": differ}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("full-loss")
    s.add_argument("--checkpoint", required=True)
    s.add_argument("--export-dir", required=True)
    s.add_argument("--step", type=int, required=True)
    s = sub.add_parser("dcp-load")
    s.add_argument("--sharded", required=True, help="a SHARDED checkpoint folder (step-N)")
    s.add_argument("--full", required=True, help="a FULL checkpoint folder of the same state")
    s.add_argument("--export", help="an export_full file of the same state")
    s.add_argument("--table", help="a tensor whose pieces in the rank files to list")
    s = sub.add_parser("save")
    s.add_argument("--export-dir", required=True)
    s.add_argument("--seed", type=int, default=7)
    s.add_argument("--out", required=True)
    s = sub.add_parser("compare")
    s.add_argument("--a", required=True)
    s.add_argument("--b", required=True)
    args = p.parse_args()
    {"full-loss": full_loss, "dcp-load": dcp_load, "save": save, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
