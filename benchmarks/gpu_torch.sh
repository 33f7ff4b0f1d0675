#!/bin/bash
# The torch backend on a host with a GPU (16 cores, one GPU, torch preinstalled, no network):
# the GPU tests of the suite, the CPU parity tests under that host's torch, and the DDP / bf16 /
# FSDP2 benchmarks with 4 ranks sharing cuda:0 (ours and Gloo in one run each). About 5 min.
# Run from the project root: `bash benchmarks/gpu_torch.sh`. pytest-asyncio, if the host lacks
# it, can come as a wheel in .whl/. Writes $OUT/gpu.txt when $OUT is set.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/aioreduce-gpu}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu.txt") 2>&1
echo "== env"; nproc; nvidia-smi -L 2>/dev/null
python3 -c "import sys,torch;print(sys.version.split()[0],torch.__version__,'cuda',torch.cuda.is_available())"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | tail -2
t() { local s=$SECONDS; timeout "$@"; echo "rc=$? $((SECONDS-s))s"; }
echo "== tests: GPU, and CPU parity under this torch"
t 300 python3 -m pytest -q -ra -p no:cacheprovider tests/loopback/test_torch_train.py \
  tests/loopback/test_torch_calls.py tests/unit/test_torch_staging.py
B="aioreduce-bench ddp --device cuda --nodes 4 --straggle none"
echo "== DDP, model on cuda:0, 4 ranks sharing it, float32"
t 150 $B --hidden 1750 --batch 128 --iters 30 --warmup 5
echo "== DDP, bfloat16 model"
t 120 $B --hidden 1750 --batch 128 --iters 30 --warmup 5 --dtype bfloat16
echo "== FSDP2 (fully_shard over a 1-D mesh of cuda:0 ranks), float32 and a bf16 policy"
t 120 $B --fsdp --batch 16 --iters 20 --warmup 3
t 120 $B --fsdp --batch 16 --iters 20 --warmup 3 --dtype bfloat16
echo "== done ${SECONDS}s"
