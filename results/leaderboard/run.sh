#!/usr/bin/env bash
# The leaderboard (issue 38): RULER 2048 tokens, 13 tasks x 10 samples (seed 42, the samples of results/thesis),
# paper protocol, B = 128, N = 512, one policy at a time on both models, so every finished policy is a complete
# row on both. Resumable (rerun: finished lines are skipped). The dense lines are results/thesis's (copied once,
# made at 2e5ed2e); their fingerprint was computed before 970e162 left the converter's transformers_version stamp
# out of the checkpoint digest (the same weights: results/thesis-hybrid-budget's lines carry today's), hence
# --allow-mixed. Its own model cache, so the Q-filters it fits do not change the default cache's policies.
set -euo pipefail
cd "$(dirname "$0")/../.."
VDJAX="${VDJAX:-.venv/bin/vdjax}"
OUT="${OUT:-results/leaderboard}"
export VDJAX_CACHE="${VDJAX_CACHE:-$HOME/.cache/vdjax-leaderboard}"
BUDGET="${BUDGET:-512}"
# Order (changed after adakv:expected_attention): the likeliest contenders and the moonshot's pieces first.
POLICIES="${POLICIES:-expected_attention adakv:expected_attention adakv:valuediff compactor qfilter kvzip \
leverage cur lagkv random chunkkv:snapkv pyramidkv:valuediff pyramidkv:snapkv adakv:keydiff \
criticaladakv:valuediff criticaladakv:expected_attention}"
MODELS="${MODELS:-smollm2-135m gemma3-270m}"
for MODEL in $MODELS; do
  dir="$OUT/ruler/$MODEL/paper/L2048"
  if [ ! -s "$dir/predictions.jsonl" ]; then  # the thesis's dense lines: the same samples, seed and settings
    mkdir -p "$dir"
    grep '"policy": "dense"' "results/thesis/ruler/$MODEL/paper/L2048/predictions.jsonl" > "$dir/predictions.jsonl"
  fi
  if [ ! -f "$VDJAX_CACHE/$MODEL/vdjax-qfilters/qfilters.json" ]; then  # qfilter's filters, fitted once
    "$VDJAX" analyze --model "$MODEL" --qfilters
  fi
done
for POLICY in $POLICIES; do
  for MODEL in $MODELS; do
    "$VDJAX" eval ruler --model "$MODEL" --policies "dense,$POLICY" --budgets "$BUDGET" --length 2048 \
        --samples 10 --batch-size 10 --block-size 128 --protocol paper --out "$OUT" --allow-mixed
  done
done
