#!/usr/bin/env bash
# Run tpsample on a GPU machine with another Triton than its image's, when only small files can
# travel to it (a Triton wheel is ~290 MB; the device calls carry at most 64 MiB each).
#
#   here:   tools/triton_carry.sh pack 3.9.0 DIR      # DIR/triton-3.9.0.part-aa, -ab, ...
#   there:  tools/triton_carry.sh unpack DIR DEST     # after every part has been copied to DIR
#           eval "$(tools/triton_carry.sh env DEST)"  # PYTHONPATH and Triton's settings
#           tools/triton_carry.sh arm DEST            # the same as VAR=VALUE,... for tools.ab
#
# pack downloads the cp312 manylinux wheel, drops what a Hopper run does not need (the AMD
# backend, the Blackwell ptxas and CUPTI, CUPTI's static libraries, proton), compresses the
# rest (tar | xz -6, ~113 MB for 3.9.0) and splits it into parts of at most PART_MB (57) MB:
# carry one part per call, each call copying its part to /tmp on the machine (files there stay
# while the machine is warm; the working copy's ignored paths do not), then unpack. env puts
# DEST first on PYTHONPATH, keeps Triton from looking for the AMD backend, points it at the
# machine's own ptxas (CUDA 13 knows sm_90a) and keeps FP fusion on as on 3.6.
set -euo pipefail

cmd=${1:-}
case "$cmd" in
pack)
    version=$2; out=$3; part_mb=${PART_MB:-57}
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$work" "triton==$version"
    mkdir -p "$work/site" "$out"
    (cd "$work/site" && python3 -m zipfile -e "$work"/triton-*.whl .)
    t="$work/site/triton"
    rm -rf "$t/backends/amd" "$t/backends/nvidia/bin/ptxas-blackwell" \
        "$t/backends/nvidia/lib/cupti-blackwell" "$t/_C/libproton.so"
    find "$t" -name '*.a' -path '*cupti*' -delete
    rm -f "$out"/triton-"$version".part-*
    tar -C "$work/site" -cf - . | xz -6 -T0 | split -b "${part_mb}m" - "$out/triton-$version.part-"
    ls -l "$out"/triton-"$version".part-*
    ;;
unpack)
    dir=$2; dest=$3
    mkdir -p "$dest"
    cat "$dir"/triton-*.part-* | xz -d | tar -C "$dest" -xf -
    TRITON_BACKENDS_IN_TREE=1 python3 - "$dest" <<'EOF'
import sys, importlib.util
sys.path.insert(0, sys.argv[1])
import triton
print("unpacked Triton", triton.__version__, "at", triton.__file__)
EOF
    ;;
env)
    dest=$2
    ptxas=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)
    echo "export PYTHONPATH=$dest\${PYTHONPATH:+:\$PYTHONPATH}"
    echo "export TRITON_BACKENDS_IN_TREE=1 TRITON_PTXAS_PATH=$ptxas TRITON_PTXAS_BLACKWELL_PATH=$ptxas"
    echo "export TRITON_DEFAULT_FP_FUSION=1"
    ;;
arm)
    dest=$2
    ptxas=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)
    echo "PYTHONPATH=$dest${PYTHONPATH:+:$PYTHONPATH},TRITON_BACKENDS_IN_TREE=1,TRITON_PTXAS_PATH=$ptxas,TRITON_PTXAS_BLACKWELL_PATH=$ptxas,TRITON_DEFAULT_FP_FUSION=1"
    ;;
*)
    echo "usage: $0 pack VERSION DIR | unpack DIR DEST | env DEST | arm DEST" >&2
    exit 2
    ;;
esac
