export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
pip install -q --no-deps --no-build-isolation --target /tmp/new2 . 2>&1 | grep -v WARN | tail -2
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/new2:$PWD
timeout 560 torchrun --standalone --nproc-per-node=2 -m tools.host_cost --tp-only --dims 4096,8192 --batches 1,16,64,256 --no-profile \
   --kinds plain,plain_out,top_p0.9,top_p0.9_out --out $OUT/host8 2>&1 | grep -v Warn | tail -3
python -m tools.host_cost --report =$OUT/host8/host_cost.json
