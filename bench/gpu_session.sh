#!/usr/bin/env bash
# One lease of a GPU machine (the device tool's image: jax[cuda], flax, optax, no ml_collections), from the
# repository root: the critic-step MFU and sampler of bench_gpu.py, then `sweet_jax.plan --topology local` for
# the 8B LoRA rows (critic at 8192, policy at 16384) on this card. Wheels it needs travel in .whl/.
# Logs and JSON go to $OUT (default ./gpu_out).
set -u
out="${OUT:-gpu_out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site" XLA_PYTHON_CLIENT_MEM_FRACTION=.95
py=python3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/versions.txt"
# flax <= 0.12.8 does not run on jax >= 0.11.1: bring 0.12.12 when the image's is older.
need="ml_collections"
$py - <<'PY' || need="$need flax"
import flax, jax
from packaging.version import Version as V
raise SystemExit(V(flax.__version__) <= V("0.12.8") and V(jax.__version__) >= V("0.11.1"))
PY
for n in $need; do $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/${n}-*.whl; done
$py -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" \
  | tee -a "$out/versions.txt"
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | grep -v "^W0000\|^I0000" | tail -25; }
step bench_gpu 240 $py bench/bench_gpu.py --json "$out/bench_gpu.json"
lora="--config.lora.rank=16 --config.lora.alpha=32 --config.model.param_dtype=bfloat16 --config.model.scan_layers=True"
step plan_critic_lora 120 $py -m sweet_jax.plan --config configs/critic.py:llama3_8b --topology local $lora
step plan_policy_lora 120 $py -m sweet_jax.plan --config configs/policy.py:llama3_8b --config.data.max_len=16384 \
  --topology local $lora
step bench_gpu_xla 120 $py bench/bench_gpu.py --skip-sampler --attn xla --json "$out/bench_gpu_xla.json"
