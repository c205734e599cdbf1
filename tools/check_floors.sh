#!/usr/bin/env bash
# Checks that each floor of src/ includes only its own headers and those of the floors below it
# (docs/architecture.md). Prints every violating include and exits 1 when there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
floors=(core runtime kernels model cache engine text server)
status=0
for ((i = 0; i < ${#floors[@]}; i++)); do
  floor=${floors[$i]}
  [[ -d src/$floor ]] || continue
  allowed=("${floors[@]:0:$((i + 1))}")
  # text (tokenizer, templates) stands beside the engine: it may use core only.
  if [[ $floor == text ]]; then allowed=(core text); fi
  pattern=$(IFS='|'; echo "${allowed[*]}")
  while IFS= read -r line; do
    file=${line%%:*}
    include=$(sed -E 's/.*#include "([^"]+)".*/\1/' <<<"$line")
    top=${include%%/*}
    if [[ " ${floors[*]} " == *" $top "* ]] && ! [[ $top =~ ^($pattern)$ ]]; then
      echo "floor violation: $file includes $include ($floor may use: ${allowed[*]})"
      status=1
    fi
  done < <(grep -rn '#include "' "src/$floor" || true)
done
exit $status
