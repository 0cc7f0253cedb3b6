"""Session options: the process-wide thread pool the CLIs use gives the same tokens."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

CODE = """
import sys, graphs
assert graphs.use_shared_thread_pool(2)
assert graphs.use_shared_thread_pool(2)          # idempotent for the same size
assert not graphs.use_shared_thread_pool(1)      # a pool is set once per process
d = graphs.load(sys.argv[1], provider="cpu")
print(d.generate([5, 9, 3], max_new_tokens=12).token_ids)
print(d.generate([5, 9, 3], max_new_tokens=12, mode="autoregressive").token_ids)
"""


def test_shared_thread_pool_same_tokens(exported):
    out_dir = exported("eagle")
    import graphs

    want = graphs.load(out_dir, provider="cpu").generate([5, 9, 3], max_new_tokens=12).token_ids
    proc = subprocess.run([sys.executable, "-c", CODE, str(out_dir)], cwd=REPO, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    spec, ar = proc.stdout.strip().splitlines()
    assert spec == ar == str(want)
