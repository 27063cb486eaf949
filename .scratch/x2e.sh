export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
pip install -q --no-deps --no-build-isolation --target /tmp/new3 . 2>&1 | grep -v WARN | tail -2
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/new3:$PWD
timeout 330 torchrun --standalone --nproc-per-node=2 .scratch/gather_ab.py 2>&1 | grep -v Warn | grep -v warn | tail -12
timeout 240 python -m pytest -q -ra --tb=short -m "gpu or not gpu" tests/gpu/test_multigpu.py -k "fast_path or device_fallback" 2>&1 | tail -6
