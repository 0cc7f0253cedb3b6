"""The one-call EAGLE tree graph on CUDA: float16 optimized (``--target cuda``), one drafter call per
step, greedy speculative == greedy autoregressive of the same graphs.

    python -m pytest -m gpu

Runs only where onnxruntime-gpu sees a CUDA device; otherwise every test skips and ``-ra`` prints
why (as tests/test_gpu.py).
"""

from __future__ import annotations

import shutil

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8]]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_cuda_float16_one_call_tree_equals_autoregressive(exported, tmp_path, kind):
    import onnxruntime as ort

    import graphs
    from exporter.optimize import optimize_export
    from graphs import contract as C
    from graphs.manifest import Manifest

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"no CUDA: onnxruntime {ort.__version__} offers {ort.get_available_providers()} "
                    f"(pip install 'specexport[gpu]' on a machine with an NVIDIA GPU)")
    out = tmp_path / "out"
    shutil.copytree(exported(kind), out)
    optimize_export(out, target="cuda", progress=None, time_gain=False)
    role = C.eagle_tree_role(2, 3, 6)
    assert Manifest.read(out).optimization[role]["dtype"] == "float16"
    dec = graphs.load(out, provider="cuda", eagle_draft="one_call", adaptive=False)
    assert dec.provider == "cuda"
    ar = dec.generate(PROMPTS, max_new_tokens=24, mode="autoregressive")
    sp = dec.generate(PROMPTS, max_new_tokens=24)
    assert [r.token_ids for r in sp] == [r.token_ids for r in ar]
    assert sp[0].stats.draft_calls == sp[0].stats.steps > 0
