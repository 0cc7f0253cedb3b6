#!/usr/bin/env bash
# Prepare the wheels the GPU check carries to a machine that reaches no package index (docs/gpu.md).
#
#   samples/gpu_wheels.sh [DIR]          # default DIR: .gpu-wheels (ignored by git; never commit wheels)
#   GENAI=0 samples/gpu_wheels.sh        # without onnxruntime-genai-cuda (the check's genai row; 17 MB, one part)
#
# Downloads the CPython 3.12 wheel of onnxruntime-gpu (a CUDA 13 build, ~255 MB; ../shared/GPU.md)
# and splits it into parts small enough to travel one per device call beside the repository (a call
# carries at most 64 MiB with the working tree: 56 MiB parts leave room for the ~6 MB repository;
# 60 MiB parts would not fit). Writes DIR/<name>.sha256 and the parts DIR/<name>.part-aa, -ab, ...;
# samples/gpu_check.sh joins them, checks the hash and installs the wheel into its own directory.
# Carry each part in its own back-to-back call (files carried earlier stay on the warm machine), the
# last one with the check itself; the list of calls is printed at the end.
set -euo pipefail

DIR=${1:-.gpu-wheels}
PART=${PART_SIZE:-56M}
ORT_VERSION=${ORT_VERSION:-1.31.1}
mkdir -p "$DIR/download"

fetch() {  # fetch NAME==VERSION: the cp312 manylinux x86_64 wheel, no dependencies
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$DIR/download" "$1"
}

fetch "onnxruntime-gpu==$ORT_VERSION"
# the device image's onnx-ir is 1.0; the optimize passes are tested on what this machine has (pure Python, small)
fetch "onnx-ir==$(python3 -c 'import importlib.metadata as m; print(m.version("onnx-ir"))' 2>/dev/null || echo 1.1.0)"
if [ "${GENAI:-1}" = 1 ]; then  # 0.18: the version exporter.bench's CPU peer is (it needs onnxruntime-gpu >= 1.31.0)
    fetch "onnxruntime-genai-cuda==${GENAI_VERSION:-0.18.0}" || echo "onnxruntime-genai-cuda: no cp312 wheel; the check skips genai"
fi

for whl in "$DIR"/download/*.whl; do
    name=$(basename "$whl")
    rm -f "$DIR/$name".part-*
    (cd "$DIR" && sha256sum "download/$name" | sed "s#download/##" > "$name.sha256")
    split -b "$PART" "$whl" "$DIR/$name.part-"
    echo "$name: $(du -h "$whl" | cut -f1) in $(ls "$DIR/$name".part-* | wc -l) parts"
done

echo
echo "Carry the parts one per device call (each: carry [\"<part>\", \"<its .sha256>\"], command 'true'), the"
echo "last with the check: carry it and run 'samples/gpu_check.sh [MODEL_DIR]'. Parts:"
ls -1 "$DIR"/*.part-* "$DIR"/*.sha256
