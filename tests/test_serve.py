"""The OpenAI-compatible server (graphs.serve) through the official ``openai`` client.

One server (``python -m graphs.serve``, torch and transformers unimportable) on a free loopback
port serves a tiny Medusa export with a chat template: completions and chat, streamed and not,
greedy output equal to the runtime's own ``generate``, stop strings, usage and finish reasons,
each response's acceptance statistics, bad parameters (400 naming them), the models list, the
metrics. A second one has an API key: the key (401). Overload (429 with Retry-After) on a server in
this process, its engine held full. Faults are in test_serve_faults.py.
"""

from __future__ import annotations

import json

import pytest
from serve_helpers import Server, get, metric, render, with_chat_template

import graphs

for _name in ("fastapi", "uvicorn", "prometheus_client", "jinja2"):  # the serve extra (also in dev)
    pytest.importorskip(_name)
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

PROMPT = "def main("
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def export_dir(exported, tmp_path_factory):
    return with_chat_template(exported("medusa"), tmp_path_factory.mktemp("serve") / "tiny-medusa")


@pytest.fixture(scope="module")
def server(export_dir, tmp_path_factory):
    with Server(export_dir, tmp_path_factory.mktemp("server"), "--max-running", "8", "--max-queue", "256",
                "--max-body-bytes", "65536", "--served-model-name", "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def dec(export_dir):
    return graphs.load(export_dir, provider="cpu", threads=1)


def test_health_and_models(server, client):
    assert server.health()["status"] == "ok"
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].max_model_len == 512


@pytest.mark.parametrize("speculation", ["adaptive", "on", "off"])
def test_greedy_completion_equals_generate(client, dec, speculation):
    want = dec.generate(PROMPT, max_new_tokens=24, temperature=0, speculation=speculation)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"speculation": speculation})
    c = r.choices[0]
    assert c.text == want.text
    assert c.finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(dec.encode(PROMPT))
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    s = r.spec_decode
    assert s["speculation"] == speculation
    if speculation == "off":
        assert s["num_drafts"] == 0 and s["num_draft_tokens"] == 0 and s["mean_accepted_length"] == 1.0
    if speculation == "on":
        assert s["num_drafts"] == s["steps"] > 0 and s["num_draft_tokens"] > 0
    assert 0 <= s["num_accepted_tokens"] <= s["num_draft_tokens"]
    assert sum(s["accepted_per_pos"][:1]) <= s["num_drafts"]


def test_streamed_completion_equals_generate(client, dec):
    want = dec.generate(PROMPT, max_new_tokens=30, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].spec_decode["speculation"] == "adaptive"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(want.token_ids)
    assert last.spec_decode == finals[0].spec_decode  # the last chunk carries the acceptance statistics
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompt(client, dec):
    want = dec.generate([5, 9, 3], max_new_tokens=10, temperature=0)
    r = client.completions.create(model="tiny", prompt=[5, 9, 3], max_tokens=10, temperature=0)
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == 3


def test_chat(client, dec):
    want = dec.generate(dec.tokenizer.encode(render(MESSAGES), add_special_tokens=False).ids, max_new_tokens=20,
                        temperature=0)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.spec_decode["steps"] >= 1
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].spec_decode["steps"] >= 1


def test_stop_strings(client, dec):
    full = dec.generate(PROMPT, max_new_tokens=40, temperature=0, eos_token_id=[]).text
    stop = full[10:12]
    want = dec.generate(PROMPT, max_new_tokens=40, temperature=0, eos_token_id=[], stop=[stop])
    assert want.finish_reason == "stop" and stop not in want.text
    for stream in (False, True):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "\x00"],
                                      stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(r)
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert text == want.text and finish == "stop"


def test_sampling_parameters(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.8, top_p=0.9, seed=7,
              extra_body={"top_k": 20, "speculation": "on"})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # seeded: reproducible
    assert a.usage.completion_tokens == 16 or a.choices[0].finish_reason == "stop"


def test_tree_per_request(client, dec):
    want = dec.generate(PROMPT, max_new_tokens=16, temperature=0)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"speculation": "on", "tree": [[0], [0, 0]]})
    assert r.choices[0].text == want.text
    assert r.spec_decode["num_draft_tokens"] == 2 * r.spec_decode["num_drafts"]  # a chain of 2 drafted tokens


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 2}, "n"), ({"logprobs": 2}, "logprobs"), ({"echo": True}, "echo"), ({"presence_penalty": 0.5},
     "presence_penalty"), ({"best_of": 3}, "best_of"), ({"frobnicate": 1}, "frobnicate"),
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"speculation": "maybe"}, "speculation"), ({"tree": "/etc/passwd"}, "tree"), ({"seed": -3}, "seed"),
    ({"stop": [""]}, "stop"), ({"top_k": 1.5}, "top_k"), ({"tree": [[0] * 9]}, None), ({"tree": [[0]] * 65}, "tree"),
    ({"prompt": ["a", "b"]}, "prompt"), ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_parameters_are_400s_that_name_them(server, extra, param):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    if param:
        assert param in err["message"]


def test_bad_parameters_through_the_client(client):
    with pytest.raises(openai.BadRequestError, match="n=3"):
        client.completions.create(model="tiny", prompt=PROMPT, n=3)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, logprobs=True)
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.completions.create(model="gpt-4", prompt=PROMPT)


def test_prompt_over_the_context(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512") as e:
        client.completions.create(model="tiny", prompt=[5] * 600, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="508 in the completion"):
        client.completions.create(model="tiny", prompt=[5] * 10, max_tokens=508)


def test_metrics_use_vllms_names(server, client):
    before = server.metrics()
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"speculation": "on", "ignore_eos": True})
    after = server.metrics()
    s = r.spec_decode
    for name, key in (("vllm:spec_decode_num_drafts_total", "num_drafts"),
                      ("vllm:spec_decode_num_draft_tokens_total", "num_draft_tokens"),
                      ("vllm:spec_decode_num_accepted_tokens_total", "num_accepted_tokens")):
        assert metric(after, name) - metric(before, name) == s[key], name
    for k, v in enumerate(s["accepted_per_pos"]):
        name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        assert metric(after, name, position=k) - metric(before, name, position=k) == v
    assert metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total") == 20
    for h in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert metric(after, h) == metric(before, h) + 1
    assert metric(after, "vllm:inter_token_latency_seconds_count") > metric(before,
                                                                             "vllm:inter_token_latency_seconds_count")
    assert metric(after, "specexport:engine_steps_total") > metric(before, "specexport:engine_steps_total")
    assert "specexport:plain_steps_total" in after and "vllm:num_requests_running" in after
    assert "vllm:num_requests_waiting" in after
    # two running totals of seconds on the engine's thread: the request's steps added to the time inside
    # step(); neither goes down. (Which is larger depends on the machine's load: not asserted.)
    steps, overhead = "specexport:engine_step_seconds", "specexport:worker_overhead_seconds"
    assert metric(after, steps) > metric(before, steps) >= 0
    assert metric(after, overhead) >= metric(before, overhead) >= 0 and metric(after, overhead) > 0


def test_curl_style_sse(server):
    """The wire format itself: ``data: {json}`` events and ``data: [DONE]``."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert objs[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "usage" not in objs[-1]


@pytest.fixture(scope="module")
def guarded(export_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guarded")
    (tmp / "key").write_text("sk-test-0123456789\n")
    with Server(export_dir, tmp, "--api-key-file", tmp / "key", "--max-running", "2", "--max-queue", "2",
                "--retry-after", "3") as s:
        yield s


def test_api_key(guarded):
    url = guarded.url + "/v1"
    for key in ("wrong", "sk-test-012345678", "sk-test-0123456789x"):
        with openai.OpenAI(base_url=url, api_key=key, max_retries=0) as c, pytest.raises(openai.AuthenticationError):
            c.models.list()
    status, body, _ = get(url + "/models")  # no Authorization header at all
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=url, api_key="sk-test-0123456789", max_retries=0) as c:
        assert c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=3).usage
    assert get(guarded.url + "/health")[0] == 200  # health and metrics are open (as vLLM's)


def test_overload_is_429_with_retry_after(export_dir, tmp_path):
    """2 rows + 2 queue places held full (the engine's step held, in process: the 4 stay on it however
    fast the engine is): 12 concurrent requests more are refused at once, 429 with Retry-After,
    never hang; released, the 4 get their completions and the server serves again."""
    import asyncio
    import time
    from concurrent.futures import ThreadPoolExecutor

    from test_serve_hostile import BOUND_S, held_steps, in_process

    (tmp_path / "key").write_text("sk-test-0123456789\n")
    auth = {"Authorization": "Bearer sk-test-0123456789"}
    body = {"prompt": PROMPT, "max_tokens": 48, "ignore_eos": True}

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=auth,
                                     limits=httpx.Limits(max_connections=32)) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(12)])

    with in_process(export_dir, max_running=2, max_queue=2, retry_after=3,
                    api_key_file=str(tmp_path / "key")) as (state, url), \
            ThreadPoolExecutor(4) as pool, held_steps(state) as entered:
        holders = [pool.submit(httpx.post, url + "/v1/completions", json=body, headers=auth, timeout=BOUND_S)
                   for _ in range(4)]
        assert entered.wait(BOUND_S)
        deadline = time.monotonic() + BOUND_S  # until all 4 are past admission (on the engine or posted to it)
        while state.worker.snapshot["live"] + state.preparing < 4:
            assert time.monotonic() < deadline and not any(f.done() for f in holders), [f.done() for f in holders]
            time.sleep(0.01)
        full = asyncio.run(main(url))
        assert [r.status_code for r in full] == [429] * 12
        assert all(r.headers["retry-after"] == "3" and r.json()["error"]["type"] == "rate_limit_error" for r in full)
        entered.release()
        ok = [f.result() for f in holders]
        assert [r.status_code for r in ok] == [200] * 4, [r.text for r in ok]
        assert all(r.json()["usage"]["completion_tokens"] == 48 for r in ok)
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, headers=auth, timeout=BOUND_S)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_load_generator(server, export_dir, tmp_path):
    """Bounded loads against the server: vLLM's serving metrics, closed loop and Poisson, JSON + PNG."""
    from graphs.serve import loadgen

    out = tmp_path / "load.json"
    assert loadgen.main(["--url", server.url, "--concurrency", "1", "3", "--rate", "40", "--rate-fraction", "0.5",
                         "--requests", "6", "--max-tokens", "8", "--speculation", "adaptive", "off",
                         "--prompt-chars", "60", "--engine-baseline", str(export_dir), "--threads", "1",
                         "--overhead-repeats", "2", "--baseline-pool", "per-session",  # (this process runs others)
                         "--goodput", "ttft:5000", "tpot:1000", "--json", str(out), "--png",
                         str(tmp_path / "load.png")]) == 0
    rep = json.loads(out.read_text())
    loads = [(r["load"], r["speculation"]) for r in rep["runs"]]
    assert len(loads) == 8 and ("concurrency=3", "off") in loads and ("poisson=40.00/s", "adaptive") in loads
    for r in rep["runs"]:
        assert r["completed"] == 6 and r["failed"] == 0 and r["total_output_tokens"] == 48
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(r[key]) == {"mean", "median", "std", "p99"} and r[key]["median"] > 0
        assert r["request_throughput"] > 0 and r["output_throughput"] > 0 and r["goodput"] > 0
        if r["speculation"] == "off":  # (adaptive may have learned that this random drafter never pays)
            assert r["spec_decode"]["num_drafts"] == 0 and r["spec_decode"]["mean_accepted_length"] == 1.0
    assert rep["engine_baseline"]["adaptive"]["server_overhead_ratio"] > 0
    assert len(rep["engine_baseline"]["off"]["pairs"]) == 2
    assert (tmp_path / "load.png").stat().st_size > 1000
    with pytest.raises(SystemExit, match="loopback"):
        loadgen.main(["--url", "http://example.com:8000"])


def test_the_server_needs_no_torch(server, tmp_path):
    """Every server of these tests runs with torch and transformers unimportable (serve_helpers);
    here the modules themselves: imported in that environment, nothing of torch is loaded."""
    import subprocess
    import sys

    from conftest import REPO
    from serve_helpers import blocked_env

    code = ("import sys, graphs.serve.app, graphs.serve.loadgen, graphs.serve.__main__, graphs.chat\n"
            "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'exporter')])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=blocked_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


@pytest.mark.parametrize("kind", ["eagle", "base"])
def test_other_exports(exported, tmp_path, kind):
    """EAGLE (its own proposer and K/V) and a base-only export (no drafter: speculation 'on' is a 400)."""
    out_dir = exported(kind)
    want = graphs.load(out_dir, provider="cpu", threads=1).generate(PROMPT, max_new_tokens=16, temperature=0)
    with Server(out_dir, tmp_path, "--served-model-name", kind) as s, \
            openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0) as c:
        r = c.completions.create(model=kind, prompt=PROMPT, max_tokens=16, temperature=0)
        assert r.choices[0].text == want.text
        streamed = "".join(x.choices[0].text for x in c.completions.create(model=kind, prompt=PROMPT, max_tokens=16,
                                                                           temperature=0, stream=True))
        assert streamed == want.text
        if kind == "base":
            assert r.spec_decode["speculation"] == "off" and r.spec_decode["num_drafts"] == 0
            with pytest.raises(openai.BadRequestError, match="needs a drafter"):
                c.completions.create(model=kind, prompt=PROMPT, max_tokens=4, extra_body={"speculation": "on"})
        else:
            assert r.spec_decode["num_drafts"] > 0 or r.spec_decode["plain_steps"] == r.spec_decode["steps"]
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            c.chat.completions.create(model=kind, messages=[{"role": "user", "content": "hi"}])
        s.wait_idle()
