export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
pip install -q --no-deps --no-build-isolation --target /tmp/new . 2>&1 | grep -v WARN | tail -2
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/new:$PWD
timeout 300 python -m pytest -q -ra --tb=short -m "gpu or not gpu" tests/gpu/test_gpu_pipeline.py -k "out or memoised or repeated" 2>&1 | tail -25
timeout 200 python -m pytest -q -ra --tb=short -m "gpu or not gpu" tests/gpu/test_multigpu.py -k "memoised" 2>&1 | tail -8
