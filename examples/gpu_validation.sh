#!/usr/bin/env bash
# The GPU validation round this project runs on the H200 test machine (../shared/gpu/README.md), as one command on
# a 2-GPU lease: tests on one GPU, benchmarks on the other, everything time-boxed, logs and JSON under $OUT.
# Stage the optional libraries first (`bash .gpu/stage.sh a`, `bash .gpu/stage.sh b`), then carry .gpu/wheels and
# .gpu/env.sh and run: `source .gpu/env.sh && bash examples/gpu_validation.sh [tests|bench|backends]`.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
P="-q -p no:cacheprovider -rs --durations=5"
case "${1:-tests}" in
  tests)  # every GPU test; backend-selection parity pays FlashInfer's JIT per head dim on a fresh machine
    (export CUDA_VISIBLE_DEVICES=0
     timeout 400 python3 -m pytest -m gpu $P tests/test_gpu_ab.py >"$OUT/ab.log" 2>&1
     timeout 130 python3 -m pytest -m gpu $P --ignore=tests/test_gpu_ab.py --ignore=tests/test_backend_selection.py \
       >"$OUT/rest.log" 2>&1) &
    (CUDA_VISIBLE_DEVICES=1 timeout 540 python3 -m pytest -m gpu $P tests/test_backend_selection.py \
       >"$OUT/selection.log" 2>&1) &
    wait; tail -3 "$OUT/ab.log" "$OUT/rest.log" "$OUT/selection.log" ;;
  bench)  # WORKLOADS.md figures beside every stock anchor, both shapes
    (CUDA_VISIBLE_DEVICES=0 timeout 580 hf-accel bench --workload w1,w2,w3 --shape qwen3-0.6b \
      --anchors eager,static,generate_batch --anchor-repeats 1 --anchor-warmup 0 --no-progress \
      --json "$OUT/qwen3.json" >"$OUT/qwen3.log" 2>&1) &
    (CUDA_VISIBLE_DEVICES=1 timeout 580 hf-accel bench --workload w1,w2,startup --shape llama-3.1-8b \
      --anchors eager,static --anchor-repeats 1 --anchor-warmup 0 --no-progress \
      --json "$OUT/llama.json" >"$OUT/llama.log" 2>&1) &
    wait; tail -25 "$OUT/qwen3.log" "$OUT/llama.log" ;;
  backends)  # our figures per attention backend (anchors and the auto choice come from the bench round), and where
    # a W2 decode step's time goes
    run() { CUDA_VISIBLE_DEVICES=$1 timeout 250 hf-accel bench --workload w1,w2,w3 --shape qwen3-0.6b --anchors none \
      --attention-backend "$2" --no-progress --json "$OUT/backend-$2.json" >"$OUT/backend-$2.log" 2>&1; }
    (run 0 torch; CUDA_VISIBLE_DEVICES=0 timeout 200 python3 examples/profile_decode.py --shape qwen3-0.6b \
       --batch 64 --new-tokens 128 >"$OUT/profile-w2.log" 2>&1) &
    (run 1 flashinfer; run 1 flash_attn) &
    wait; for b in torch flashinfer flash_attn; do grep -E "hf_accel|guard" "$OUT/backend-$b.log"; done
    tail -40 "$OUT/profile-w2.log" ;;
  # --- one-GPU lease: the same round in three calls of under 600 s each ---
  tests1)  # every backend x graph mode A/B, compile-off fused path, kernels, compilation, fused ops
    timeout 420 python3 -m pytest -m gpu $P tests/test_gpu_ab.py >"$OUT/ab.log" 2>&1
    timeout 150 python3 -m pytest -m gpu $P --ignore=tests/test_gpu_ab.py --ignore=tests/test_backend_selection.py \
      >"$OUT/rest.log" 2>&1
    tail -3 "$OUT/ab.log" "$OUT/rest.log" ;;
  bench1)  # qwen3-0.6b figures beside every stock anchor, then where a W2 decode step's time goes
    timeout 430 hf-accel bench --workload w1,w2,w3 --shape qwen3-0.6b --anchors eager,static,generate_batch \
      --anchor-repeats 1 --anchor-warmup 0 --no-progress --json "$OUT/qwen3.json" >"$OUT/qwen3.log" 2>&1
    timeout 140 python3 examples/profile_decode.py --shape qwen3-0.6b --batch 64 --new-tokens 64 \
      >"$OUT/profile-w2.log" 2>&1
    tail -25 "$OUT/qwen3.log"; grep -A3 "^generate:\|--- GPU" "$OUT/profile-w2.log" | head -12 ;;
  bench2)  # llama-3.1-8b figures and startup, then qwen3 per attention backend (no anchors)
    timeout 340 hf-accel bench --workload w1,w2,startup --shape llama-3.1-8b --anchors eager,static \
      --anchor-repeats 1 --anchor-warmup 0 --no-progress --json "$OUT/llama.json" >"$OUT/llama.log" 2>&1
    for b in flashinfer flash_attn; do
      timeout 115 hf-accel bench --workload w1,w2,w3 --shape qwen3-0.6b --anchors none --attention-backend "$b" \
        --no-progress --json "$OUT/backend-$b.json" >"$OUT/backend-$b.log" 2>&1
    done
    tail -22 "$OUT/llama.log"; for b in flashinfer flash_attn; do grep -E "hf_accel|guard" "$OUT/backend-$b.log"; done ;;
  selection)  # backend-selection parity alone: on a fresh machine FlashInfer JIT-compiles each head dim and each
    # soft-cap / window variant (about 75 s each), which takes most of a call
    timeout 590 python3 -m pytest -m gpu $P -rA tests/test_backend_selection.py >"$OUT/selection.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/selection.log" | tail -30 ;;
esac
