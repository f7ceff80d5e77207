#!/usr/bin/env bash
# GPU check of issues 6 and 16, about 10 minutes on one H100/H200-class GPU. From the repository root:
#     MULTI30K_DIR=... bash bench/gpu_check.sh   (without MULTI30K_DIR: random sentences, no real batches, no recipe)
# 1. the speed benchmark on CUDA: training on the trainer's real Multi30k batches (ours, ours+compile,
#    nn.Transformer; fp32 and bf16), the synthetic table, cached beam search, attention variants;
# 2. 300 bf16 training steps of the WMT14 base model (d 512, 8 heads, 6+6, d_ff 2048, shared vocab 37000) on
#    synthetic batches with torch.compile: tokens/s and MFU against the measured and the nominal bf16 peak;
# 3. the Multi30k En->De recipe itself in bf16 (configs/multi30k_en_de.yaml, 6000 updates): time to BLEU, tokens/s
#    in runs/gpu_multi30k_en_de/metrics.jsonl and the test scores in its results.json.
# Results: bench/results_cuda.json, bench/results_wmt14_base.json, runs/gpu_multi30k_en_de/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-bench}

python -c "import torch, numpy, sentencepiece, sacrebleu, sacremoses, tqdm, yaml" 2>/dev/null \
  || pip install -q -r requirements.txt \
  || { echo "error: pip could not install requirements.txt (offline?)" >&2; exit 1; }
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; \
print(torch.__version__, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true

data_args=(--data-dir none --skip-real)
if [[ -n "${MULTI30K_DIR:-}" && -d "${MULTI30K_DIR}" ]]; then
  data_args=(--data-dir "$MULTI30K_DIR")
fi

export NMT_NO_TCMALLOC=1  # the CPU allocator does not matter for GPU timings
timeout 300 python bench/bench_speed.py --device cuda --precisions fp32,bf16 --decode-repeats 2 \
  "${data_args[@]}" --out "$OUT_DIR/results_cuda.json"
timeout 180 python bench/bench_speed.py --device cuda --wmt14-base-steps 300 --compile --precisions bf16 \
  --out "$OUT_DIR/results_wmt14_base.json"
if [[ -n "${MULTI30K_DIR:-}" && -d "${MULTI30K_DIR}" ]]; then
  timeout 900 python train_transformer.py --config configs/multi30k_en_de.yaml train.precision=bf16 \
    train.out_dir=runs/gpu_multi30k_en_de data.raw_dir="$MULTI30K_DIR" --overwrite
fi
