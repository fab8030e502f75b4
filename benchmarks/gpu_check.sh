#!/usr/bin/env bash
# The prepared check for a lent GPU (one run, under 8 minutes): the local backend's CUDA/bf16
# path on a model of a real size built in code, and against TRL on the same work where TRL is
# installed. The lent machine has torch, transformers and peft but no network, so tempering's
# other dependencies come as wheels carried with the working tree:
#
#   pip download --no-deps tml-renderers==0.2.1 pluggy bm25s -d wheels/       # here, once (~14 MB)
#   run: bash benchmarks/gpu_check.sh     carry: ["wheels"]                  # on the lent machine
#
# Writes its log to $OUT/gpu_check.log when $OUT is set (the device tool returns that folder).
# DEVICE=cpu GPU_CHECK_SMALL=1 runs the same steps on a tiny model: a check of the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
log="${OUT:-/tmp}/gpu_check.log"
exec > >(tee "$log") 2>&1
export TEMPERING_PROGRESS=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
device="${DEVICE:-cuda}"
start=$(date +%s)

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
python -c "import torch, transformers, peft; print('torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| cuda', torch.cuda.is_available())"

echo "== install tempering (offline)"
if [ -d wheels ]; then python -m pip install -q --no-index --find-links wheels --no-deps wheels/*.whl; fi
python -m pip install -q --no-deps --no-build-isolation -e . || { echo "gpu_check: could not install tempering"; exit 1; }
python -c "import tempering, pluggy, tml_renderers" || { echo "gpu_check: a dependency is missing: carry wheels/ (see the header)"; exit 1; }

if [ -n "${GPU_CHECK_SMALL:-}" ]; then
  shape='{"hidden_size": 64, "num_layers": 2}'
  llama='{"hidden_size": 64, "num_layers": 2, "intermediate_size": 128}'
  dtype=float32; steps=2; prompts=2; group=2; tokens=8
else
  # Qwen3-1.7B's decoder shape; for TRL the same shape on a Llama with the character vocabulary
  # (TRL needs a Hugging Face tokenizer; the real Qwen3 tokenizer ships through tml-renderers).
  shape='{"hidden_size": 2048, "num_layers": 28, "num_heads": 16, "num_kv_heads": 8, "intermediate_size": 6144}'
  llama='{"hidden_size": 2048, "num_layers": 28, "num_heads": 16, "intermediate_size": 6144, "max_position_embeddings": 512}'
  dtype=bfloat16; steps=4; prompts=8; group=8; tokens=128
fi

echo "== GRPO step, local backend, LoRA vs full fine-tuning (tiny_qwen3 at ${shape})"
timeout 300 python benchmarks/gpu_grpo_step.py --device "$device" --dtype "$dtype" --steps "$steps" \
  --prompts "$prompts" --group "$group" --max-tokens "$tokens" --model-kwargs "$shape" \
  || echo "gpu_check: gpu_grpo_step failed or timed out (exit $?)"

echo "== GRPO step, ours vs TRL (full fine-tuning, same model and work)"
if python -c "import trl, datasets" 2>/dev/null; then
  timeout 240 python benchmarks/grpo_step_vs_trl.py --device "$device" --dtype "$dtype" --model tiny_llama \
    --model-kwargs "$llama" --steps 4 --warmup 2 --prompts "$prompts" --group "$group" --max-tokens 32 --no-log-kl \
    || echo "gpu_check: grpo_step_vs_trl failed or timed out (exit $?)"
else
  echo "gpu_check: trl (and datasets) not installed here: the TRL comparison is skipped"
fi
echo "== done in $(( $(date +%s) - start )) s"
