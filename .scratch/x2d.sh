export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -d /tmp/new2/tpsample ] || pip install -q --no-deps --no-build-isolation --target /tmp/new2 . 2>&1 | grep -v WARN | tail -2
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/new2:$PWD
timeout 400 torchrun --standalone --nproc-per-node=2 .scratch/tp_prof.py 2>&1 | grep -v Warn | tail -110
