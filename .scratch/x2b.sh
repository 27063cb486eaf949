export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -d /tmp/new/tpsample ] || pip install -q --no-deps --no-build-isolation --target /tmp/new . 2>&1 | grep -v WARN | tail -2
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/new:$PWD
timeout 500 torchrun --standalone --nproc-per-node=2 -m tools.host_cost --batches 1,64 --no-profile --ab-memo \
   --kinds plain,plain_out,top_p0.9,loop,loop_out --out $OUT/host 2>&1 | grep -v Warn | tail -45
python -m tools.host_cost --report =$OUT/host/host_cost.json
