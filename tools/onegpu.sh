#!/usr/bin/env bash
# Everything that needs one GPU, in parts that each fit one ~10-minute run on a fresh machine
# (compiling included):
#
#   tools/onegpu.sh tests OUT    # the one-GPU tests (tests/gpu, without the multigpu module)
#   tools/onegpu.sh bench OUT    # the plain-call benchmark (SHAPES; its default batches, the
#                                # sizes between the kernels' row blocks included), OUT/bench.md
#   tools/onegpu.sh sweep OUT    # the filtered-call sweep (SHAPES, default 4096x151936; the
#                                # flat, typical and mixed heads at T = 1, B 16/64/256), its
#                                # table and plot in OUT/sweep.md; FLASHINFER_PARTS=DIR (what
#                                # tools/flashinfer_carry.sh pack DIR wrote) adds FlashInfer's
#                                # columns
#   tools/onegpu.sh verify OUT   # speculative verification against the plain call and a
#                                # torch rejection sampler (SHAPES as above), OUT/verify.md
#   tools/onegpu.sh decode OUT   # examples/fast_decode.py at TP1: --check, then the TPOT
#                                # runs (CONFIG, default qwen3-1.7b; TOP_P=0.95 adds the
#                                # runs with top_p; COMPILE=1 compiles the step's forward;
#                                # BATCHES, default 1,8,32,128) and OUT/decode.md
#   tools/onegpu.sh host OUT     # tools.host_cost: host µs per call kind, the call memo off and on
#   tools/onegpu.sh reuse OUT    # tools.host_cost with TPSAMPLE_REUSE_OUTPUTS=0 and =1, one
#                                # process each, twice in turn (the graphs' output slots)
#   tools/onegpu.sh args OUT     # tools.host_cost with TPSAMPLE_GRAPH_ARGS=0 and =1 in one
#                                # process (a decode loop's inputs read by the graph)
#   tools/onegpu.sh cond OUT     # tools.conditional_node: empty launches in a CUDA-graph
#                                # conditional node against plain ones (OUT/cond.log)
#   tools/onegpu.sh gate OUT     # cond, the fallback gate's GPU test, and TPSAMPLE_FALLBACK_GATE
#                                # 0 against 1 (tools.filtered_ab, INSTALL=DIR: this
#                                # checkout's pip --target install; BUDGET seconds, default 300)
#   tools/onegpu.sh knob OUT     # KNOB=TPSAMPLE_... 0 against 1 on INSTALL (tools.filtered_ab:
#                                # HEADS, BATCHES, CELLS, BUDGET), after the tests/gpu tests
#                                # TESTS selects (a pytest -k expression; none when unset)
#
# Run from the repository root with tpsample importable (PYTHONPATH or an install; the source
# tree's tpsample/ has no kernels, so it is kept off sys.path: PYTHONSAFEPATH, and the
# repository root goes last on PYTHONPATH for tools/ and tests/). Writes JSON, logs and
# markdown under OUT; each part prints its table last.
set -euo pipefail

part=${1:?part: tests, bench, sweep, verify, decode, host, args, reuse, cond, gate or knob}
out=${2:?output directory}
mkdir -p "$out"
export PYTHONSAFEPATH=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
shapes=${SHAPES:-4096x151936}

case "$part" in
tests)
    python -m pytest -q -ra -m "gpu or not gpu" tests/gpu --ignore=tests/gpu/test_multigpu.py \
        2>&1 | tee "$out/tests.log"
    ;;
bench)
    python -m tpsample.launch.bench --shapes "$shapes" --no-compile --out "$out/bench" \
        --doc "$out/bench.md" --label "bench" 2>&1 | tee "$out/bench.log"
    ;;
sweep)
    if [ -n "${FLASHINFER_PARTS:-}" ]; then
        bash tools/flashinfer_carry.sh unpack "$FLASHINFER_PARTS" /tmp/flashinfer
        eval "$(bash tools/flashinfer_carry.sh env /tmp/flashinfer)"
    fi
    python -m tpsample.launch.sweep --shapes "$shapes" --temps 1.0 \
        --heads gauss1,zipf1.3,zipf1.6,mixed --batches 16,64,256 --out "$out/sweep" \
        --doc "$out/sweep.md" --label "sweep" 2>&1 | tee "$out/sweep.log"
    ;;
verify)
    python -m tpsample.launch.verify_bench --shapes "$shapes" --out "$out/verify" \
        --doc "$out/verify.md" --label "verify" 2>&1 | tee "$out/verify.log"
    ;;
decode)
    config=${CONFIG:-qwen3-1.7b}
    python examples/fast_decode.py --config "$config" --check --steps 8 --top-p 0.95 \
        ${COMPILE:+--compile} 2>&1 \
        | tee "$out/decode_check.log"
    python examples/fast_decode.py --config "$config" --batches "${BATCHES:-1,8,32,128}" \
        --prompt 512 --steps 128 ${COMPILE:+--compile} --out "$out/decode" 2>&1 \
        | tee "$out/decode_${config}.log"
    if [ -n "${TOP_P:-}" ]; then  # the same runs with top_p: the torch sort path against tpsample's
        python examples/fast_decode.py --config "$config" --batches "${BATCHES:-1,8,32,128}" \
            --prompt 512 --steps 128 --top-p "$TOP_P" ${COMPILE:+--compile} \
            --out "$out/decode" 2>&1 \
            | tee "$out/decode_${config}_p$TOP_P.log"
    fi
    python examples/fast_decode.py --report "$out"/decode/fast_decode_*.json \
        --doc "$out/decode.md" --label "fast decode"
    ;;
host)
    python -m tools.host_cost --batches 1,64 --no-profile --ab-memo \
        --kinds plain,plain_out,plain_fresh_h,top_p0.9,top_p0.9_out,loop,loop_out \
        --out "$out/host" 2>&1 | tee "$out/host.log"
    python -m tools.host_cost --report ="$out/host/host_cost.json" | tee "$out/host.md"
    ;;
args)
    python -m tools.host_cost --batches 1,64 --no-profile --no-graph --ab-args \
        --kinds plain_fresh_h,loop,loop_out,loop_keep,top_p0.9 \
        --out "$out/args" 2>&1 | tee "$out/args.log"
    python -m tools.host_cost --report ="$out/args/host_cost.json" | tee "$out/args.md"
    ;;
reuse)
    arms=()
    for round in 1 2; do
        for r in 0 1; do
            TPSAMPLE_REUSE_OUTPUTS=$r python -m tools.host_cost --batches 1,64 --no-profile \
                --no-graph --kinds plain,plain_keep,plain_out,logprobs,top_p0.9,loop,loop_keep \
                --out "$out/reuse_r${r}_$round" 2>&1 | tee "$out/reuse_r${r}_$round.log"
            label="round $round, reuse $([ $r = 1 ] && echo on || echo off)"
            arms+=("$label=$out/reuse_r${r}_$round/host_cost.json")
        done
    done
    python -m tools.host_cost --report "${arms[@]}" | tee "$out/reuse.md"
    ;;
cond)
    python -m tools.conditional_node --out "$out/cond" 2>&1 | tee "$out/cond.log"
    ;;
gate)
    # the experiment above, the gate's GPU test, then a same-run A/B of the install at
    # INSTALL (a pip --target directory) with TPSAMPLE_FALLBACK_GATE=0 and =1
    install=${INSTALL:?INSTALL: the pip --target directory of this checkout}
    timeout 120 python -m tools.conditional_node --replays 200 --out "$out/cond" 2>&1 \
        | tee "$out/cond.log"
    timeout 300 python -m pytest -q -x -m "gpu or not gpu" tests/gpu/test_gpu_pipeline.py \
        -k skips_its_fallback 2>&1 | tee "$out/gate_test.log"
    python -m tools.filtered_ab --arm "off:$install:TPSAMPLE_FALLBACK_GATE=0" \
        --arm "on:$install:TPSAMPLE_FALLBACK_GATE=1" --rounds 2 --heads typical,gauss1 \
        --batches 64,256 --cells plain,p0.9,m0.1,p0.9+lp --budget "${BUDGET:-300}" \
        --out "$out/gate_ab.json" 2>&1 | tee "$out/gate_ab.log"
    ;;
knob)
    install=${INSTALL:?INSTALL: the pip --target directory of this checkout}
    knob=${KNOB:?KNOB: the TPSAMPLE_ knob to compare at 0 and 1}
    if [ -n "${TESTS:-}" ]; then
        timeout 240 python -m pytest -q -x -m "gpu or not gpu" tests/gpu -k "$TESTS" 2>&1 \
            | tee "$out/knob_tests.log"
    fi
    python -m tools.filtered_ab --arm "off:$install:$knob=0" --arm "on:$install:$knob=1" \
        --rounds 2 --heads "${HEADS:-typical,gauss1}" --batches "${BATCHES:-64,256}" \
        --cells "${CELLS:-plain,p0.9,m0.1,p0.9+lp}" --budget "${BUDGET:-300}" \
        --out "$out/knob_ab.json" 2>&1 | tee "$out/knob_ab.log"
    ;;
*)
    echo "unknown part $part (tests, bench, sweep, verify, decode, host, args, reuse, cond, gate or knob)"; exit 2 ;;
esac
