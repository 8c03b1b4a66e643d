#!/usr/bin/env bash
# The RL-step benchmark on one offline NVIDIA GPU machine (the H200 run in README.md), both sides under the
# machine's own python3 (JAX with CUDA, torch with CUDA). What that image lacks travels as wheels in .whl/:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl optax==0.2.8 trl==1.16.0 datasets==5.2.0 \
#     dill==0.4.1 multiprocess==0.70.19 pyarrow==26.0.1
# flax comes from the image, matched to its JAX: our CPU pin (flax 0.12.8) does not import on JAX 0.11.
# /tmp/site is made anew each time, so a reused machine never keeps an earlier run's packages.
# Then, on the GPU machine, from the repository root: OUT=/some/dir bash experiments/bench/h200.sh
set -u
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TOKENIZERS_PARALLELISM=false \
       HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# pyarrow only where the image's is older than datasets 5.2 needs.
new_pa=$(python3 -c "import pyarrow; print(int(pyarrow.__version__.split('.')[0]) >= 24)" 2>/dev/null)
whls=$(ls .whl/*.whl | grep -v -e pyarrow -e flax)
[ "$new_pa" = True ] || whls="$whls $(ls .whl/pyarrow-*.whl)"
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $whls \
  || exit 1
export PYTHONPATH=/tmp/site
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "
import jax, torch, transformers, accelerate, pyarrow, flax, optax, trl, datasets
print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, 'transformers', transformers.__version__,
      'accelerate', accelerate.__version__, 'pyarrow', pyarrow.__version__, 'flax', flax.__version__,
      'optax', optax.__version__, 'trl', trl.__version__, 'datasets', datasets.__version__)"
} 2>&1 | tee "$OUT/env.txt"

bench="python3 experiments/bench/bench.py --trl-python python3 --workdir /tmp/sage_bench --out $OUT --no-scaling"
# The three parts take ~5 + 2.5 + 4 min; a device call allows 10, so PARTS picks them (default: all).
PARTS=${PARTS:-bf16,fp32,segments}
# bfloat16 compute (parameters float32) against TRL's bf16 autocast, with and without its gradient checkpointing.
[[ $PARTS == *bf16* ]] && timeout 300 $bench --dtype bfloat16 --shapes tiny,small,medium --guides none --name results_h200_bf16 \
  2>&1 | tee "$OUT/bf16.log"
# float32 on both sides (full-precision matmuls: no TF32 on either), the CPU benchmark's setting.
[[ $PARTS == *fp32* ]] && timeout 150 $bench --dtype float32 --shapes tiny,small --guides none --no-phases --name results_h200_fp32 \
  2>&1 | tee "$OUT/fp32.log"
# The sampler's decode segments on a GPU (more, smaller attention kernels per step against fewer cache
# slots read; measured on the CPU only): ours alone, bf16, one loop against the default four.
[[ $PARTS == *segments* ]] && for n in 1 4; do
  timeout 120 $bench --dtype bfloat16 --shapes small,medium --guides none --no-trl --no-phases \
    --decode-segments $n --name results_h200_segments$n 2>&1 | tee "$OUT/segments$n.log"
done
