"""Ray Serve scale-out (graphs.serve.ray_app): two replicas on loopback with fractional CPUs, each with
its own engine, serving the OpenAI routes through Ray's proxy.

Slow (Ray starts its GCS, raylet, proxy and two replica actors; 30-73 s on a busy 2-core machine with
Ray 2.60.0, the tiny export included) and opt-in, in a network namespace that has only loopback:
``unshare -rn sh -c 'ip link set lo up && SPECEXPORT_RAY_TESTS=1 python -m pytest -m slow
tests/test_serve_ray.py'``. Skipped without ray. Opt-in because outside such a namespace Ray's own
processes listen beyond loopback: the Serve HTTP proxy binds 127.0.0.1 as configured, but Ray core's
gRPC servers (GCS, raylet, workers) listen on every interface and its dashboard agent on the node's
address, and Ray (2.60) has no setting to keep them on loopback. ``ray.init()`` here starts its own
cluster, with token auth on (it writes ``~/.ray/auth_token`` if there is none).
"""

from __future__ import annotations

import os
import time

import pytest
from conftest import REPO
from serve_helpers import free_port, get, with_chat_template

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("SPECEXPORT_RAY_TESTS") != "1",
                                                    reason="opt-in: SPECEXPORT_RAY_TESTS=1 (Ray listens beyond "
                                                           "loopback)")]


@pytest.fixture(scope="module")
def ray_server(exported, tmp_path_factory):
    from ray import serve

    from graphs.serve.ray_app import build_app

    out_dir = with_chat_template(exported("medusa"), tmp_path_factory.mktemp("ray") / "tiny-medusa")
    port = free_port()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0",
                                       "SPECEXPORT_CACHE_DIR": os.environ.get("SPECEXPORT_CACHE_DIR", "")}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"out_dir": str(out_dir), "num_replicas": 2, "num_cpus": 0.5, "threads": 1,
                             "max_running": 4, "max_queue": 8, "served_model_name": "tiny"}),
                  name="specexport", route_prefix="/")
        yield f"http://127.0.0.1:{port}", out_dir
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_serve_the_openai_routes(ray_server):
    import graphs

    url, out_dir = ray_server
    want = graphs.load(out_dir, provider="cpu", threads=1).generate("def main(", max_new_tokens=12, temperature=0)
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        assert [m.id for m in c.models.list().data] == ["tiny"]
        for _ in range(4):
            r = c.completions.create(model="tiny", prompt="def main(", max_tokens=12, temperature=0)
            assert r.choices[0].text == want.text and r.spec_decode["steps"] >= 1
        chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens >= 1
    pids = set()
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:  # the proxy spreads requests over both replicas
        status, body, _ = get(url + "/health")
        assert status == 200 and body["status"] == "ok"
        pids.add(body["pid"])
    assert len(pids) == 2
    status, text, _ = get(url + "/metrics")
    assert status == 200 and "vllm:spec_decode_num_drafts_total" in text
