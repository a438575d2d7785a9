#!/bin/bash
# The checks that need a CUDA GPU, in one run: the CUDA kernels' and BlockMover's tests,
# compute-sanitizer's memcheck over the kernels (where it is installed), and the two
# copy benchmarks on the GPU. Needs a CUDA torch and nvcc; no vLLM.
#
#     PYTHON=python3 benchmarks/gpu_check.sh        (from the repository root)
set -euo pipefail
PY=${PYTHON:-python3}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$($PY -c \
    "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
$PY -c "from kvbackend.ops import _extension as e; x = e.get(); \
assert x is not None and x.has_cuda, 'the CUDA kernels did not build'"
$PY -m pytest -q -p no:cacheprovider tests/test_block_copy_ops.py tests/test_block_mover.py \
    tests/test_pinned_rows.py
if command -v compute-sanitizer > /dev/null; then
    compute-sanitizer --tool memcheck --error-exitcode 1 \
        $PY -m pytest -q -p no:cacheprovider tests/test_block_copy_ops.py -k cuda
fi
$PY benchmarks/bench_block_copy.py --device cuda --num-layers 32 --num-blocks 1024 \
    --num-ids 512 --heads 8 --block-size 16 --head-size 128 --repeats 20
# 2 MiB and 16 MiB blocks; 40 layers: 2.5 MiB blocks, not a power of two
for shape in "32 16" "32 128" "40 16"; do
    set -- $shape
    $PY benchmarks/bench_block_mover.py --device cuda --num-layers $1 --block-size $2 \
        --num-ids 128
done
