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
python3 -c "import accelerate" 2>/dev/null || python3 -m pip install --no-deps --no-index .gpu_carry/wheels/accelerate-*.whl
python3 benchmarks/gpu_check.py --out "$OUT" "$@"
# issue 18: memfit vs a plain loop vs HF Trainer on the 7B-shaped LoRA cell, tokens/s and MFU (THROUGHPUT_REPS=0: skip)
if [ "${THROUGHPUT_REPS:-2}" -gt 0 ]; then
  mkdir -p "$OUT"
  timeout "${THROUGHPUT_TIMEOUT_S:-300}" python3 benchmarks/train_throughput.py --model random:llama2-7b --device cuda \
    --precision bf16-mixed --seq-len 1024 --batch 4 --steps 10 --reps "${THROUGHPUT_REPS:-2}" \
    --runners memfit,plain,hf --ac "" --data .gpu_carry/data > "$OUT/throughput.txt" 2>&1 || echo "throughput: exit $?" >> "$OUT/throughput.txt"
fi
