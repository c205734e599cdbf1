#!/usr/bin/env bash
# The whole GPU check in one device call: the CUDA tests, the hybrid-model benchmarks, the serving
# benchmark and the speculative-decoding benchmark, each under its own time limit.
#   here:       tools/device/test.sh build            (build-cuda: metrale, metrale_cuda_tests)
#               tar czf third_party_ignored/build-cuda-bin.tgz build-cuda/bin
#               tar czf third_party_ignored/qwen3_tokenizer.tgz -C models/default tokenizer.json tokenizer_config.json
#   device run: tools/device/full_check.sh
#               carry: third_party_ignored/build-cuda-bin.tgz, third_party_ignored/qwen3_tokenizer.tgz
# The binaries and the Qwen3 tokenizer (git-ignored, 11 MB) travel compressed to stay inside the device
# call's size limit (64 MiB with the tracked files).
# Each part's files go to a folder of its own; everything is packed into $OUT/full_check.tgz and the
# summaries are printed as the parts finish. Parts: PARTS="tests bench serve spec" (default: all).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/metrale-full-check}
work=$(mktemp -d)
mkdir -p "$out"
if [[ -f third_party_ignored/qwen3_tokenizer.tgz && ! -f models/default/tokenizer.json ]]; then
  tar xzf third_party_ignored/qwen3_tokenizer.tgz -C models/default
fi
export BUILD_DIR=${BUILD_DIR:-build-cuda}
if [[ -f third_party_ignored/build-cuda-bin.tgz && ! -x $BUILD_DIR/bin/metrale ]]; then
  tar xzf third_party_ignored/build-cuda-bin.tgz
fi
export LD_LIBRARY_PATH="$PWD/$BUILD_DIR/bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
parts=" ${PARTS:-tests bench serve spec} "
started=$SECONDS

# run_part NAME LIMIT_S COMMAND...: runs COMMAND with OUT=$work/NAME, stops it at LIMIT_S.
run_part() {
  local name=$1 limit=$2
  shift 2
  [[ $parts == *" $name "* ]] || return 0
  mkdir -p "$work/$name"
  echo "=== $name (limit ${limit} s, at $((SECONDS - started)) s)"
  OUT="$work/$name" timeout --kill-after=10 "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - started)) s"
}

run_part tests 120 tools/device/test.sh run
# Qwen3.5-35B-A3B (bf16, random weights at the published shapes): decode at batch 1-128, prefill to 32K.
run_part bench 100 env BATCHES=1,8,32,128 PREFILLS=2048,8192,32768 CONTEXT=1024 ITERS=${BENCH_ITERS:-10} \
  tools/device/bench.sh qwen3.5-35b-a3b
# Qwen3-8B behind `metrale serve`: 1,024 in / 1,024 out at concurrency 1, 16, 64, 256, one wave each.
run_part serve 110 env WAVES=1 TOKENIZER_DIR=models/default tools/device/bench_serve.sh run
# Speculative decoding on the demo model.
if [[ -x tools/device/spec_bench.sh ]]; then
  run_part spec 70 env SPEC_LIMIT_S=16 tools/device/spec_bench.sh
fi

tar czf "$out/full_check.tgz" -C "$work" .
echo "full_check: packed $(du -h "$out/full_check.tgz" | cut -f1) into \$OUT/full_check.tgz after $((SECONDS - started)) s"
