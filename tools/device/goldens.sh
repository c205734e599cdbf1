#!/usr/bin/env bash
# Makes the golden test cases (tests/goldens/) and the bundled default model (models/default/) on the GPU
# machine, where torch and transformers 5.17.0 are installed, and packs them into $OUT/goldens.tgz.
# Run through the device tool from the repository root:   bash tools/device/goldens.sh
# Then, here:   tar xzf <files_at>/goldens.tgz -C .   (writes tests/goldens/* and models/default/{config.json,
# generation_config.json,model.safetensors}; goldens.log has the run's output).
# The torch work runs on the CPU in fp32 (CUDA hidden), single-threaded, so it is deterministic.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set (the device tool sets it)}"
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
work=$(mktemp -d)
mkdir -p "$work/tests/goldens" "$work/models/default"
python3 tools/goldens/make_goldens.py --out "$work/tests/goldens" --default-model "$work/models/default" "$@" \
  2>&1 | tee "$work/goldens.log"
rc=${PIPESTATUS[0]}
tar czf "$OUT/goldens.tgz" -C "$work" tests models goldens.log
echo "goldens.sh: python exit $rc; packed $(du -h "$OUT/goldens.tgz" | cut -f1) into \$OUT/goldens.tgz"
exit "$rc"
