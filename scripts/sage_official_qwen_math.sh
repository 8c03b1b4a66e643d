#!/usr/bin/env bash
# The official SAGE recipe on Qwen2.5-Math-7B, a base model: the SFT stage on OpenMathReasoning-mini, then
# RL that continues the SFT's LoRA adapter (the reference stays the raw base). See configs/sage_official.py.
#
#   ./scripts/sage_official_qwen_math.sh DIR [FLAGS...]
#
# DIR/sft and DIR/rl are the two runs; FLAGS (e.g. --config.data.manual_dir=/data/sage_manual) go to both.
# VARIANT=nokl|grpo|token|random picks the RL variant (default: the branch guide); SFT_FLAGS and RL_FLAGS
# (space-separated) go to one stage only. Rerunning resumes whichever stage is unfinished.
set -euo pipefail
if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: $0 DIR [FLAGS...]   (see the header of this script)" >&2
  exit 2
fi
DIR=$1
shift
PYTHON=${PYTHON:-python}
CONFIG="$(cd "$(dirname "$0")/.." && pwd)/configs/sage_official.py"
read -r -a sft_flags <<< "${SFT_FLAGS:-}"
read -r -a rl_flags <<< "${RL_FLAGS:-}"

echo "== SFT stage -> $DIR/sft"
"$PYTHON" -m sage_jax.main --config="$CONFIG:qwen_math_sft" --workdir="$DIR/sft" "$@" "${sft_flags[@]}"
echo "== RL stage from $DIR/sft/export_peft -> $DIR/rl"
"$PYTHON" -m sage_jax.main --config="$CONFIG:qwen_math${VARIANT:+,$VARIANT}" --workdir="$DIR/rl" \
  --config.model.lora.init_from="$DIR/sft/export_peft" "$@" "${rl_flags[@]}"
