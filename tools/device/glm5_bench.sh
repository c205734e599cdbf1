#!/usr/bin/env bash
# The glm5_next kernels (KDA, mHC, DSA) next to flash-linear-attention's KDA, in one device call;
# builds nothing.
#   here:       BUILD_DIR=build-cuda tools/device/test.sh build && cmake --build build-cuda --target metrale_glm5_bench
#               fla's source: third_party_ignored/fla (exported from github:fla-org/flash-linear-attention, git-ignored)
#   device run: tools/device/glm5_bench.sh    (carry: <build>/bin and third_party_ignored)
# Prints our kernels' table, fla's, then the KDA cases side by side; JSON and logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
build_dir=${BUILD_DIR:-build-cuda}
export LD_LIBRARY_PATH="$PWD/$build_dir/bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
out=${OUT:-/tmp/metrale-glm5-bench-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
status=0
echo "== metrale"
"$build_dir/bin/metrale_glm5_bench" --reps "${REPS:-30}" --json "$out/glm5-metrale.json" 2>&1 | tee "$out/glm5-metrale.log" || status=1
echo "== fla"
if [[ -d third_party_ignored/fla ]]; then
  PYTHONUNBUFFERED=1 python3 tools/device/kda_fla_bench.py third_party_ignored --reps "${REPS:-30}" \
    --json "$out/kda-fla.json" 2>&1 | tee "$out/kda-fla.log" | grep -v Warning || status=1
else
  echo "no third_party_ignored/fla: fla not timed"
fi
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return {r["name"]: r["us"] for r in json.load(open(os.path.join(out, name)))["results"]}
    except Exception as error:
        print(f"{name}: {error}")
        return {}
ours, fla = load("glm5-metrale.json"), load("kda-fla.json")
fla = {name.replace(" (g given)", ""): us for name, us in fla.items()}
print(f'\n{"kernel":40} {"metrale us":>11} {"fla us":>9} {"speed-up":>8}')
for name, us in ours.items():
    other = fla.get(name)
    ratio = f"{other / us:7.2f}x" if other else ""
    fla_us = f"{other:9.1f}" if other else ""
    print(f'{name:40} {us:11.1f} {fla_us:>9} {ratio:>8}')
PY
exit $status
