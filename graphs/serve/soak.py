"""Mixed load for a while against a running server: every answer checked, the server's RSS and fds watched.

    python -m graphs.serve.soak --url http://127.0.0.1:8000 --duration 600 --json soak.json --png soak.png
    python -m graphs.serve.loadgen --mixed ...       # the same

It first asks the server (idle, one request at a time, temperature 0) for the greedy text of each of
``--greedy-prompts`` completion prompts and ``--chat-prompts`` chats: the references (with ``--export
OUT_DIR``, each is also compared with the library's ``graphs.load(OUT_DIR).generate``). Then, for
``--duration`` seconds, ``--concurrency`` clients each send a random mix (``--seed``: the same mix every
run) of

    greedy     completions and chats, streamed and not, temperature 0 or one below vLLM's epsilon
               (1e-310, 1e-6: greedy too): 200 and the reference's text, exactly
    sampled    temperature, top_p, top_k, seed, speculation random in their valid ranges: 200
               (a stream ends with [DONE] and no error chunk)
    cancel     a stream closed after a few chunks; a non-streamed request whose connection closes
               (FIN or RST) before its answer
    bad        malformed JSON, out-of-range numbers, unknown fields, lone surrogates, too many tokens,
               another model, a body over the limit, ...: the 4xx expected, with OpenAI's error body
    slow       a greedy stream read slowly; a greedy request whose headers and body trickle in within
               the server's timeouts: 200 and the reference's text

and samples the server's RSS, open fds (sockets apart) and threads from /proc every ``--sample-s``.
Its pid: ``--pid``, else the one ``/health`` reports. The report: counts by kind and status, every
unexpected status and every inexact greedy text (with its prompt), the curves, and "flat after
warm-up": over the second half of the run, RSS max - min within ``--rss-tolerance`` % of its min and
non-socket fds within ``--fd-tolerance``; sockets follow the clients' connections (at most two per
client: its pooled one and a raw one), so the fds are judged again at the end, once every client
connection is closed: within ``--fd-tolerance`` of the count before the load. Exit status 0 when
nothing was unexpected, every greedy text exact and the curves flat, else 1.

Loopback only (127.0.0.1, ::1, localhost), plain HTTP. Bounded: ``--duration`` seconds of sending,
``--max-requests`` requests, each request ``--timeout`` seconds at most.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import socket
import struct
import sys
import time
from urllib.parse import urlparse

from graphs.serve.clients import check_loopback, code_prompts, write_report

CHAT_QUESTIONS = [
    "What does this Python code do?", "Write a function that reverses a list.", "hello",
    "Explain recursion in one sentence.", "Name three sorting algorithms.", "What is a dictionary in Python?",
    "Write a loop that prints 1 to 5.", "Fix this code:", "Summarize:", "Translate to French: good morning",
]

# kind -> weight (of the mix); chat kinds only when the server has a chat template
WEIGHTS = {
    "greedy": 22, "greedy_stream": 14, "sampled": 14, "sampled_stream": 10, "cancel_stream": 8, "cancel_wait": 4,
    "bad": 18, "slow_read": 5, "slow_body": 5,
}
GREEDY_TEMPERATURES = (0, 0, 0, 0.0, -0.0, 1e-310, 1e-6)  # below 1e-5 (vLLM's epsilon) is greedy
SPECULATIONS = (None, "adaptive", "on", "off")


# ---------------------------------------------------------------------- the server's process


def proc_sample(pid: int) -> dict:
    """RSS (bytes), open fds (of them sockets), threads of process ``pid``, from /proc."""
    rss = threads = None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    fds = sockets = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # an fd closed between the listing and the readlink
            target = os.readlink(f"/proc/{pid}/fd/{name}")
            fds += 1
            sockets += target.startswith("socket:")
    return {"rss_bytes": rss, "fds": fds, "sockets": sockets, "threads": threads}


def judge_flat(samples: list[dict], t_start: float, t_end: float, rss_tolerance_pct: float,
               fd_tolerance: int) -> dict:
    """Max - min over the samples of the second half of [t_start, t_end]: RSS within
    ``rss_tolerance_pct`` % of its min, non-socket fds within ``fd_tolerance``."""
    mid = t_start + (t_end - t_start) / 2
    window = [s for s in samples if mid <= s["t"] <= t_end]
    out = {"window_s": [round(mid, 1), round(t_end, 1)], "samples": len(window)}
    if len(window) < 2:
        out.update(ok=False, why="fewer than 2 samples in the second half")
        return out
    rss = [s["rss_bytes"] for s in window]
    spread = max(rss) - min(rss)
    pct = 100.0 * spread / min(rss)
    out["rss"] = {"min_bytes": min(rss), "max_bytes": max(rss), "spread_bytes": spread, "spread_pct": round(pct, 3),
                  "tolerance_pct": rss_tolerance_pct, "ok": pct <= rss_tolerance_pct}
    other = [s["fds"] - s["sockets"] for s in window]
    out["fds_not_sockets"] = {"min": min(other), "max": max(other), "spread": max(other) - min(other),
                              "tolerance": fd_tolerance, "ok": max(other) - min(other) <= fd_tolerance}
    fds = [s["fds"] for s in window]
    socks = [s["sockets"] for s in window]
    out["fds"] = {"min": min(fds), "max": max(fds), "spread": max(fds) - min(fds)}
    out["sockets"] = {"min": min(socks), "max": max(socks), "spread": max(socks) - min(socks)}
    out["ok"] = out["rss"]["ok"] and out["fds_not_sockets"]["ok"]
    return out


# ---------------------------------------------------------------------- raw HTTP (slow and cut clients)


async def _read_response(reader) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 response on a ``Connection: close`` connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    rest = await reader.read()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body, i = b"", 0
        while i < len(rest):
            j = rest.index(b"\r\n", i)
            n = int(rest[i:j].split(b";")[0], 16)
            if n == 0:
                break
            body += rest[j + 2 : j + 2 + n]
            i = j + 2 + n + 2
        return status, body
    return status, rest


async def raw_request(host: str, port: int, path: str, body: bytes, *, header_pieces: int = 1, body_pieces: int = 1,
                      header_s: float = 0.0, body_s: float = 0.0, chunked: bool = False, give_up_s: float | None = None,
                      reset: bool = False, timeout: float = 120.0) -> tuple[int | str, bytes]:
    """POST ``body`` on a fresh connection, its headers in ``header_pieces`` over ``header_s`` seconds and
    its body in ``body_pieces`` over ``body_s``; the status and body of the answer. ``give_up_s``: close
    the connection that long after sending unless the answer came (status "cancelled"; ``reset``: with
    an RST, SO_LINGER 0, instead of a FIN)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        framing = b"Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {len(body)}\r\n".encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Connection: close\r\n").encode() + framing + b"\r\n"

        async def send(data: bytes, pieces: int, seconds: float, frame: bool) -> None:
            step = max(1, -(-len(data) // max(1, pieces)))
            parts = [data[i : i + step] for i in range(0, len(data), step)] or [b""]
            for k, part in enumerate(parts):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part) if frame and part else part)
                await writer.drain()
                if k < len(parts) - 1 and seconds > 0:
                    await asyncio.sleep(seconds / (len(parts) - 1))

        await send(head, header_pieces, header_s, False)
        await send(body, body_pieces, body_s, chunked)
        if chunked:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        try:
            return await asyncio.wait_for(_read_response(reader), give_up_s if give_up_s is not None else timeout)
        except asyncio.TimeoutError:
            if give_up_s is None:
                return "timeout", b""
            if reset:
                sock = writer.get_extra_info("socket")
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return "cancelled", b""
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


# ---------------------------------------------------------------------- the mix


def is_openai_error(body) -> bool:
    e = body.get("error") if isinstance(body, dict) else None
    return isinstance(e, dict) and isinstance(e.get("message"), str) and all(k in e for k in ("type", "param", "code"))


def bad_requests(model: str, max_len: int) -> list[tuple[str, str, bytes, tuple[int, ...]]]:
    """(name, path, raw body, statuses expected): requests that deserve a 4xx, never a 200 or a 5xx."""
    c, ch = "/v1/completions", "/v1/chat/completions"

    def j(path, **body):
        body.setdefault("model", model)
        if path == c:
            body.setdefault("prompt", "def main(")
        else:
            body.setdefault("messages", [{"role": "user", "content": "hi"}])
        return json.dumps(body).encode()

    big = max_len * 4
    return [
        ("malformed_json", c, b'{"prompt": "def main(", "max_tokens": ', (400,)),
        ("not_json", c, b"prompt=def+main", (400,)),
        ("not_an_object", c, b"[1, 2, 3]", (400,)),
        ("deep_nesting", c, b'{"prompt": "x", "stop": ' + b"[" * 60 + b"]" * 60 + b"}", (400,)),
        ("temperature_negative", c, j(c, temperature=-1), (400,)),
        ("temperature_nan_string", c, j(c, temperature="nan"), (400,)),
        ("temperature_infinite", c, j(c, max_tokens=4).replace(b'"max_tokens"', b'"temperature": 1e999, "max_tokens"'),
         (400,)),
        ("top_p_zero", c, j(c, top_p=0), (400,)),
        ("top_p_above_one", c, j(c, top_p=1.5), (400,)),
        ("top_k_below", c, j(c, top_k=-2), (400,)),
        ("max_tokens_zero", c, j(c, max_tokens=0), (400,)),
        ("max_tokens_float", c, j(c, max_tokens=3.5), (400,)),
        ("seed_negative", c, j(c, seed=-1), (400,)),
        ("seed_huge", c, j(c, seed=2**64), (400,)),
        ("seed_4400_digits", c, j(c, max_tokens=4).replace(b'"max_tokens"', b'"seed": ' + b"9" * 4400 +
                                                             b', "max_tokens"'), (400,)),
        ("stream_not_bool", c, j(c, stream="yes"), (400,)),
        ("speculation_unknown", c, j(c, speculation="sometimes"), (400,)),
        ("unknown_field", c, j(c, frobnicate=1), (400,)),
        ("unsupported_n", c, j(c, n=2), (400,)),
        ("unsupported_logprobs", c, j(c, logprobs=5), (400,)),
        ("prompt_empty", c, j(c, prompt=""), (400,)),
        ("prompt_batch", c, j(c, prompt=["a", "b"]), (400,)),
        ("surrogate_prompt", c, b'{"prompt": "ab\\ud800cd", "max_tokens": 4}', (400,)),
        ("surrogate_key", c, b'{"prompt": "x", "\\udfff": 1}', (400,)),
        ("surrogate_chat", ch, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', (400,)),
        ("max_tokens_over_context", c, j(c, max_tokens=max_len + 1), (400,)),
        ("prompt_ids_over_context", c, j(c, prompt=[5] * (max_len + 8), max_tokens=4), (400,)),
        ("prompt_text_over_context", c, j(c, prompt="x " * big, max_tokens=4), (400,)),
        ("chat_no_messages", ch, j(ch, messages=[]), (400,)),
        ("chat_no_role", ch, j(ch, messages=[{"content": "hi"}]), (400,)),
        ("chat_image_part", ch, j(ch, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]), (400,)),
        ("chat_both_max_tokens", ch, j(ch, max_tokens=4, max_completion_tokens=4), (400,)),
        ("chat_too_many_messages", ch, j(ch, messages=[{"role": "user", "content": "x"}] * 1100), (400,)),
        ("other_model", c, j(c, model=model + "-not-this-one"), (404,)),
        ("unknown_route", "/v1/nothing-here", j(c), (404,)),
        ("body_over_limit", c, j(c, prompt="y" * (2 << 20)), (413, 400)),  # 413 over --max-body-bytes (1 MiB)
    ]


class Soak:
    """One mixed run (see the module doc); ``asyncio.run(Soak(...).run())`` -> the report."""

    def __init__(self, url: str, duration: float = 600.0, concurrency: int = 8, seed: int = 0, pid: int | None = None,
                 export: str | None = None, greedy_prompts: int = 16, chat_prompts: int = 8, max_tokens: int = 48,
                 sample_s: float = 2.0, rss_tolerance: float = 5.0, fd_tolerance: int = 8, timeout: float = 120.0,
                 max_requests: int = 1_000_000, log=print):
        self.url = check_loopback(url)
        p = urlparse(self.url)
        if p.scheme != "http":
            raise SystemExit(f"error: the mixed load speaks plain HTTP to loopback; got {url}")
        self.host, self.port = p.hostname, p.port or 80
        if duration <= 0 or concurrency < 1 or max_requests < 1 or timeout <= 0 or sample_s <= 0:
            raise SystemExit("error: --duration, --concurrency, --max-requests, --timeout, --sample-s must be > 0")
        self.duration, self.concurrency, self.seed, self.pid = duration, concurrency, seed, pid
        self.export, self.n_greedy, self.n_chat, self.max_tokens = export, greedy_prompts, chat_prompts, max_tokens
        self.sample_s, self.rss_tol, self.fd_tol, self.timeout = sample_s, rss_tolerance, fd_tolerance, timeout
        self.max_requests, self.log = max_requests, log
        self.records: list[dict] = []
        self.samples: list[dict] = []
        self.sent = 0

    # ------------------------------------------------------------------ set-up

    async def _setup(self, client) -> None:
        r = await client.get("/v1/models")
        r.raise_for_status()
        m = r.json()["data"][0]
        self.model, self.max_len = m["id"], int(m.get("max_model_len") or 512)
        h = (await client.get("/health")).json()
        if self.pid is None:
            self.pid = h.get("pid")
            if self.pid is None:
                raise SystemExit("error: /health reports no pid; pass --pid")
        proc_sample(self.pid)  # readable, or an error now rather than after the run
        rng = random.Random(self.seed)
        self.max_tokens = max(4, min(self.max_tokens, self.max_len // 4))
        chars = max(40, min(240, self.max_len // 3))  # (a byte-level tokenizer: a token per character)
        code = code_prompts(self.n_greedy + self.n_chat + 32, self.seed, chars)
        self.prompts = {("completion", i): {"prompt": code[i]} for i in range(self.n_greedy)}
        probe = await client.post("/v1/chat/completions", json={"model": self.model, "max_tokens": 1,
                                                                "messages": [{"role": "user", "content": "hi"}]})
        self.chat = probe.status_code == 200
        self.chat_note = None if self.chat else f"chat not exercised: {probe.status_code} {probe.text[:200]}"
        if self.chat:
            for i in range(self.n_chat):
                q = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]
                msgs = [{"role": "user", "content": q + ("\n" + code[self.n_greedy + i] if i % 2 else "")}]
                if i % 3 == 0:
                    msgs.insert(0, {"role": "system", "content": "You are a helpful assistant."})
                self.prompts[("chat", i)] = {"messages": msgs}
        for key in self.prompts:
            self.prompts[key]["max_tokens"] = rng.randint(max(2, self.max_tokens // 4), self.max_tokens)
        self.cancel_prompts = [p[: max(20, chars // 2)] for p in code[self.n_greedy + self.n_chat:]]
        self.speculations = []
        for spec in SPECULATIONS:  # what this export serves (speculation "on" needs a drafter)
            body = {"model": self.model, "prompt": "x", "max_tokens": 2, **({"speculation": spec} if spec else {})}
            if (await client.post("/v1/completions", json=body)).status_code == 200:
                self.speculations.append(spec)
        self.bad = bad_requests(self.model, self.max_len)
        # the references: the server idle, one request at a time, temperature 0
        self.refs = {}
        t0 = time.perf_counter()
        for key in self.prompts:
            r = await client.post(self._path(key[0]), json=self._body(key, 0, stream=False), timeout=self.timeout)
            if r.status_code != 200:
                raise SystemExit(f"error: the reference request for {key} got {r.status_code}: {r.text[:300]}")
            body = r.json()
            self.refs[key] = {"text": self._text(key[0], body), "finish_reason": body["choices"][0]["finish_reason"],
                              "completion_tokens": body["usage"]["completion_tokens"]}
        self.reference_s = time.perf_counter() - t0
        self.log(f"{len(self.refs)} greedy references from the server in {self.reference_s:.1f} s "
                 f"(model {self.model}, max_model_len {self.max_len}, chat {'on' if self.chat else 'off'}, "
                 f"speculation settings {self.speculations})")
        self.library = self._library_check() if self.export else None

    def _library_check(self) -> dict:
        """Each reference against ``graphs.load(export).generate`` (greedy, the same max_tokens)."""
        import graphs
        from graphs.chat import ChatTemplate

        dec = graphs.load(self.export, provider="cpu", threads=1)
        template = ChatTemplate.from_export(self.export) if self.chat else None
        differ = []
        for key, p in self.prompts.items():
            if key[0] == "chat":
                if template is None:
                    continue
                ids = dec.tokenizer.encode(template.render(p["messages"]), add_special_tokens=False).ids
            else:
                ids = dec.encode(p["prompt"])
            want = dec.generate(ids, max_new_tokens=p["max_tokens"], temperature=0).text
            if want != self.refs[key]["text"]:
                differ.append({"key": list(key), "prompt": p.get("prompt", p.get("messages")), "library": want,
                               "server": self.refs[key]["text"]})
        self.log(f"library check ({self.export}): {len(self.prompts) - len(differ)} of {len(self.prompts)} "
                 "references equal graphs.load(...).generate")
        return {"export": str(self.export), "checked": len(self.prompts), "differ": differ}

    # ------------------------------------------------------------------ requests

    @staticmethod
    def _path(kind: str) -> str:
        return "/v1/chat/completions" if kind == "chat" else "/v1/completions"

    @staticmethod
    def _text(kind: str, body: dict) -> str:
        c = body["choices"][0]
        return c["message"]["content"] if kind == "chat" else c["text"]

    def _body(self, key, temperature, stream: bool, **extra) -> dict:
        p = self.prompts[key]
        body = {"model": self.model, "temperature": temperature, "max_tokens": p["max_tokens"], "stream": stream}
        body.update({k: v for k, v in p.items() if k != "max_tokens"})
        if stream:
            body["stream_options"] = {"include_usage": True}
        body.update(extra)
        return body

    async def _stream(self, client, path: str, body: dict, pause=None, cut_after: int | None = None) -> dict:
        """A streamed request: status, the text, the finish reason, [DONE], error chunks, tokens."""
        out = {"status": None, "text": "", "finish_reason": None, "done": False, "errors": [], "tokens": 0, "chunks": 0}
        async with client.stream("POST", path, json=body) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["body"] = (await r.aread()).decode(errors="replace")[:300]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                obj = json.loads(line[6:])
                out["chunks"] += 1
                if "error" in obj:
                    out["errors"].append(obj["error"])
                    continue
                for c in obj.get("choices") or []:
                    out["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                    out["finish_reason"] = c.get("finish_reason") or out["finish_reason"]
                if obj.get("usage"):
                    out["tokens"] = obj["usage"]["completion_tokens"]
                if cut_after is not None and out["chunks"] >= cut_after:
                    out["status"] = "cancelled"
                    return out  # leaving the block closes the connection mid-stream
                if pause:
                    await asyncio.sleep(pause)
        return out

    def _greedy_key(self, rng: random.Random):
        keys = list(self.refs)
        return keys[rng.randrange(len(keys))]

    def _check_greedy(self, rec: dict, key, text: str | None, finish: str | None) -> None:
        ref = self.refs[key]
        rec["greedy"] = True
        rec["exact"] = text == ref["text"] and finish == ref["finish_reason"]
        if not rec["exact"]:
            p = self.prompts[key]
            rec["inexact"] = {"key": list(key), "prompt": p.get("prompt", p.get("messages")), "want": ref["text"],
                              "got": text, "want_finish": ref["finish_reason"], "got_finish": finish}

    async def one(self, client, kind: str, rng: random.Random) -> dict:
        rec = {"kind": kind, "t_start": time.perf_counter() - self.t0}
        try:
            await getattr(self, "_" + kind)(client, rng, rec)
        except Exception as e:  # a client-side failure is a finding, reported like any other
            rec.setdefault("status", f"exception: {type(e).__name__}")
            rec["ok"] = False
            rec["detail"] = f"{type(e).__name__}: {e}"[:300]
        rec["t_end"] = time.perf_counter() - self.t0
        req = rec.pop("_req", None)
        if not rec["ok"] and req is not None:  # what was sent, to reproduce it (cut: a body may be 2 MiB)
            rec["request"] = (req.decode(errors="replace") if isinstance(req, bytes) else json.dumps(req))[:600]
        return rec

    def _endpoint(self, rng) -> str:
        return "chat" if self.chat and rng.random() < 0.4 else "completion"

    async def _greedy(self, client, rng, rec, stream=False):
        key = self._greedy_key(rng)
        rec["sub"] = f"{key[0]}{'-stream' if stream else ''}"
        t = rng.choice(GREEDY_TEMPERATURES)
        body = rec["_req"] = self._body(key, t, stream)
        if stream:
            out = await self._stream(client, self._path(key[0]), body)
            rec["status"], rec["tokens"] = out["status"], out["tokens"]
            if out["status"] == 200:
                self._check_greedy(rec, key, out["text"], out["finish_reason"])
                rec["ok"] = rec["exact"] and out["done"] and not out["errors"]
                if out["errors"]:
                    rec["detail"] = str(out["errors"])[:300]
            else:
                rec["ok"], rec["detail"] = False, out.get("body")
            return
        r = await client.post(self._path(key[0]), json=body)
        rec["status"] = r.status_code
        if r.status_code == 200:
            b = r.json()
            rec["tokens"] = b["usage"]["completion_tokens"]
            self._check_greedy(rec, key, self._text(key[0], b), b["choices"][0]["finish_reason"])
            rec["ok"] = rec["exact"]
        else:
            rec["ok"], rec["detail"] = False, r.text[:300]

    async def _greedy_stream(self, client, rng, rec):
        await self._greedy(client, rng, rec, stream=True)

    def _sampled_body(self, rng, stream: bool) -> tuple[str, dict]:
        kind = self._endpoint(rng)
        if kind == "chat":
            key = ("chat", rng.randrange(self.n_chat))
            body = {"messages": self.prompts[key]["messages"]}
        else:
            body = {"prompt": self.prompts[("completion", rng.randrange(self.n_greedy))]["prompt"]}
        body.update(model=self.model, max_tokens=rng.randint(1, self.max_tokens), stream=stream,
                    temperature=round(rng.uniform(0.05, 1.6), 3))
        if rng.random() < 0.7:
            body["top_p"] = round(rng.uniform(0.05, 1.0), 3)
        if rng.random() < 0.6:
            body["top_k"] = rng.choice([-1, 0, 1, 2, 5, 20, 50, 200, 2**31 - 1])
        if rng.random() < 0.6:
            body["seed"] = rng.randrange(2**63)
        spec = rng.choice(self.speculations)
        if spec:
            body["speculation"] = spec
        if rng.random() < 0.2:
            body["ignore_eos"] = True
        if stream:
            body["stream_options"] = {"include_usage": True}
        return kind, body

    async def _sampled(self, client, rng, rec, stream=False):
        kind, body = self._sampled_body(rng, stream)
        rec["_req"] = body
        rec["sub"] = f"{kind}{'-stream' if stream else ''}"
        if stream:
            out = await self._stream(client, self._path(kind), body)
            rec["status"], rec["tokens"] = out["status"], out["tokens"]
            rec["ok"] = out["status"] == 200 and out["done"] and not out["errors"]
            if not rec["ok"]:
                rec["detail"] = str(out.get("body") or out["errors"] or "no [DONE]")[:300]
        else:
            r = await client.post(self._path(kind), json=body)
            rec["status"] = r.status_code
            rec["ok"] = r.status_code == 200
            if rec["ok"]:
                rec["tokens"] = r.json()["usage"]["completion_tokens"]
            else:
                rec["detail"] = r.text[:300]

    async def _sampled_stream(self, client, rng, rec):
        await self._sampled(client, rng, rec, stream=True)

    async def _cancel_stream(self, client, rng, rec):
        body = {"model": self.model, "prompt": rng.choice(self.cancel_prompts), "stream": True, "ignore_eos": True,
                "max_tokens": max(8, min(256, self.max_len // 2)), "temperature": rng.choice([0, 0.8])}
        rec["_req"] = body
        out = await self._stream(client, "/v1/completions", body, cut_after=rng.randint(1, 4))
        rec["status"] = out["status"]
        rec["ok"] = out["status"] in ("cancelled", 200) and not out["errors"]  # 200: it ended before the cut
        if not rec["ok"]:
            rec["detail"] = str(out.get("body") or out["errors"])[:300]

    async def _cancel_wait(self, client, rng, rec):
        body = {"model": self.model, "prompt": rng.choice(self.cancel_prompts), "ignore_eos": True,
                "max_tokens": max(8, min(256, self.max_len // 2)), "temperature": 0}
        reset = rng.random() < 0.5
        rec["sub"] = "rst" if reset else "fin"
        rec["_req"] = body
        status, raw = await raw_request(self.host, self.port, "/v1/completions", json.dumps(body).encode(),
                                        give_up_s=rng.uniform(0.05, 0.6), reset=reset, timeout=self.timeout)
        rec["status"] = status
        rec["ok"] = status in ("cancelled", 200)
        if not rec["ok"]:
            rec["detail"] = raw[:300].decode(errors="replace")

    async def _bad(self, client, rng, rec):
        name, path, raw, expected = self.bad[rng.randrange(len(self.bad))]
        rec["sub"], rec["_req"] = name, raw
        r = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
        rec["status"] = r.status_code
        try:
            body = r.json()
        except ValueError:
            body = None
        rec["ok"] = r.status_code in expected and is_openai_error(body)
        if not rec["ok"]:
            rec["detail"] = f"expected {expected} with an OpenAI error body; got: {r.text[:300]}"

    async def _slow_read(self, client, rng, rec):
        key = self._greedy_key(rng)
        rec["sub"] = key[0]
        rec["_req"] = self._body(key, 0, True)
        out = await self._stream(client, self._path(key[0]), rec["_req"], pause=rng.uniform(0.05, 0.3))
        rec["status"], rec["tokens"] = out["status"], out["tokens"]
        if out["status"] == 200:
            self._check_greedy(rec, key, out["text"], out["finish_reason"])
            rec["ok"] = rec["exact"] and out["done"] and not out["errors"]
        else:
            rec["ok"], rec["detail"] = False, out.get("body")

    async def _slow_body(self, client, rng, rec):
        key = self._greedy_key(rng)
        chunked = rng.random() < 0.5
        rec["sub"] = f"{key[0]}{'-chunked' if chunked else ''}"
        raw = rec["_req"] = json.dumps(self._body(key, 0, False)).encode()
        status, data = await raw_request(self.host, self.port, self._path(key[0]), raw, header_pieces=rng.randint(2, 4),
                                         header_s=rng.uniform(0.2, 1.5), body_pieces=rng.randint(3, 8),
                                         body_s=rng.uniform(0.5, 3.0), chunked=chunked, timeout=self.timeout)
        rec["status"] = status
        if status == 200:
            b = json.loads(data)
            rec["tokens"] = b["usage"]["completion_tokens"]
            self._check_greedy(rec, key, self._text(key[0], b), b["choices"][0]["finish_reason"])
            rec["ok"] = rec["exact"]
        else:
            rec["ok"], rec["detail"] = False, data[:300].decode(errors="replace")

    # ------------------------------------------------------------------ the run

    async def _sampler(self, stop: asyncio.Event) -> None:
        while True:
            s = proc_sample(self.pid)
            s["t"] = time.perf_counter() - self.t0
            s["done"] = len(self.records)
            s["tokens"] = sum(r.get("tokens") or 0 for r in self.records)
            self.samples.append(s)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.sample_s)
                return

    async def _metrics(self, client) -> dict:
        text = (await client.get("/metrics")).text
        out = {}
        for line in text.splitlines():
            for name in ("vllm:request_success_total", "specexport:requests_rejected_total"):
                if line.startswith(name + "{"):
                    head, _, value = line.rpartition(" ")
                    label = head.split("{", 1)[1].rstrip("}")
                    label = ",".join(x for x in label.split(",") if not x.startswith("model_name="))
                    out[f"{name}{{{label}}}"] = float(value)
        return out

    async def run(self) -> dict:
        import httpx

        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout, limits=limits) as client:
            await self._setup(client)
            metrics_before = await self._metrics(client)
        await asyncio.sleep(1.0)  # the set-up's connections closed on both sides
        before = proc_sample(self.pid)
        kinds = [k for k in WEIGHTS]
        weights = [WEIGHTS[k] for k in kinds]
        self.t0 = time.perf_counter()
        stop_at = self.t0 + self.duration
        stop = asyncio.Event()
        sampler = asyncio.create_task(self._sampler(stop))
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout, limits=limits) as client:

            async def worker(i: int) -> None:
                rng = random.Random(self.seed * 1000 + i + 1)
                while time.perf_counter() < stop_at and self.sent < self.max_requests:
                    self.sent += 1
                    kind = rng.choices(kinds, weights)[0]
                    self.records.append(await self.one(client, kind, rng))

            await asyncio.gather(*[worker(i) for i in range(self.concurrency)])
            t_load = time.perf_counter() - self.t0
        stop.set()
        await sampler
        # after the load: every client connection closed; the server idle; then the fds again
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            deadline = time.perf_counter() + 30
            while True:
                health = (await client.get("/health")).json()
                if (health.get("running"), health.get("waiting"), health.get("live")) == (0, 0, 0):
                    break
                if time.perf_counter() > deadline:
                    break
                await asyncio.sleep(0.2)
            metrics_after = await self._metrics(client)
        await asyncio.sleep(2.0)
        after = proc_sample(self.pid)
        return self.report(t_load, before, after, health, metrics_before, metrics_after)

    def report(self, t_load, before, after, health, metrics_before, metrics_after) -> dict:
        counts: dict = {}
        for r in self.records:
            name = r["kind"] + (f"/{r['sub']}" if r.get("sub") else "")
            counts.setdefault(r["kind"], {}).setdefault(str(r["status"]), 0)
            counts[r["kind"]][str(r["status"])] += 1
            counts.setdefault("_by_sub", {}).setdefault(name, {}).setdefault(str(r["status"]), 0)
            counts["_by_sub"][name][str(r["status"])] += 1
        by_sub = counts.pop("_by_sub", {})
        unexpected = [{k: r.get(k) for k in ("kind", "sub", "status", "detail", "request", "t_start")}
                      for r in self.records if not r["ok"] and not r.get("inexact")]
        inexact = [dict(r["inexact"], kind=r["kind"], t_start=r["t_start"]) for r in self.records if r.get("inexact")]
        greedy = [r for r in self.records if r.get("greedy")]
        flat = judge_flat(self.samples, 0.0, t_load, self.rss_tol, self.fd_tol)
        fd_end = {"before": before["fds"], "after": after["fds"], "drift": after["fds"] - before["fds"],
                  "tolerance": self.fd_tol, "ok": abs(after["fds"] - before["fds"]) <= self.fd_tol}
        idle = (health.get("running"), health.get("waiting"), health.get("live")) == (0, 0, 0)
        delta = {k: v - metrics_before.get(k, 0.0) for k, v in metrics_after.items()
                 if v - metrics_before.get(k, 0.0)}
        ok = (not unexpected and not inexact and flat.get("ok", False) and fd_end["ok"] and idle
              and not (self.library and self.library["differ"]))
        return {
            "url": self.url, "model": self.model, "max_model_len": self.max_len, "pid": self.pid, "seed": self.seed,
            "concurrency": self.concurrency, "duration_s": self.duration, "load_s": round(t_load, 2),
            "reference_s": round(self.reference_s, 2), "chat": self.chat, "chat_note": self.chat_note,
            "speculations": self.speculations, "weights": WEIGHTS, "requests": len(self.records),
            "counts": counts, "counts_by_sub": by_sub,
            "greedy": {"references": len(self.refs), "checked": len(greedy), "exact": sum(r["exact"] for r in greedy)},
            "unexpected_count": len(unexpected), "unexpected": unexpected[:100],
            "inexact_count": len(inexact), "inexact": inexact[:50],
            "library": self.library,
            "flat": flat, "fds_before_after": fd_end,
            "process": {"before": before, "after": after},
            "idle_at_end": idle, "health_at_end": health,
            "server_metrics_delta": delta,
            "requests_per_s": round(len(self.records) / t_load, 3) if t_load else None,
            "tokens": sum(r.get("tokens") or 0 for r in self.records),
            "samples": self.samples,
            "ok": ok,
        }


# ---------------------------------------------------------------------- report


def summary(rep: dict) -> str:
    lines = [f"{rep['requests']} requests in {rep['load_s']:.0f} s ({rep['requests_per_s']} req/s, {rep['tokens']} "
             f"tokens) against {rep['model']} at {rep['url']}, concurrency {rep['concurrency']}, seed {rep['seed']}"]
    for kind, by in rep["counts"].items():
        lines.append(f"  {kind:<15} " + ", ".join(f"{s}: {n}" for s, n in sorted(by.items())))
    g = rep["greedy"]
    lines.append(f"greedy: {g['exact']} of {g['checked']} exact ({g['references']} references)"
                 + (f"; library: {len(rep['library']['differ'])} of {rep['library']['checked']} references differ"
                    if rep["library"] else ""))
    lines.append(f"unexpected: {rep['unexpected_count']}, inexact: {rep['inexact_count']}")
    for u in rep["unexpected"][:10]:
        lines.append(f"  UNEXPECTED {u['kind']}/{u.get('sub')}: {u['status']} {u.get('detail')}")
    for u in rep["inexact"][:10]:
        lines.append(f"  INEXACT {u['kind']} {u['key']}: want {u['want']!r} got {u['got']!r}")
    f = rep["flat"]
    if "rss" in f:
        lines.append(f"second half ({f['window_s'][0]:.0f}-{f['window_s'][1]:.0f} s, {f['samples']} samples): RSS "
                     f"{f['rss']['min_bytes'] / 2**20:.1f}-{f['rss']['max_bytes'] / 2**20:.1f} MiB (spread "
                     f"{f['rss']['spread_pct']:.2f} %, tolerance {f['rss']['tolerance_pct']} %: "
                     f"{'flat' if f['rss']['ok'] else 'NOT FLAT'}); fds {f['fds']['min']}-{f['fds']['max']} "
                     f"(sockets {f['sockets']['min']}-{f['sockets']['max']}; others spread "
                     f"{f['fds_not_sockets']['spread']}, tolerance {f['fds_not_sockets']['tolerance']}: "
                     f"{'flat' if f['fds_not_sockets']['ok'] else 'NOT FLAT'})")
    else:
        lines.append(f"flat: not judged ({f.get('why')})")
    e = rep["fds_before_after"]
    lines.append(f"fds before the load {e['before']}, after it (connections closed) {e['after']}: "
                 f"{'within' if e['ok'] else 'OUTSIDE'} {e['tolerance']}; idle at the end: {rep['idle_at_end']}")
    lines.append("OK" if rep["ok"] else "NOT OK")
    return "\n".join(lines)


def draw(rep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = rep["samples"]
    t = [x["t"] for x in s]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True)
    f = rep["flat"]
    ax = axes[0]
    ax.plot(t, [x["rss_bytes"] / 2**20 for x in s], color="C0")
    ax.set_ylabel("RSS (MiB)")
    if "rss" in f:
        lo = f["rss"]["min_bytes"] / 2**20
        ax.axvspan(*f["window_s"], color="0.92", zorder=0)
        ax.axhline(lo * (1 + f["rss"]["tolerance_pct"] / 100), color="C3", ls=":", lw=1,
                   label=f"second half's min + {f['rss']['tolerance_pct']:g} %")
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title(f"RSS: second half spread {f['rss']['spread_pct']:.2f} % "
                     f"({'flat' if f['rss']['ok'] else 'NOT flat'})", fontsize=10)
    ax = axes[1]
    ax.plot(t, [x["fds"] for x in s], label="open fds", color="C1")
    ax.plot(t, [x["sockets"] for x in s], label="of them sockets", color="C2")
    ax.plot(t, [x["fds"] - x["sockets"] for x in s], label="others", color="C4")
    ax.set_ylabel("fds")
    ax.legend(fontsize=8, loc="center right")
    e = rep["fds_before_after"]
    ax.set_title(f"fds: before the load {e['before']}, after it {e['after']}", fontsize=10)
    ax = axes[2]
    rps, tps, tm = [], [], []
    every = max(1, len(s) // 60)  # ~60 points: a long run's 2 s samples are too noisy to read
    pts = s[::every]
    width = (pts[-1]["t"] - pts[0]["t"]) / max(1, len(pts) - 1)
    for a, b in itertools.pairwise(pts):
        dt = b["t"] - a["t"]
        if dt > width / 2:  # (not the last few seconds' drain)
            tm.append(b["t"])
            rps.append((b["done"] - a["done"]) / dt)
            tps.append((b["tokens"] - a["tokens"]) / dt)
    ax.plot(tm, rps, color="C0", label="requests/s")
    ax.set_ylabel("requests/s")
    ax2 = ax.twinx()
    ax2.plot(tm, tps, color="C5", alpha=0.7, label="tokens/s")
    ax2.set_ylabel("tokens/s")
    ax.set_xlabel("seconds into the load")
    ax.legend(fontsize=8, loc="upper left")
    ax2.legend(fontsize=8, loc="upper right")
    g = rep["greedy"]
    fig.suptitle(f"{rep['model']}: {rep['requests']} mixed requests in {rep['load_s']:.0f} s, concurrency "
                 f"{rep['concurrency']}; unexpected {rep['unexpected_count']}, greedy {g['exact']}/{g['checked']} "
                 "exact", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m graphs.serve.soak", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback, plain HTTP)")
    ap.add_argument("--duration", type=float, default=600, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    ap.add_argument("--seed", type=int, default=0, help="the mix, prompts and sampled settings")
    ap.add_argument("--pid", type=int, help="the server's process (default: the pid /health reports)")
    ap.add_argument("--export", help="also compare each greedy reference with graphs.load(EXPORT).generate")
    ap.add_argument("--greedy-prompts", type=int, default=16, help="completion prompts with a greedy reference")
    ap.add_argument("--chat-prompts", type=int, default=8, help="chats with a greedy reference")
    ap.add_argument("--max-tokens", type=int, default=48, help="most tokens of a greedy or sampled request")
    ap.add_argument("--sample-s", type=float, default=2.0, help="seconds between RSS/fd samples")
    ap.add_argument("--rss-tolerance", type=float, default=5.0, help="RSS spread allowed in the second half (%%)")
    ap.add_argument("--fd-tolerance", type=int, default=8, help="fd spread allowed (non-socket; and before/after)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per request at most")
    ap.add_argument("--max-requests", type=int, default=1_000_000, help="requests at most")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--png", help="draw RSS, fds and throughput over time here (matplotlib)")
    a = ap.parse_args(argv)
    soak = Soak(a.url, a.duration, a.concurrency, a.seed, a.pid, a.export, a.greedy_prompts, a.chat_prompts,
                a.max_tokens, a.sample_s, a.rss_tolerance, a.fd_tolerance, a.timeout, a.max_requests)
    rep = asyncio.run(soak.run())
    print(summary(rep))
    write_report(rep, a.json, a.png, draw, indent=1)
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
