#!/usr/bin/env bash
# Trains the demo model (models/demo/) on the GPU machine. Run through the device tool from the repository root;
# arguments go to tools/demo_model/train.py:
#   run(command="bash tools/device/train_demo.sh", timeout_s=600)
# The script's eight files are packed into one tar split in parts of 15 MB (the device returns files of at most
# 16 MiB, and model.safetensors is larger), $OUT/demo_model.tar.part00, part01, ...; train_log.json and the run's
# output (train.log) also come back as plain files. Unpack here:
#   cat <files_at>/demo_model.tar.part* | tar xf - -C models/demo
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set (the device tool sets it)}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true CUBLAS_WORKSPACE_CONFIG=:4096:8
python=/opt/torch/.venv/bin/python3
[[ -x $python ]] || python=python3
work=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$python" -c 'import os, torch, transformers, tokenizers; print("torch", torch.__version__, "transformers",
transformers.__version__, "tokenizers", tokenizers.__version__, "cpus", os.cpu_count())'
"$python" tools/demo_model/train.py --out "$work" "$@" 2>&1 | tee "$OUT/train.log"
rc=${PIPESTATUS[0]}
tar cf - -C "$work" . | split -b 15000000 -d -a 2 - "$OUT/demo_model.tar.part"
[[ -f $work/train_log.json ]] && cp "$work/train_log.json" "$OUT/"
ls -l "$work" "$OUT"
echo "train_demo.sh: train.py exit $rc"
exit "$rc"
