#!/usr/bin/env bash
# There, on the lent GPU machine (see benchmarks/gpu_check.py): run every GPU measurement once.
# Prepared here by benchmarks/gpu_prepare.sh; the machine's own python3 holds torch and transformers.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MEMFIT_CACHE=$PWD/.gpu_carry/cache
OUT=${OUT:-runs/gpu_check}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
python3 -c "import torchao" 2>/dev/null || python3 -m pip install --no-deps --no-index .gpu_carry/wheels/torchao-*.whl
python3 benchmarks/gpu_check.py --out "$OUT" "$@"
