#!/usr/bin/env bash
# The GPU check in one command (docs/gpu.md), from the repository root of a bare GPU machine:
#
#   samples/gpu_check.sh [MODEL_DIR]      # MODEL_DIR: e.g. the SmolLM2 main job's; default: the 19M recipe
#
# 1. onnxruntime-gpu from the parts samples/gpu_wheels.sh made (.gpu-wheels/, carried one per device
#    call), joined, hash-checked and installed into its own directory, first on PYTHONPATH (beside the
#    image's CPU onnxruntime the two fight over one module); the CUDA 13 libraries from the nvidia-*
#    wheels PyTorch brought, on LD_LIBRARY_PATH; onnxruntime-genai-cuda likewise where carried
# 2. a real CUDA session (an Add on the GPU), not only the provider's name in the list
# 3. python -m pytest -m gpu
# 4. samples/gpu_check.py: export + optimize --target cuda (both attention forms timed, the rows gate
#    on CUDA), greedy speculative vs autoregressive under the recorded-bound contract, float16 tokens/s
#    autoregressive and speculative by tree size, onnxruntime-genai's CUDA build
#
# Writes $OUT/gpu_check.json (the steps), $OUT/pytest.txt and $OUT/check.log ($OUT: the device tool's
# folder, else runs/gpu-check). Sized for 8 minutes on one H100/H200: each step has its own time limit
# (GPU_CHECK_PYTEST_S, GPU_CHECK_MODEL_S, GPU_CHECK_BUDGET_S) and a step cut short leaves its record.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check}
export OUT
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
WHEELS=${GPU_WHEELS:-.gpu-wheels}
SITE=${GPU_SITE:-/tmp/ort-gpu-site}
PY=${PYTHON:-python3}
T0=$(date +%s)
export PYTHONUNBUFFERED=1
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }

# -- 1. the wheels
install_parts() {  # install_parts NAME_GLOB: join NAME.part-*, check NAME.sha256, pip install --target
    local sha name
    for sha in "$WHEELS"/$1.sha256; do
        [ -e "$sha" ] || return 1
        name=$(basename "$sha" .sha256)
        cat "$WHEELS/$name".part-* > "/tmp/$name" || return 1
        (cd /tmp && sha256sum -c --quiet "$OLDPWD/$sha") || { echo "$name: parts missing or corrupt"; return 1; }
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "/tmp/$name" || return 1
        rm -f "/tmp/$name"
    done
}
stamp "installing the carried wheels into $SITE"
if ! "$PY" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" \
        2>/dev/null; then
    install_parts "onnxruntime_gpu-*.whl" || { echo "no onnxruntime-gpu: run samples/gpu_wheels.sh and carry" \
        "every $WHEELS/*.part-* and *.sha256 (docs/gpu.md)"; exit 2; }
fi
for extra in "onnxruntime_genai_cuda-*.whl" "onnx_ir-*.whl"; do  # where carried
    install_parts "$extra" 2>/dev/null && stamp "installed $extra"
done
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
NV_LIBS=$("$PY" - <<'EOF'
import pathlib, site
dirs = set()
for sp in site.getsitepackages():
    for so in pathlib.Path(sp, "nvidia").glob("**/lib*.so*"):
        dirs.add(str(so.parent))
print(":".join(sorted(dirs)))
EOF
)
export LD_LIBRARY_PATH="$NV_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# -- 2. a real CUDA session
stamp "checking the CUDA execution provider"
"$PY" - <<'EOF' || { echo "the CUDA EP does not run here (above: the missing library or driver)"; exit 3; }
import json, os
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

print("onnxruntime", ort.__version__, ort.__file__, ort.get_available_providers())
assert "CUDAExecutionProvider" in ort.get_available_providers(), "CUDAExecutionProvider not listed"
g = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "g",
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [4])])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
so = ort.SessionOptions()
so.log_severity_level = 1
s = ort.InferenceSession(m.SerializeToString(), so, providers=["CUDAExecutionProvider"])
assert s.get_providers()[0] == "CUDAExecutionProvider", s.get_providers()
y = s.run(None, {"x": np.ones(4, np.float16)})[0]
assert (y == 2).all(), y
json.dump({"onnxruntime": ort.__version__, "providers": ort.get_available_providers(), "session": "ok"},
          open(os.path.join(os.environ["OUT"], "cuda_ep.json"), "w"))
print("CUDA session ok")
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>/dev/null
cat "$OUT/gpu.txt" 2>/dev/null

# -- 3. the GPU tests
stamp "python -m pytest -m gpu"
timeout "${GPU_CHECK_PYTEST_S:-140}" "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py \
    tests/test_gpu_tree.py 2>&1 | tee "$OUT/pytest.txt"
PYTEST_RC=${PIPESTATUS[0]}
stamp "pytest exit $PYTEST_RC"

# -- 4. a model through export, optimize --target cuda, decoding
stamp "the model part (samples/gpu_check.py)"
timeout "${GPU_CHECK_MODEL_S:-280}" "$PY" samples/gpu_check.py --out "$OUT/gpu_check.json" \
    --budget-s "${GPU_CHECK_BUDGET_S:-45}" ${1:+--model "$1"}
MODEL_RC=$?
stamp "done: pytest $PYTEST_RC, model part $MODEL_RC (report $OUT/gpu_check.json)"
[ "$PYTEST_RC" = 0 ] && [ "$MODEL_RC" = 0 ]
