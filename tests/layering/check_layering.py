#!/usr/bin/env python3
"""The include rules between fsdp's folders (docs/design.md, "Layout"), checked on every test run.

src/ has one folder per subsystem. A source may include the public API (include/fsdp/), headers of
its own folder, and headers of the folders listed for it below, always written "folder/file.h".
Nothing else: a lower folder never includes a higher one (the engine does not include checkpoints),
include/fsdp/ never includes src/, models/ include only the public API.

Exit status 0 when every include follows the rules; otherwise each offending line is printed.
"""
import os
import re
import sys

# Lowest first. Each folder may include the folders listed for it (and the public API).
MAY_INCLUDE = {
    "observe": [],                      # the step's timeline and Chrome traces
    "memory": [],                       # device storage, fsdp's CPU allocator, process memory
    "init": [],                         # deferred and meta initialization
    "optim": [],                        # the fused optimizers' update kernels
    "comm": ["observe"],                # collectives, process groups, streams, rate limiter, launch
    "tensor_parallel": ["comm", "observe"],  # the 2-D mesh, the plan, column/row-parallel layers
    "precision": ["comm"],              # mixed precision's dtypes, the sharded gradient scaler
    "engine": ["tensor_parallel", "precision", "comm", "init", "memory", "observe"],  # units, flat params, runtime
    "plan": ["tensor_parallel", "engine", "precision", "comm", "init", "memory", "observe"],  # memory plan and budget
    "wrap": ["tensor_parallel", "plan", "engine", "precision", "comm", "init", "memory", "observe"],  # the wrapper
    "checkpoint": ["tensor_parallel", "wrap", "plan", "engine", "precision", "comm", "init", "memory", "observe"],
    # live replica groups: the coordinator, the quorum protocol, the state a joining group gets
    "fault_tolerance": ["tensor_parallel", "checkpoint", "wrap", "plan", "engine", "precision", "comm", "init", "memory", "observe"],
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def includes(path):
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if m:
                yield number, m.group(1)


def check(root):
    errors = []
    src = os.path.join(root, "src")
    folders = sorted(d for d in os.listdir(src) if os.path.isdir(os.path.join(src, d)))
    for name in sorted(os.listdir(src)):
        if os.path.isfile(os.path.join(src, name)):
            errors.append(f"src/{name}: every source lives in a subsystem folder")
    for folder in folders:
        if folder not in MAY_INCLUDE:
            errors.append(f"src/{folder}/: a folder with no include rule (add it to {__file__})")
            continue
        allowed = set(MAY_INCLUDE[folder]) | {folder}
        for name in sorted(os.listdir(os.path.join(src, folder))):
            rel = f"src/{folder}/{name}"
            for number, target in includes(os.path.join(src, folder, name)):
                if target.startswith("fsdp/"):
                    continue
                head = target.split("/")[0]
                if "/" not in target or head not in MAY_INCLUDE:
                    errors.append(f"{rel}:{number}: \"{target}\": write a private header as \"folder/file.h\"")
                elif head not in allowed:
                    errors.append(f"{rel}:{number}: \"{target}\": {folder}/ may not include {head}/ "
                                  f"(it may include {', '.join(sorted(allowed))})")
                elif not os.path.isfile(os.path.join(src, target)):
                    errors.append(f"{rel}:{number}: \"{target}\" does not exist")
    for top, rule in (("include/fsdp", "the public API includes only itself"),
                      ("models", "models/ include only the public API and models/")):
        for name in sorted(os.listdir(os.path.join(root, top))):
            path = os.path.join(root, top, name)
            for number, target in includes(path):
                ok = target.startswith("fsdp/") or (top == "models" and target.startswith("models/"))
                if not ok:
                    errors.append(f"{top}/{name}:{number}: \"{target}\": {rule}")
    design = open(os.path.join(root, "docs", "design.md"), encoding="utf-8").read()
    for folder in folders:
        if f"src/{folder}/" not in design:
            errors.append(f"docs/design.md: the map of the code does not name src/{folder}/")
    return errors


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    errors = check(os.path.abspath(root))
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} include(s) break the layering (docs/design.md, 'Layout')")
        sys.exit(1)
    print("layering: every include follows the rules")
