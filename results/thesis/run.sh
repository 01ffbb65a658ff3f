#!/usr/bin/env bash
# The thesis run in passes: the 25 % budget (N=512) on both models first, then 50 % (N=1024).
set -euo pipefail
VDJAX="${VDJAX:-.venv/bin/vdjax}"
OUT="${OUT:-results/thesis}"
POLICIES="dense,streaming,tova,snapkv,keynorm,keydiff,manifoldkv,fastcaote,valuediff,valuediff_dir,valuediff_norm"
for BUDGET in 512 1024; do
  for MODEL in gemma3-270m smollm2-135m; do
    "$VDJAX" eval ruler --model "$MODEL" --policies "$POLICIES" --budgets "$BUDGET" --length 2048 \
        --samples 10 --batch-size 10 --block-size 128 --protocol paper --out "$OUT"
  done
done
