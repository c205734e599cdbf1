#!/usr/bin/env bash
# Runs every libFuzzer target of a METRALE_FUZZ build for a bounded time over its committed seed
# corpus (tests/fuzz/corpus/<target>, read only) plus a scratch corpus of what the run finds.
#   tests/fuzz/run_fuzzers.sh BUILD_DIR SECONDS_PER_TARGET [PARALLEL] [TARGET...]
# A crash, leak, timeout or failed invariant leaves its input in BUILD_DIR/fuzz-artifacts/ and makes
# the script fail; add the input to the target's corpus (named crash-<what>) and a regression test.
set -uo pipefail
cd "$(dirname "$0")/../.."
build_dir=${1:?build dir}
seconds=${2:?seconds per target}
parallel=${3:-2}
shift 3 2>/dev/null || shift $#
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(request responses safetensors config tokenizer chat_template reasoning sse)
artifacts="$build_dir/fuzz-artifacts"
# Symbolized reports when the LLVM tools are installed.
for symbolizer in /usr/lib/llvm-16/bin/llvm-symbolizer /usr/bin/llvm-symbolizer-16 /usr/bin/llvm-symbolizer; do
  if [[ -x $symbolizer ]]; then export ASAN_SYMBOLIZER_PATH=$symbolizer; break; fi
done
mkdir -p "$artifacts"

run_one() {
  local target=$1 seconds=$2 build_dir=$3 artifacts=$4
  local scratch="$build_dir/fuzz-corpus/$target"
  mkdir -p "$scratch"
  # Inputs up to 64 KiB (the templates and tokenizers of the seeds are a few KiB); 10 s per input
  # at most; 2 GiB of memory; the interpreter's and parsers' own limits bound the rest.
  if "$build_dir/bin/fuzz_$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
      -print_final_stats=1 -artifact_prefix="$artifacts/$target-" "$scratch" "tests/fuzz/corpus/$target" \
      >"$build_dir/fuzz-$target.log" 2>&1; then
    echo "fuzz $target: $(grep -E '^stat::number_of_executed_units' "$build_dir/fuzz-$target.log" | awk '{print $2}') runs, no failure"
  else
    echo "fuzz $target: FAILED (see $build_dir/fuzz-$target.log)"
    tail -30 "$build_dir/fuzz-$target.log"
    return 1
  fi
}
export -f run_one
printf '%s\n' "${targets[@]}" |
  xargs -P "$parallel" -I{} bash -c 'run_one "$@"' _ {} "$seconds" "$build_dir" "$artifacts"
