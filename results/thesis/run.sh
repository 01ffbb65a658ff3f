#!/usr/bin/env bash
# The thesis run (issue 14): RULER, 13 tasks x 10 samples, 2048 tokens, paper protocol, B=128, budgets 25 % and
# 50 % (N = 512, 1024), on the sink-suppressed Gemma3-270M and the sink-dominated SmolLM2-135M.
# Resumable: rerun this script after any interruption; finished lines are skipped.
#   VDJAX=<vdjax executable> OUT=<results folder> bash results/thesis/run.sh
set -euo pipefail
VDJAX="${VDJAX:-.venv/bin/vdjax}"
OUT="${OUT:-results/thesis}"
POLICIES="dense,streaming,tova,snapkv,keynorm,keydiff,manifoldkv,fastcaote,valuediff,valuediff_dir,valuediff_norm"
for MODEL in gemma3-270m smollm2-135m; do
    "$VDJAX" eval ruler --model "$MODEL" --policies "$POLICIES" --budgets 512,1024 --length 2048 \
        --samples 10 --batch-size 10 --block-size 128 --protocol paper --out "$OUT"
done
