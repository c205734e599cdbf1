#!/usr/bin/env bash
# The standard benchmark set on the GPU machine, in one device call (carry: build-cuda/bin).
#   device run: tools/device/bench.sh [preset ...]      default: qwen3-0.6b qwen3-8b qwen3-30b-a3b
# Each preset runs `metrale bench` with random weights at the published shapes: decode at batch
# 1, 8, 32, 128 with a 1,024-token context and prefill of 512, 2,048 and 8,192 tokens. JSON results
# go to $OUT; the tables are printed last. Append them to docs/perf.md with the commit and date.
set -uo pipefail
cd "$(dirname "$0")/../.."
build_dir=${BUILD_DIR:-build-cuda}
export LD_LIBRARY_PATH="$PWD/$build_dir/bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
out=${OUT:-/tmp/metrale-bench-out}
mkdir -p "$out"
presets=("$@")
[[ ${#presets[@]} -gt 0 ]] || presets=(qwen3-0.6b qwen3-8b qwen3-30b-a3b)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
status=0
for preset in "${presets[@]}"; do
  echo "== $preset"
  "$build_dir/bin/metrale" bench --config "configs/$preset.json" --random-weights \
    --batch "${BATCHES:-1,8,32,128}" --context "${CONTEXT:-1024}" --prefill "${PREFILLS:-512,2048,8192}" \
    --iters "${ITERS:-20}" --json ${EXTRA_ARGS:-} >"$out/bench-$preset.json" 2>"$out/bench-$preset.log" || status=1
  tail -3 "$out/bench-$preset.log"
done
python3 - "$out" "${presets[@]}" <<'PY'
import json, sys, os
out = sys.argv[1]
for preset in sys.argv[2:]:
    path = os.path.join(out, f"bench-{preset}.json")
    try:
        data = json.load(open(path))
    except Exception as error:
        print(f"\n{preset}: no result ({error})")
        continue
    print(f"\n{preset}: {data['weight_bytes']/1e9:.2f} GB weights; copy {data['copy_bandwidth_bytes_per_s']/1e9:.0f} GB/s, "
          f"GEMM {data['gemm_flops_per_s']/1e12:.0f} TFLOP/s")
    print(f"  {data['plan']}")
    print(f"  {'phase':8} {'batch':>5} {'tokens':>6} {'ctx':>6} {'step ms':>9} {'tok/s':>10} {'%HBM':>6} {'%GEMM':>6} graph")
    for r in data["results"]:
        print(f"  {r['phase']:8} {r['batch']:>5} {r['tokens']:>6} {r['context']:>6} {r['step_ms']:>9.3f} "
              f"{r['tokens_per_s']:>10.1f} {100*r['bandwidth_fraction']:>5.1f}% {100*r['compute_fraction']:>5.1f}% {r['cuda_graph']}")
PY
exit $status
