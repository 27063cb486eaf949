#!/usr/bin/env bash
# Everything that needs several GPUs of one host, in parts that each fit one ~10-minute run:
#
#   tools/multigpu.sh tests OUT    # the multigpu tests: TP tokens, the exchange drills
#                                  # (symm_mem and nccl), megatron-core decoding at TP N
#   tools/multigpu.sh bench OUT    # bench TP N (merge max with filtered calls, merge cdf) and
#                                  # tools.exchange_cost (device wait vs torch's barrier)
#   tools/multigpu.sh filtered OUT # tools.tp_filtered on the sweep's heads (HEADS, BATCHES),
#                                  # each filter through its graph and re-issued (--ab-graphs),
#                                  # top-p / min-p with the flagged rows split between ranks
#                                  # and not (--ab-split)
#   tools/multigpu.sh verify OUT   # VocabParallelSampler.verify_drafts against the local
#                                  # matmul at TP N (launch/verify_bench.py under torchrun)
#   tools/multigpu.sh tpot OUT     # examples/mcore_decode.py --tpot for each config (CONFIG,
#                                  # default qwen3-1.7b,qwen3-8b) at each TP degree (TP,
#                                  # default "1 N"), then the table and plot of every
#                                  # OUT/tpot/tpot_*.json in OUT/tpot.md (3-4 min per config
#                                  # and degree on H100s; CONFIG=.. TP=.. picks one)
#   tools/multigpu.sh host OUT     # tools.host_cost at TP N: host µs per call kind, the call
#                                  # memo off and on, eager against 1.2 x the local matmul + 20 us
#   tools/multigpu.sh decode OUT   # examples/fast_decode.py: --check at each TP degree (the
#                                  # sampled sequences must match), then the TPOT runs per
#                                  # config (CONFIG, default qwen3-1.7b) and degree (TP,
#                                  # default "1 2 4" up to N; TOP_P=0.95 adds the runs with
#                                  # top_p; COMPILE=1 compiles the step's forward;
#                                  # BATCHES, default 1,8,32,128), then OUT/decode.md
#
# N = NPROC (default: every visible GPU). Writes JSON, logs and plots under OUT; the bench
# parts print their tables last. Run from the repository root with tpsample importable
# (PYTHONPATH or an install; the source tree's tpsample/ has no kernels, so it is kept off
# sys.path: PYTHONSAFEPATH, and the repository root goes last on PYTHONPATH for tools/ and
# tests/); megatron-core for the tests and tpot parts (a wheel in .whl/ is installed into
# OUT/site if megatron.core does not import). NVLink multicast stays off (the variables
# below): tpsample never uses it, and some shared hosts must not see it.
set -euo pipefail

part=${1:?part: tests, bench, filtered, verify, tpot, host or decode}
out=${2:?output directory}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONSAFEPATH=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
n=${NPROC:-$(python -c "import torch; print(torch.cuda.device_count())")}
run() { torchrun --standalone --nproc-per-node="$n" "$@"; }

need_megatron() {
    python -c "import megatron.core" 2>/dev/null && return
    wheel=$(ls .whl/megatron_core-*.whl 2>/dev/null | tail -n 1)
    [ -n "$wheel" ] || { echo "megatron-core missing and no wheel in .whl/"; exit 2; }
    pip install -q --no-deps --target "$out/site" "$wheel"
    export PYTHONPATH="$out/site${PYTHONPATH:+:$PYTHONPATH}"
}

case "$part" in
tests)
    need_megatron
    python -m pytest -q -ra -m "gpu or multigpu" tests/gpu/test_multigpu.py \
        tests/gpu/test_gpu_exchange.py tests/gpu/test_gpu_mcore.py 2>&1 | tee "$out/tests.log"
    ;;
bench)
    # merge max with the filtered calls beside the plain ones; then merge cdf
    run -m tpsample.launch.bench --filters --out "$out/max" 2>&1 | tee "$out/bench_max.log"
    run -m tpsample.launch.bench --merge cdf --out "$out/cdf" 2>&1 | tee "$out/bench_cdf.log"
    run -m tools.exchange_cost --out "$out/exchange" 2>&1 | tee "$out/exchange_cost.log"
    ;;
filtered)
    run -m tools.tp_filtered --heads "${HEADS:-zipf2.0,zipf1.3,gauss1}" \
        --batches "${BATCHES:-1,16,64,256}" --ab-graphs --ab-split --out "$out" 2>&1 \
        | tee "$out/tp_filtered.log"
    ;;
verify)
    run -m tpsample.launch.verify_bench --shapes "${SHAPES:-4096x151936,8192x128256}" \
        --out "$out/verify" --doc "$out/verify.md" --label "verify TP$n" 2>&1 \
        | tee "$out/verify.log"
    ;;
tpot)
    need_megatron
    config=${CONFIG:-qwen3-1.7b,qwen3-8b}
    for tp in ${TP:-$( [ "$n" -gt 1 ] && echo "1 $n" || echo 1 )}; do
        torchrun --standalone --nproc-per-node="$tp" examples/mcore_decode.py --tpot \
            --config "$config" --batch 1,8,32,128 --prompt-len 512 --new-tokens 64 \
            --repeats 1 --out "$out/tpot" 2>&1 | tee "$out/tpot_${config}_tp$tp.log"
    done
    python examples/mcore_decode.py --report "$out"/tpot/tpot_*.json --doc "$out/tpot.md" \
        --label "megatron-core decode"
    ;;
host)
    run -m tools.host_cost --batches 1,64 --no-profile --ab-memo \
        --kinds plain,plain_out,plain_fresh_h,top_p0.9,top_p0.9_out,loop,loop_out \
        --out "$out/host" 2>&1 | tee "$out/host.log"
    python -m tools.host_cost --report ="$out/host/host_cost.json" | tee "$out/host.md"
    ;;
decode)
    config=${CONFIG:-qwen3-1.7b}
    degrees=${TP:-$(for t in 1 2 4; do [ "$t" -le "$n" ] && echo "$t"; done)}
    for tp in $degrees; do
        torchrun --standalone --nproc-per-node="$tp" examples/fast_decode.py \
            --config "${config%%,*}" --check --steps 8 --top-p 0.95 ${COMPILE:+--compile} 2>&1 \
            | tee "$out/decode_check_tp$tp.log"
    done
    seqs=$(grep -h "sampled tokens" "$out"/decode_check_tp*.log | sed 's/.*: //' | sort -u | wc -l)
    echo "sampled sequences equal at every TP degree: $([ "$seqs" -eq 1 ] && echo True || echo False)"
    for c in ${config//,/ }; do
        for tp in $degrees; do
            for p in "" ${TOP_P:-}; do  # TOP_P=0.95: the same runs with top_p too
                torchrun --standalone --nproc-per-node="$tp" examples/fast_decode.py \
                    --config "$c" --batches "${BATCHES:-1,8,32,128}" --prompt 512 \
                    --steps 128 ${p:+--top-p "$p"} ${COMPILE:+--compile} --out "$out/decode" 2>&1 \
                    | tee "$out/decode_${c}_tp$tp${p:+_p$p}${COMPILE:+_compiled}.log"
            done
        done
    done
    python examples/fast_decode.py --report "$out"/decode/fast_decode_*.json \
        --doc "$out/decode.md" --label "fast decode"
    ;;
*)
    echo "unknown part $part (tests, bench, filtered, verify, tpot, host or decode)"; exit 2 ;;
esac
