#!/usr/bin/env bash
# There, on the lent GPU machine (see benchmarks/gpu_check.py): run every GPU measurement the open issues ask for.
# Prepared here by benchmarks/gpu_prepare.sh; the machine's own python3 (3.12) holds torch, transformers, peft and
# accelerate; torchao travels as a wheel and goes into /tmp/site (as the device README says), ahead on PYTHONPATH.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 MEMFIT_CACHE=$PWD/.gpu_carry/cache
for pkg in torchao accelerate; do
  python3 -c "import $pkg" 2>/dev/null ||
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu_carry/wheels/$pkg-*.whl
done
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-runs/gpu_check}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers, peft, torchao; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'torchao', torchao.__version__)"
exec python3 benchmarks/gpu_check.py --out "$OUT" "$@"
