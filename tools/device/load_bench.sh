#!/usr/bin/env bash
# Load time of real checkpoint directories (issue 20 item 4): for each preset, writes a checkpoint of
# random bf16 weights with transformers' names (tools/device/write_random_checkpoint.py), then runs
# `metrale bench --model DIR` twice and prints metrale's own load line and its start-to-ready time.
# The first run reads what the writer left in the page cache; the checkpoint goes to $LOAD_DIR
# (default /dev/shm when it has room, else /tmp), so the figure is the page-cache rate, not the disk's.
#   device run: tools/device/load_bench.sh [preset ...]   default: qwen3-8b qwen3-30b-a3b (carry: build-cuda/bin)
set -uo pipefail
cd "$(dirname "$0")/../.."
build_dir=${BUILD_DIR:-build-cuda}
export LD_LIBRARY_PATH="$PWD/$build_dir/bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
out=${OUT:-/tmp/metrale-load-out}
mkdir -p "$out"
presets=("$@")
[[ ${#presets[@]} -gt 0 ]] || presets=(qwen3-8b qwen3-30b-a3b)
status=0
for preset in "${presets[@]}"; do
  case $preset in qwen3-0.6b) need_gb=2 ;; qwen3-8b) need_gb=17 ;; qwen3-30b-a3b) need_gb=62 ;; *) need_gb=${NEED_GB:-70} ;; esac
  need_kb=$(( need_gb * 1000000 ))
  root=${LOAD_DIR:-}
  if [[ -z $root ]]; then
    shm_kb=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1)
    if [[ -n $shm_kb && $shm_kb -gt $need_kb ]]; then root=/dev/shm; else root=/tmp; fi
  fi
  dir="$root/metrale-load-$preset"
  rm -rf "$dir"
  echo "== $preset in $dir ($(df -h --output=avail "$root" | tail -1 | tr -d ' ') free there)"
  PYTHONUNBUFFERED=1 python3 tools/device/write_random_checkpoint.py "configs/$preset.json" "$dir" \
    >"$out/write-$preset.log" 2>&1
  written=$?
  grep -v Warning "$out/write-$preset.log" | tail -2
  if [[ $written -ne 0 ]]; then status=1; rm -rf "$dir"; continue; fi
  for run in 1 2; do
    start=$(date +%s.%N)
    "$build_dir/bin/metrale" bench --model "$dir" --batch 1 --context 128 --prefill "" --iters 2 \
      ${EXTRA_ARGS:-} >"$out/load-$preset-$run.json" 2>"$out/load-$preset-$run.log" || status=1
    end=$(date +%s.%N)
    echo "run $run: $(grep -E 'loaded [0-9]+ tensors' "$out/load-$preset-$run.log" | sed 's/.*loaded/loaded/')"
    grep -E 'engine ready|error' "$out/load-$preset-$run.log" | sed 's/^/    /' | head -3
    echo "    process wall time $(python3 -c "print(f'{$end - $start:.1f}')") s"
  done
  rm -rf "$dir"
done
exit $status
