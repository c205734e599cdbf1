#!/usr/bin/env bash
# The host and disk tiers against a multi-turn chat workload (issue 20 item 3), in one device call.
#   device run: tools/device/tier_bench.sh
#               carry: build-cuda/bin, models/default/tokenizer.json, models/default/tokenizer_config.json
# Serves a random-weight model of configs/$PRESET.json (default qwen3-8b) with a GPU share small
# enough (GPU_UTIL, default 0.25) that the prefix cache cannot hold every conversation, three times:
#   none   no tiers: an evicted prefix is recomputed;
#   host   --swap-space HOST_GIB (default 32): evicted prefix blocks wait in pinned host memory;
#   disk   --swap-space DISK_HOST_GIB (default 2) --high-speed-swap $TIER_DIR --swap-disk-space DISK_GIB
#          (default 64): the small host tier spills to files.
# CASES (default "none host disk") picks which of them run, in that order.
# Each runs `metrale bench-serve --turns TURNS` (default 4) over CONVERSATIONS (default 64) conversations
# at CONCURRENCY (default 16) with INPUT_LEN (2048) first prompts, TURN_INPUT_LEN (256) new tokens per
# follow-up and OUTPUT_LEN (64) generated tokens, then prints the first-turn and follow-up TTFT, the
# prefix-cache hit rate and the tier counters from /metrics, and the host <-> device copy rate the
# engine measured at start-up (its plan line). JSON results and logs go to $OUT.
#
# The same flow runs on the CPU with the tiny default model for a check of the script itself:
#   BUILD_DIR=build PRESET= SERVE_ARGS="--device cpu --kv-cache-memory 6MiB --state-checkpoint-slots 6" \
#     INPUT_LEN=64 TURN_INPUT_LEN=16 OUTPUT_LEN=4 CONVERSATIONS=16 CONCURRENCY=4 HOST_GIB=0.05 \
#     DISK_HOST_GIB=0.004 DISK_GIB=0.1 tools/device/tier_bench.sh
# (the default model is a hybrid: without checkpoint slots no prefix can hit, and the tiers stay idle).
set -uo pipefail
cd "$(dirname "$0")/../.."
build_dir=${BUILD_DIR:-build-cuda}
export LD_LIBRARY_PATH="$PWD/$build_dir/bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
out=${OUT:-/tmp/metrale-tier-bench-out}
mkdir -p "$out"
preset=${PRESET-qwen3-8b}
input_len=${INPUT_LEN:-2048}
turn_input_len=${TURN_INPUT_LEN:-256}
output_len=${OUTPUT_LEN:-64}
turns=${TURNS:-4}
conversations=${CONVERSATIONS:-64}
concurrency=${CONCURRENCY:-16}
tier_dir=${TIER_DIR:-/tmp/metrale-tier-bench-disk}
metrale="$build_dir/bin/metrale"

source tools/device/serve_common.sh
serve_model_args "$preset" --gpu-memory-utilization "${GPU_UTIL:-0.25}" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
max_len=$((input_len + (turns - 1) * (output_len + turn_input_len) + output_len + 16))

metric() {  # metric FILE NAME: the value of an unlabelled /metrics sample (0 when absent)
  awk -v name="$2" '$1 == name {print $2; found = 1} END {if (!found) print 0}' "$1"
}

status=0
run_case() {  # run_case NAME [serve flags...]
  local name=$1
  shift
  rm -rf "$tier_dir"
  "$metrale" serve "${model_args[@]}" --port 0 --max-num-seqs "$concurrency" --max-model-len "$max_len" \
    --max-queued-requests 100000 "$@" ${SERVE_ARGS:-} >"$out/serve-$name.out" 2>"$out/serve-$name.log" &
  local pid=$!
  local url
  url=$(wait_for_server "$pid" "$out/serve-$name.out")
  if [[ -z $url ]]; then
    echo "== $name: the server did not start"
    tail -5 "$out/serve-$name.log"
    status=1
    return
  fi
  echo "== $name: $(grep -m1 -oE 'engine ready.*' "$out/serve-$name.log" | cut -c1-400)"
  "$metrale" bench-serve --url "$url" --num-prompts "$conversations" --concurrency "$concurrency" --turns "$turns" \
    --input-len "$input_len" --turn-input-len "$turn_input_len" --output-len "$output_len" --random-tokens \
    "${tokenizer_args[@]}" --result-file "$out/bench-$name.json" >"$out/bench-$name.txt" 2>&1 || status=1
  curl -s "$url/metrics" >"$out/metrics-$name.txt" 2>/dev/null || true
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  local m="$out/metrics-$name.txt"
  echo "   prefix hits $(metric "$m" metrale_prefix_cache_hits_total) of $(metric "$m" metrale_prefix_cache_queries_total) tokens;" \
    "blocks to host $(metric "$m" metrale_prefix_cache_blocks_to_host_total), back $(metric "$m" metrale_prefix_cache_blocks_from_host_total);" \
    "to disk $(metric "$m" metrale_prefix_blocks_to_disk_total) (written ahead $(metric "$m" metrale_prefix_blocks_written_ahead_total))," \
    "back $(metric "$m" metrale_prefix_blocks_from_disk_total) (read ahead for $(metric "$m" metrale_prefix_prefetches_total) requests)," \
    "declined $(metric "$m" metrale_disk_hits_declined_total); lost $(metric "$m" metrale_tier_entries_lost_total)"
}

cases=" ${CASES:-none host disk} "
[[ $cases == *" none "* ]] && run_case none
[[ $cases == *" host "* ]] && run_case host --swap-space "${HOST_GIB:-32}"
if [[ $cases == *" disk "* ]]; then
  mkdir -p "$tier_dir"
  run_case disk --swap-space "${DISK_HOST_GIB:-2}" --high-speed-swap "$tier_dir" --swap-disk-space "${DISK_GIB:-64}"
  rm -rf "$tier_dir"
fi

python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
print()
print(f"{'tiers':>6} {'ok':>4} {'fail':>4} {'out tok/s':>10} {'TTFT 1st mean':>13} {'p50':>8} {'p99':>8} "
      f"{'follow-up mean':>14} {'p50':>8} {'p99':>8}")
for name in ("none", "host", "disk"):
    try:
        r = json.load(open(os.path.join(out, f"bench-{name}.json")))
    except Exception as error:
        print(f"{name:>6} no result ({error})")
        continue
    a, b = r["ttft_first_turn_ms"], r["ttft_follow_up_ms"]
    print(f"{name:>6} {r['completed']:>4} {r['failed']:>4} {r['output_throughput']:>10.1f} {a['mean']:>13.1f} "
          f"{a['median']:>8.1f} {a['p99']:>8.1f} {b['mean']:>14.1f} {b['median']:>8.1f} {b['p99']:>8.1f}")
print("(times in ms)")
PY
exit $status
