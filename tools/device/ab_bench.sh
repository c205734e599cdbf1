#!/usr/bin/env bash
# A/B benchmark in one device call: each preset runs `metrale bench` with random weights alternately
# under side A and side B, REPEAT times each (A B A B ...), so that both see the same GPU, clocks and
# thermal state; the table gives per row the median step time of each and the ratio B/A. For
# refactors that must not cost speed, and for runtime switches (the same binary under two settings).
#   here:       tar cJf third_party_ignored/ab.txz -C <dir of A> metrale-a -C <dir of B> metrale-b lib/...
#   device run: tools/device/ab_bench.sh A B [preset ...]   (carry the binaries' folder)
# A and B are each a binary, optionally preceded by VAR=value settings, as one word:
#   tools/device/ab_bench.sh "METRALE_PDL=0 build-cuda/bin/metrale" build-cuda/bin/metrale qwen3-8b
# Env: REPEAT (3), BATCHES, CONTEXT, PREFILLS (empty: no prefill), ITERS as in bench.sh; EXTRA_ARGS: more bench flags for
# both sides (e.g. "--quantization fp8"); LIB_DIR: extra shared libraries.
set -uo pipefail
cd "$(dirname "$0")/../.."
a_bin=$1 b_bin=$2
shift 2
presets=("$@")
[[ ${#presets[@]} -gt 0 ]] || presets=(qwen3-8b qwen3-30b-a3b qwen3.5-35b-a3b)
[[ -n ${LIB_DIR:-} ]] && export LD_LIBRARY_PATH="$LIB_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
out=${OUT:-/tmp/metrale-ab-out}
mkdir -p "$out"
repeat=${REPEAT:-3}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
for preset in "${presets[@]}"; do
  for ((i = 0; i < repeat; ++i)); do
    for side in a b; do
      side_command=$a_bin
      [[ $side == b ]] && side_command=$b_bin
      read -r -a command_words <<<"$side_command"
      read -r -a extra_args <<<"${EXTRA_ARGS:-}"
      env "${command_words[@]}" bench --config "configs/$preset.json" --random-weights "${extra_args[@]}" \
        --batch "${BATCHES-1,8,32,128}" --context "${CONTEXT:-1024}" --prefill "${PREFILLS-512,2048,8192}" \
        --iters "${ITERS:-20}" --json >"$out/$preset-$side-$i.json" 2>"$out/$preset-$side-$i.log" ||
        { echo "$preset $side run $i failed:"; tail -3 "$out/$preset-$side-$i.log"; }
    done
  done
  echo "== $preset done"
done
python3 - "$out" "$repeat" "${presets[@]}" <<'PY'
import json, os, statistics, sys
out, repeat, presets = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
worst = 0.0
for preset in presets:
    rows = {}
    for side in "ab":
        for i in range(repeat):
            try:
                data = json.load(open(os.path.join(out, f"{preset}-{side}-{i}.json")))
            except Exception as error:
                print(f"{preset} {side} {i}: no result ({error})")
                continue
            for r in data["results"]:
                key = (r["phase"], r["batch"], r["tokens"], r["context"])
                rows.setdefault(key, {"a": [], "b": []})[side].append(r["step_ms"])
    print(f"\n{preset}: median step ms over {repeat} alternating runs each")
    print(f"  {'phase':8} {'batch':>5} {'tokens':>6} {'ctx':>6} {'A ms':>9} {'B ms':>9} {'B/A':>7}")
    for key, sides in rows.items():
        if not sides["a"] or not sides["b"]:
            continue
        a, b = statistics.median(sides["a"]), statistics.median(sides["b"])
        worst = max(worst, b / a)
        print(f"  {key[0]:8} {key[1]:>5} {key[2]:>6} {key[3]:>6} {a:>9.3f} {b:>9.3f} {b / a:>7.3f}")
print(f"\nslowest B/A ratio: {worst:.3f}")
PY
