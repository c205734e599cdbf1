#!/usr/bin/env bash
# GPU tests in one device call.
#   here:       tools/device/test.sh build     (configures and builds build-cuda with the CUDA path)
#   device run: tools/device/test.sh run       (carry: build-cuda/bin)
# `run` executes every CUDA kernel test against its CPU twin and the golden cases through the
# CUDA path, writes the gtest JSON report to $OUT, and prints a pass/fail table last.
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-run}
build_dir=${BUILD_DIR:-build-cuda}

if [[ $mode == build ]]; then
  cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DMETRALE_CUDA=ON >/dev/null
  cmake --build "$build_dir" -j "$(nproc)" --target metrale metrale_cuda_tests metrale_engine_tests || exit 1
  # The GPU machine's image lacks some Debian libraries the binaries use: they travel with bin/.
  mkdir -p "$build_dir/bin/lib"
  for binary in "$build_dir/bin/metrale" "$build_dir/bin/metrale_cuda_tests" "$build_dir/bin/metrale_engine_tests"; do
    ldd "$binary" | awk '/=> \/(usr\/)?lib\/x86_64-linux-gnu\/lib(fmt|onig|utf8proc|cpp-httplib|brotli|ssl|crypto|xxhash)/ {print $3}'
  done | sort -u | xargs -r cp -L -t "$build_dir/bin/lib"
  exit 0
fi
export LD_LIBRARY_PATH="$PWD/$build_dir/bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

out=${OUT:-/tmp/metrale-test-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
filter=${GTEST_FILTER:-*}
"$build_dir/bin/metrale_cuda_tests" --gtest_filter="$filter" --gtest_output="json:$out/cuda_tests.json" \
  >"$out/cuda_tests.log" 2>&1
status=$?
# The engine's GPU tests (decode, verify, commit and MTP graphs against plain decoding) live with
# the engine tests; they run here, the CPU ones in CI.
if [[ -x $build_dir/bin/metrale_engine_tests ]]; then
  "$build_dir/bin/metrale_engine_tests" --gtest_filter="${ENGINE_GTEST_FILTER:-*Gpu*}" \
    --gtest_output="json:$out/engine_gpu_tests.json" >"$out/engine_gpu_tests.log" 2>&1
  engine_status=$?
  grep -E 'Failure|error:' -A4 "$out/engine_gpu_tests.log" | head -40
  grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/engine_gpu_tests.log"
  [[ $engine_status -ne 0 ]] && status=$engine_status
fi
grep -E 'Failure|error:|golden-gpu' -A3 "$out/cuda_tests.log" | head -60
python3 - "$out/cuda_tests.json" <<'PY'
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except Exception as error:
    print(f"no test report: {error}")
    sys.exit(0)
rows = []
for suite in report.get("testsuites", []):
    for test in suite.get("testsuite", []):
        failed = bool(test.get("failures"))
        skipped = test.get("result") == "SKIPPED" or test.get("status") == "NOTRUN"
        rows.append((f'{suite["name"]}.{test["name"]}', "FAIL" if failed else ("skip" if skipped else "pass"), test.get("time", "")))
width = max((len(r[0]) for r in rows), default=10)
table = [f'{"test".ljust(width)}  result  time'] + [f"{n.ljust(width)}  {r:6}  {t}" for n, r, t in rows]
with open(sys.argv[1].replace(".json", "_table.txt"), "w") as f:
    f.write("\n".join(table) + "\n")
# The full table is in $OUT; the tail shows suites and every failure.
suites = {}
for name, result, _ in rows:
    suite = name.split(".")[0].split("/")[-1] if "/" in name.split(".")[0] else name.split(".")[0]
    counts_by = suites.setdefault(suite, {"pass": 0, "FAIL": 0, "skip": 0})
    counts_by[result] += 1
print(f'\n{"suite".ljust(32)} pass  FAIL  skip')
for suite, c in sorted(suites.items()):
    print(f'{suite.ljust(32)} {c["pass"]:4}  {c["FAIL"]:4}  {c["skip"]:4}')
for name, result, time in rows:
    if result == "FAIL":
        print(f"FAILED: {name}")
counts = {k: sum(1 for r in rows if r[1] == k) for k in ("pass", "FAIL", "skip")}
print(f'\n{counts["pass"]} passed, {counts["FAIL"]} failed, {counts["skip"]} skipped')
PY
exit "$status"
