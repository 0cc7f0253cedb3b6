"""The mixed load (graphs.serve.soak; ``python -m graphs.serve.loadgen --mixed``) against a tiny server.

A server on a free loopback port (as test_serve) serves the tiny Medusa export with a chat template;
the mixed load runs for a few seconds at 6 in flight: greedy (exact against references the server
gave idle, and against the library's generate), sampled, cancelled, bad, slow clients. Asserted: no
unexpected status, every greedy text exact, every kind sent, the samples taken, the server idle
after. No duration is asserted (the run is bounded by --duration and --timeout), nor the flatness
of RSS over seconds of warm-up.
"""

from __future__ import annotations

import json

import pytest
from serve_helpers import Server, with_chat_template

for _name in ("fastapi", "uvicorn", "prometheus_client", "jinja2", "httpx"):  # the serve extra (also in dev)
    pytest.importorskip(_name)

from graphs.serve import loadgen, soak  # noqa: E402


@pytest.fixture(scope="module")
def export_dir(exported, tmp_path_factory):
    return with_chat_template(exported("medusa"), tmp_path_factory.mktemp("soak") / "tiny-medusa")


@pytest.fixture(scope="module")
def server(export_dir, tmp_path_factory):
    with Server(export_dir, tmp_path_factory.mktemp("server"), "--max-running", "4", "--max-queue", "64",
                "--served-model-name", "tiny") as s:
        yield s


def test_mixed_load_every_answer_as_deserved(server, export_dir, tmp_path):
    out = tmp_path / "soak.json"
    png = tmp_path / "soak.png"
    rc = loadgen.main(["--mixed", "--url", server.url, "--duration", "12", "--concurrency", "6", "--seed", "3",
                       "--pid", str(server.proc.pid), "--export", str(export_dir), "--greedy-prompts", "6",
                       "--chat-prompts", "4", "--max-tokens", "24", "--sample-s", "0.5", "--timeout", "60",
                       "--json", str(out), "--png", str(png)])
    rep = json.loads(out.read_text())
    assert rep["unexpected"] == [] and rep["unexpected_count"] == 0, rep["unexpected"]
    assert rep["inexact"] == [], rep["inexact"]
    assert rep["library"]["checked"] == 10 and rep["library"]["differ"] == []
    assert rep["chat"] and rep["greedy"]["references"] == 10
    assert rep["greedy"]["checked"] == rep["greedy"]["exact"] > 0
    sent = set(rep["counts"])
    assert {"greedy", "greedy_stream", "sampled", "sampled_stream", "bad", "cancel_stream"} <= sent, rep["counts"]
    assert all(s.startswith("4") for s in rep["counts"]["bad"]), rep["counts"]["bad"]
    assert not any(s.startswith("5") for by in rep["counts"].values() for s in by)
    assert rep["idle_at_end"] and rep["health_at_end"]["engine_failures"] == 0
    assert rep["server_metrics_delta"].get('vllm:request_success_total{finished_reason="error"}', 0) == 0
    assert len(rep["samples"]) >= 3 and all(s["rss_bytes"] > 0 and s["fds"] > 0 for s in rep["samples"])
    assert rep["fds_before_after"]["ok"], rep["fds_before_after"]
    assert png.stat().st_size > 0
    assert rc in (0, 1) and (rc == 0) == rep["ok"]


def test_bad_requests_each_get_their_4xx(server):
    """Every bad request of the mix, once: its expected status with OpenAI's error body."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=30) as c:
        for name, path, raw, expected in soak.bad_requests("tiny", 512):
            r = c.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code in expected and soak.is_openai_error(r.json()), (name, r.status_code, r.text[:200])


def test_flatness_is_judged_on_the_second_half():
    samples = [{"t": float(t), "rss_bytes": 100 * 2**20 + (t * 2**20 if t < 10 else 0), "fds": 40 + t % 3,
                "sockets": t % 3} for t in range(21)]
    f = soak.judge_flat(samples, 0.0, 20.0, rss_tolerance_pct=5.0, fd_tolerance=8)
    assert f["ok"] and f["window_s"] == [10.0, 20.0] and f["rss"]["spread_bytes"] == 0
    assert f["fds_not_sockets"]["spread"] == 0 and f["sockets"]["spread"] == 2
    grow = [dict(s, rss_bytes=100 * 2**20 + s["t"] * 2**20) for s in samples]
    assert not soak.judge_flat(grow, 0.0, 20.0, 5.0, 8)["rss"]["ok"]  # +10 MiB of ~110: 9 %
    leak = [dict(s, fds=40 + s["t"]) for s in samples]
    assert not soak.judge_flat(leak, 0.0, 20.0, 5.0, 8)["fds_not_sockets"]["ok"]
    assert not soak.judge_flat(samples[:11], 0.0, 20.0, 5.0, 8)["ok"]  # fewer than 2 samples in the half


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "https://127.0.0.1:8000"])
def test_refuses_anything_but_loopback_http(url):
    with pytest.raises(SystemExit):
        soak.Soak(url)
