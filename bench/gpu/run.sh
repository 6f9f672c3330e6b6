#!/usr/bin/env bash
# The GPU check and benchmark, for the lent H200 machine. From the repository root, after
# bench/gpu/prepare on the development machine and with build-gpu-deps carried:
#
#   bash bench/gpu/run.sh          # everything it measures goes under $OUT (default ./gpu-out)
#
# 1. builds fsdp-train and fsdp-test-worker against the machine's torch (no GoogleTest there);
# 2. CUDA checks: the whole parity suite (tiny GPT + uneven net, SGD and AdamW, two forwards,
#    accumulation, no_sync, clipping) on the GPU against local training on the GPU;
# 3. the ~1B GPT at W=1 in bf16 mixed precision (fp32 master): tokens/s, TFLOPS per GPU, MFU
#    against 989 TFLOPS (dense bf16 peak), peak allocated/active/reserved memory and
#    num_alloc_retries, for the default settings, prefetch off and the rate limiter off, plus one
#    fp32 run; and the same model, weights and batches with PyTorch FSDP2 in bf16
#    (bench/vs_pytorch.py --device cuda --mixed-precision bf16);
# 4. the initialization benchmark on the GPU (deferred, build on the device then shard, build on
#    the CPU and stream unit by unit).
#    At W=1 the sharding factor is 1: nothing is gathered, so prefetch and the rate limiter have
#    nothing to act on there; the rows show that they cost nothing. Overlap needs W >= 2 GPUs.
set -uo pipefail
PY=${FSDP_GPU_PYTHON:-/opt/torch/.venv/bin/python3}
OUT=${OUT:-$PWD/gpu-out}
STEPS=${FSDP_GPU_STEPS:-8}
BATCH=${FSDP_GPU_BATCH:-4}
mkdir -p "$OUT"
say() { echo "== $*" | tee -a "$OUT/summary.txt"; }

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
TORCH_CMAKE=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')
say "configure against $TORCH_CMAKE"
if ! cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFSDP_BUILD_TESTS=OFF \
      -DFSDP_DEPS_DIR="$PWD/build-gpu-deps" -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" > "$OUT/cmake.log" 2>&1; then
  say "configure FAILED"; tail -30 "$OUT/cmake.log"; exit 1
fi
say "build"
if ! cmake --build build-gpu -j "$(nproc)" --target fsdp-train fsdp-test-worker fsdp-bench-init > "$OUT/build.log" 2>&1; then
  say "build FAILED"; grep -m20 -B2 -A6 "error" "$OUT/build.log"; exit 1
fi

say "CUDA parity (W=1, the GPU against local training on the GPU)"
build-gpu/bin/fsdp-test-worker parity --nproc-per-node 1 --device cuda --variants all --out "$OUT/cuda-parity" \
  > "$OUT/cuda-parity.log" 2>&1
"$PY" - "$OUT/cuda-parity.0.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
try:
    cases = json.load(open(sys.argv[1]))["cases"]
except Exception as e:
    print(f"CUDA parity: FAILED to run ({e}); see cuda-parity.log"); sys.exit(0)
bad = [c for c in cases if c["max_param_diff"] > (1e-5 if c["optim"] == "sgd" else 1e-4) or c["max_loss_diff"] > 1e-5
       or not c["unused_grad_none"]]
for c in cases:
    print(f'  {c["model"]:7s} {c["optim"]:6s} {c["variant"]:13s} max|dparam| {c["max_param_diff"]:.1e} max|dloss| {c["max_loss_diff"]:.1e}')
print("CUDA parity:", "PASS" if not bad else f"FAIL ({len(bad)} cases)")
PY

run_ours() {  # label, extra fsdp-train flags
  local label=$1; shift
  build-gpu/bin/fsdp-train --device cuda --model 1b --steps "$STEPS" --global-batch-size "$BATCH" --log-every 1 \
    --run-dir none --sample-tokens 0 --mixed-precision "${PRECISION:-bf16}" \
    --metrics-jsonl "$OUT/ours-$label.jsonl" "$@" > "$OUT/ours-$label.log" 2>&1 || say "ours $label FAILED (see ours-$label.log)"
}
say "1B GPT, W=1, bf16 mixed precision: fsdp"
run_ours default
run_ours no-prefetch --backward-prefetch none
run_ours no-limiter --limit-all-gathers 0
PRECISION=none run_ours fp32
build-gpu/bin/fsdp-train --device cuda --model 1b --steps 3 --global-batch-size "$BATCH" --trace "$OUT/trace" --trace-step 2 \
  --run-dir none --sample-tokens 0 \
  > "$OUT/trace.log" 2>&1 || true

say "1B GPT, W=1, bf16: PyTorch FSDP2, same weights and batches"
"$PY" bench/vs_pytorch.py --device cuda --world-size 1 --model 1b --steps "$STEPS" --warmup 3 --repeats 1 \
  --mixed-precision bf16 --loss-tol 0.1 \
  --global-batch-size "$BATCH" --systems ours,fsdp2 --fsdp-train build-gpu/bin/fsdp-train --markdown \
  > "$OUT/vs_pytorch.txt" 2>&1 || say "vs_pytorch exited $? (see vs_pytorch.txt)"

say "initialization benchmark on the GPU"
build-gpu/bin/fsdp-bench-init --nproc-per-node 1 --device cuda --models default medium large 1b --repeats 1 \
  > "$OUT/bench-init.txt" 2>&1 || say "fsdp-bench-init failed (see bench-init.txt)"

"$PY" - "$OUT" "$BATCH" <<'PY' | tee "$OUT/results.md"
import glob, json, os, statistics, sys
out, batch = sys.argv[1], int(sys.argv[2])
# GPT '1b' (models/gpt.cpp): vocab 50000, block 2048, 24 layers, d_model 1792.
V, T, L, d = 50000, 2048, 24, 1792
N = V * d + T * d + L * (12 * d * d + 13 * d) + 2 * d
flops_per_token = 6 * N + 12 * L * T * d  # matmuls forward+backward, attention scores included
print(f"GPT 1b: {N/1e9:.3f} B parameters, {flops_per_token/1e9:.1f} GFLOP per token (fwd+bwd), global batch {batch} x {T}\n")
print("| fsdp run | median step (ms) | tokens/s | TFLOPS/GPU | MFU vs 989 | peak allocated (GB) | peak reserved (GB) | num_alloc_retries |")
print("|---|---|---|---|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(out, "ours-*.jsonl"))):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    rows = [r for r in rows if r["rank"] == 0 and r["step"] >= 3]
    if not rows:
        continue
    ms = statistics.median(r["step_ms"] for r in rows)
    tps = batch * T / (ms / 1000)
    tflops = tps * flops_per_token / 1e12
    dm = rows[-1]["device_memory"]
    print(f"| {os.path.basename(path)[5:-6]} | {ms:.0f} | {tps:.0f} | {tflops:.1f} | {tflops/989:.1%} | "
          f"{dm['allocated_peak']/1e9:.1f} | {dm['reserved_peak']/1e9:.1f} | {max(r['device_memory']['num_alloc_retries'] for r in rows)} |")
print()
for name in ("vs_pytorch.txt", "bench-init.txt"):
    try:
        print(open(os.path.join(out, name)).read()[-3000:])
    except OSError:
        pass
PY
