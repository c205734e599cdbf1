#!/usr/bin/env bash
# The serving benchmark on the GPU machine, in one device call.
#   here:       tools/device/bench_serve.sh build   (builds build-cuda's metrale and gathers the
#                                                    Debian libraries it needs into bin/lib)
#   device run: tools/device/bench_serve.sh [run]
#               carry: build-cuda/bin, models/default/tokenizer.json, models/default/tokenizer_config.json
#               (the Qwen3 tokenizer is git-ignored: scripts/install-deps.sh puts it there)
# Starts `metrale serve` on a random-weight model of configs/$PRESET.json (default qwen3-8b) with
# the Qwen3 tokenizer of models/default (TOKENIZER_DIR), then runs `metrale bench-serve` with token-id prompts of INPUT_LEN
# tokens and OUTPUT_LEN generated tokens (ignore_eos) at each concurrency of CONCURRENCIES
# (default 1,16,64,256), NUM_PROMPTS per run (default: WAVES x concurrency, WAVES 2, at least 2). JSON results
# and the server log go to $OUT; a table is printed last. Record it in docs/perf.md with the commit.
#
# The same flow runs on the CPU with the tiny default model for a check of the script itself:
#   BUILD_DIR=build SERVE_ARGS="--device cpu" PRESET= INPUT_LEN=32 OUTPUT_LEN=8 CONCURRENCIES=1,4 \
#     tools/device/bench_serve.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-run}
build_dir=${BUILD_DIR:-build-cuda}

if [[ $mode == build ]]; then
  cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DMETRALE_CUDA=ON >/dev/null
  cmake --build "$build_dir" -j "$(nproc)" --target metrale || exit 1
  # The GPU machine's image lacks some Debian libraries the binary uses: they travel with bin/.
  mkdir -p "$build_dir/bin/lib"
  ldd "$build_dir/bin/metrale" |
    awk '/=> \/(usr\/)?lib\/x86_64-linux-gnu\/lib(fmt|onig|utf8proc|cpp-httplib|brotli|ssl|crypto)/ {print $3}' |
    sort -u | xargs -r cp -L -t "$build_dir/bin/lib"
  exit 0
fi
export LD_LIBRARY_PATH="$PWD/$build_dir/bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

out=${OUT:-/tmp/metrale-bench-serve-out}
mkdir -p "$out"
preset=${PRESET-qwen3-8b}
input_len=${INPUT_LEN:-1024}
output_len=${OUTPUT_LEN:-1024}
IFS=, read -r -a concurrencies <<<"${CONCURRENCIES:-1,16,64,256}"
max_concurrency=$(printf '%s\n' "${concurrencies[@]}" | sort -n | tail -1)
metrale="$build_dir/bin/metrale"

source tools/device/serve_common.sh
serve_model_args "$preset" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true

# The server: room for every concurrent sequence at full length, prefill chunks of up to 8K tokens.
"$metrale" serve "${model_args[@]}" --port 0 --max-num-seqs "$max_concurrency" \
  --max-model-len $((input_len + output_len + 16)) --max-num-batched-tokens "${MAX_BATCHED_TOKENS:-8192}" \
  --max-queued-requests 100000 ${SERVE_ARGS:-} >"$out/serve.out" 2>"$out/serve.log" &
server_pid=$!
stop_server() { kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null; }
trap stop_server EXIT
url=$(wait_for_server "$server_pid" "$out/serve.out")
if [[ -z $url ]]; then
  echo "bench_serve: the server did not start"
  tail -20 "$out/serve.log"
  exit 1
fi
echo "server: $(head -1 "$out/serve.out")"

status=0
for concurrency in "${concurrencies[@]}"; do
  waves=${WAVES:-2}  # prompts per run: WAVES x concurrency, at least 2 (NUM_PROMPTS overrides)
  prompts=${NUM_PROMPTS:-$((concurrency * waves > 2 ? concurrency * waves : 2))}
  echo "== concurrency $concurrency, $prompts prompts of $input_len in / $output_len out"
  "$metrale" bench-serve --url "$url" --concurrency "$concurrency" --num-prompts "$prompts" \
    --input-len "$input_len" --output-len "$output_len" --random-tokens "${tokenizer_args[@]}" \
    --result-file "$out/bench-serve-c$concurrency.json" >"$out/bench-serve-c$concurrency.txt" 2>&1 || status=1
  grep -E 'Successful|Failed|duration|Output token throughput|Mean TTFT|Mean TPOT' "$out/bench-serve-c$concurrency.txt"
done
curl -s "$url/metrics" >"$out/metrics.txt" 2>/dev/null || true

python3 - "$out" "${concurrencies[@]}" <<'PY'
import json, os, sys
out = sys.argv[1]
print()
print(f"{'conc':>5} {'reqs':>5} {'req/s':>7} {'out tok/s':>10} {'total tok/s':>11} "
      f"{'TTFT mean':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT mean':>10} {'TPOT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")
for concurrency in sys.argv[2:]:
    path = os.path.join(out, f"bench-serve-c{concurrency}.json")
    try:
        r = json.load(open(path))
    except Exception as error:
        print(f"{concurrency:>5} no result ({error})")
        continue
    print(f"{concurrency:>5} {r['completed']:>5} {r['request_throughput']:>7.2f} {r['output_throughput']:>10.1f} "
          f"{r['total_token_throughput']:>11.1f} {r['ttft_ms']['mean']:>10.1f} {r['ttft_ms']['median']:>9.1f} "
          f"{r['ttft_ms']['p99']:>9.1f} {r['tpot_ms']['mean']:>10.2f} {r['tpot_ms']['p99']:>9.2f} "
          f"{r['itl_ms']['median']:>8.2f} {r['itl_ms']['p99']:>8.2f}")
print("(times in ms)")
PY
exit $status
