#!/usr/bin/env bash
# Speculative decoding benchmarks on the GPU machine (carry: build-cuda/bin). Plain against speculative
# decode per batch size: the demo model's MTP head (adaptive and forced) and n-gram drafts, then a
# random-weight Qwen3-8B and Qwen3.5-35B-A3B with acceptance replayed from a Bernoulli(0.65) pattern
# (BENCHMARK MODE: their outputs are not the model's; 0.65 is the demo MTP head's single-draft
# acceptance on its own text).
# Reports to $OUT; each run is cut at SPEC_LIMIT_S seconds. The demo runs repeat each mode
# SPEC_REPEAT times (alternating; medians and the paired speedups' range reported), the random-weight
# runs SPEC_REPEAT_LARGE times (their engines take longer to build).
set -uo pipefail
cd "$(dirname "$0")/../.."
build_dir=${BUILD_DIR:-build-cuda}
export LD_LIBRARY_PATH="$PWD/$build_dir/bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
out=${OUT:-/tmp/metrale-spec-bench-out}
mkdir -p "$out"
limit=${SPEC_LIMIT_S:-25}
metrale="$build_dir/bin/metrale"
batches=${SPEC_BATCHES:-1,8,64,256}
common=(--num-drafts 3 --batch "$batches" --spec-prompt 64 --spec-tokens 256 --spec-repeat "${SPEC_REPEAT:-3}")
large=(--spec-repeat "${SPEC_REPEAT_LARGE:-1}")
run() {
  local name=$1
  shift
  echo "== $name"
  timeout "$limit" "$metrale" bench "$@" >"$out/spec-$name.txt" 2>&1
  echo "   exit $?"
  grep -v '^\s*$' "$out/spec-$name.txt" | tail -9
}
run demo-mtp --model models/demo --speculative-method mtp "${common[@]}"
run demo-mtp-forced --model models/demo --speculative-method mtp --no-adaptive-speculation "${common[@]}"
run demo-ngram --model models/demo --speculative-method ngram "${common[@]}"
run qwen3-8b-replay --config configs/qwen3-8b.json --random-weights --speculative-method ngram --spec-accept-rate 0.65 \
  --num-drafts 3 --batch "$batches" --spec-prompt 64 --spec-tokens 128 "${large[@]}"
# A hybrid at its published shape (GDN verify and commit at scale): Qwen3.5-35B-A3B, replayed acceptance.
run qwen3.5-35b-a3b-replay --config configs/qwen3.5-35b-a3b.json --random-weights --speculative-method ngram \
  --spec-accept-rate 0.65 --num-drafts 3 --batch "${SPEC_HYBRID_BATCHES:-1,8,64}" --spec-prompt 64 --spec-tokens 96 \
  "${large[@]}"
