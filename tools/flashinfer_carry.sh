#!/usr/bin/env bash
# FlashInfer's sampling kernels on a GPU machine that cannot download them, for the
# benchmark's FlashInfer baselines (launch/bench.py runs them whenever `import
# flashinfer.sampling` works). The flashinfer-python wheel is 62 MB (426 MB unpacked, with
# CUTLASS and every kernel's sources); its sampling kernels are compiled on first use by
# the machine's nvcc (JIT), from the sampling and top-k modules' sources and the headers they
# include.
#
#   here:   tools/flashinfer_carry.sh pack DIR          # DIR/flashinfer-<v>.part-aa, ...
#   there:  tools/flashinfer_carry.sh unpack DIR DEST   # after every part is in DIR
#           eval "$(tools/flashinfer_carry.sh env DEST)"
#
# pack downloads flashinfer-python and the packages `import flashinfer.sampling` needs that a
# torch image lacks (apache-tvm-ffi, requests and its dependencies, nvidia-ml-py, tqdm,
# ninja), for PYVER (default 3.12, the GPU machines' Python); keeps of data/csrc only the
# sampling module's sources, drops CUTLASS (data/cutlass: the sampling headers do not
# include it), compresses the rest (tar | xz -6, ~15 MB for 0.7.2.post1) and splits it into
# parts of at most PART_MB (57) MB. unpack checks that `import flashinfer.sampling` works.
# env puts DEST first on PYTHONPATH and builds for sm_90 only (FLASHINFER_CUDA_ARCH_LIST); the
# first call of each sampling function compiles it (minutes), later ones reuse the build
# under FLASHINFER_WORKSPACE_BASE (default: the home directory).
set -euo pipefail

VERSION=${FLASHINFER_VERSION:-0.7.2.post1}
# the sampling module; the top-k module (top_k_top_p_sampling_from_logits selects the top k
# with it first when top_k is a small int, as in the benchmark)
SAMPLING_SOURCES="sampling.cu renorm.cu flashinfer_sampling_binding.cu sampling_utils.h tvm_ffi_utils.h
    topk.cu cub_topk.cu flashinfer_topk_binding.cu flashinfer_fast_topk_clusters_binding.cu
    topk_transform_checks.h"

cmd=${1:-}
case "$cmd" in
pack)
    out=$2; part_mb=${PART_MB:-57}; pyver=${PYVER:-3.12}
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
        --platform manylinux1_x86_64 -d "$work" \
        "flashinfer-python==$VERSION" "apache-tvm-ffi>=0.1.11,<0.2" requests urllib3 idna \
        certifi charset-normalizer nvidia-ml-py tqdm ninja
    mkdir -p "$work/site" "$out"
    for w in "$work"/*.whl; do (cd "$work/site" && python3 -m zipfile -e "$w" .); done
    data="$work/site/flashinfer/data"
    keep=$(mktemp -d)
    for f in $SAMPLING_SOURCES; do cp "$data/csrc/$f" "$keep/"; done
    rm -rf "$data/csrc" "$data/cutlass"
    mkdir -p "$data/csrc" && cp "$keep"/* "$data/csrc/" && rm -rf "$keep"
    find "$work/site" -name __pycache__ -prune -exec rm -rf {} +
    rm -f "$out"/flashinfer-"$VERSION".part-*
    tar -C "$work/site" -cf - . | xz -6 -T0 | split -b "${part_mb}m" - "$out/flashinfer-$VERSION.part-"
    ls -l "$out"/flashinfer-"$VERSION".part-*
    ;;
unpack)
    dir=$2; dest=$3
    mkdir -p "$dest"
    cat "$dir"/flashinfer-*.part-* | xz -d | tar -C "$dest" -xf -
    PYTHONPATH="$dest${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
        "import flashinfer, flashinfer.sampling; print('unpacked FlashInfer', flashinfer.__version__, 'at', flashinfer.__file__)"
    ;;
env)
    dest=$2
    echo "export PYTHONPATH=$dest\${PYTHONPATH:+:\$PYTHONPATH}"
    echo "export FLASHINFER_CUDA_ARCH_LIST=9.0"
    ;;
*)
    echo "usage: $0 pack DIR | unpack DIR DEST | env DEST" >&2
    exit 2
    ;;
esac
