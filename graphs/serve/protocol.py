"""The OpenAI wire format: request bodies checked into engine arguments, responses and stream chunks.

No web framework here (the FastAPI app and the Ray deployment share it). A body is checked key by
key: a parameter the server does not implement is a 400 that names it (``n`` > 1, ``logprobs``,
tools, penalties, ...), an unknown key too, as OpenAI's own API answers "Unrecognized request
argument". Values the engine checks itself (temperature, top_p, a tree) come back from it as
:class:`graphs.errors.InputError`, also a 400.

    spec = parse_completion(body, limits)          # or parse_chat(body, limits, template)
    spec.prompt (text or token ids), spec.params (engine keywords), spec.stream, spec.include_usage

Extras beside OpenAI's fields, as vLLM accepts them in the body: ``top_k`` (-1 or 0: off),
``ignore_eos``, ``speculation`` ("on" | "off" | "adaptive"), ``tree`` (Medusa paths as a list, or
EAGLE ``{"topk", "depth", "total_tokens"}``; never a file name) and ``acceptance``.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import secrets
import time
from dataclasses import dataclass, field
from typing import ClassVar

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "deadline": "length", "cancelled": "abort"}
TEMPERATURE_EPS = 1e-5  # a temperature in (0, this) is greedy, as vLLM's _SAMPLING_EPS: logits / 1e-310
# overflow to inf, and no sampled distribution that sharp differs from the argmax anyway
MAX_SEED = 2**63 - 1  # OpenAI's seed is an int64
MAX_TOP_K = 2**31 - 1
MAX_DEPTH = 32  # JSON nesting a request may reach (a valid one needs 5)


class APIError(Exception):
    """An error answered in OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES: ClassVar[dict] = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


class HugeInt:
    """A JSON integer too long for Python to convert (over 4300 digits): no parameter accepts it."""

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")  # only a \u escape can put a surrogate in a str


def loads(raw: bytes):
    """The request body as JSON, or a 400 (not a 500) for anything unreadable: bad UTF-8 or JSON,
    nesting past the parser's recursion, integers too long to convert, strings holding a lone
    surrogate (which no UTF-8 tokenizer or response can encode), nesting deeper than MAX_DEPTH."""
    try:
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            raise
        except ValueError:  # "Exceeds the limit (4300 digits) for integer string conversion": read it again
            body = json.loads(raw, parse_int=lambda d: int(d) if len(d) <= 1000 else HugeInt(len(d.lstrip("-"))))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)", code="invalid_json") from None
    _check_tree(body, SURROGATE_ESCAPE.search(raw) is not None)
    return body


def _check_tree(body, strings: bool) -> None:
    """Depth, and (``strings``: the raw body has a surrogate escape) every key and string encodable."""
    stack = [(body, "", 1)]
    while stack:
        v, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad(f"the request body is nested too deeply at {path or 'the top'} (at most {MAX_DEPTH} levels)",
                      path or None, "invalid_json")
        if isinstance(v, dict):
            for k, x in v.items():
                where = f"{path}.{k}" if path else k
                if strings and not _encodable(k):
                    where = f"{path}.{json.dumps(k)}" if path else json.dumps(k)
                    raise bad(f"the key {json.dumps(k)} holds a lone surrogate (not valid Unicode text)", where,
                              "invalid_unicode")
                if isinstance(x, (dict, list)) or (strings and isinstance(x, str)):
                    stack.append((x, where, depth + 1))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                if isinstance(x, (dict, list)) or (strings and isinstance(x, str)):
                    stack.append((x, f"{path}[{i}]", depth + 1))
        elif isinstance(v, str) and not _encodable(v):
            raise bad(f"{path or 'the body'} holds a lone surrogate (\\ud800-\\udfff alone is not valid Unicode "
                      f"text); send UTF-8 text", path or None, "invalid_unicode")


def _encodable(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def show(v) -> str:
    """A client's value in an error message: short, whatever its size or depth."""
    return reprlib.repr(v)


@dataclass
class Limits:
    """What the server allows a request (its flags)."""

    model: str
    max_len: int  # positions per request: prompt + new tokens
    max_tokens: int | None = None  # ceiling of max_tokens (None: the room left in the context)
    max_stop: int = 16
    max_tree: int = 64  # nodes: a longer list of Medusa paths is refused before the engine's thread parses it
    max_messages: int = 1024  # chat messages, counted before any is read
    max_prompt_chars: int | None = None  # longer text cannot fit max_len tokens: refused before tokenizing


@dataclass
class Spec:
    """One checked request."""

    kind: str  # "completion" | "chat"
    prompt: object  # text or token ids
    params: dict  # engine.add_request keywords (GenerationParams names)
    max_tokens: int | None  # asked for (None: the room left, capped by the ceiling)
    stream: bool = False
    include_usage: bool = False
    add_special_tokens: bool = True  # chat: the template holds the specials
    max_tokens_param: str = "max_tokens"  # the key max_tokens came from (chat: max_completion_tokens too)
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self):
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{secrets.token_hex(12)}"


# Keys per endpoint: implemented, accepted only at their default (value -> is it the default?), ignored.
COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "top_k",
          "ignore_eos", "speculation", "tree", "acceptance"}
DEFAULT_ONLY = {
    "n": lambda v: v in (None, 1),
    "best_of": lambda v: v in (None, 1),
    "logprobs": lambda v: v in (None, False, 0),
    "top_logprobs": lambda v: v in (None, 0),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "logit_bias": lambda v: v in (None, {}),
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none"),
    "parallel_tool_calls": lambda v: v in (None, False, True),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "min_tokens": lambda v: v in (None, 0),
    "min_p": lambda v: v in (None, 0, 0.0),
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}
IGNORED = {"user", "metadata", "store", "service_tier"}  # bookkeeping fields that change no token
CHAT_ONLY = {"messages", "max_completion_tokens"}
COMPLETION_ONLY = {"prompt"}


def parse_completion(body, limits: Limits) -> Spec:
    body = _check_keys(body, COMMON | COMPLETION_ONLY)
    if "prompt" not in body:
        raise bad("prompt is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt is empty", "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt = [int(t) for t in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad(f"prompt: a batch of {len(prompt)} prompts is not supported; send one request per prompt",
                  "prompt")
    else:
        raise bad("prompt must be a non-empty string or a list of token ids", "prompt")
    max_tokens = _max_tokens(body, "max_tokens", limits)
    return _spec("completion", prompt, body, max_tokens, limits, add_special_tokens=True)


def parse_chat(body, limits: Limits) -> tuple[Spec, list[dict]]:
    """The spec (its prompt still to render) and the messages, checked."""
    body = _check_keys(body, COMMON | CHAT_ONLY)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > limits.max_messages:
        raise bad(f"messages holds {len(messages)} messages; this server takes at most {limits.max_messages}",
                  "messages", "too_many_messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"{where} must be an object with a string role", where)
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise bad(f"{where} has {', '.join(extra)}, not supported by this server (no tools)", f"{where}.{extra[0]}")
        if m["role"] == "tool":
            raise bad(f"{where}: tool messages are not supported by this server (no tools)", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only, joined as vLLM's "string" format does
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad(f"{where}.content[{j}] is {show(kind)}: only text content parts are supported",
                              f"{where}.content")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise bad("pass max_completion_tokens or max_tokens, not both", "max_tokens")
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _max_tokens(body, key, limits)
    spec = _spec("chat", None, body, max_tokens, limits, add_special_tokens=False)
    spec.max_tokens_param = key
    return spec, out


def _check_keys(body, allowed: set) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in allowed and k not in DEFAULT_ONLY and k not in IGNORED)
    if unknown:
        raise bad(f"Unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    unsupported = sorted(k for k, ok in DEFAULT_ONLY.items() if k in body and not ok(body[k]))
    if unsupported:
        shown = ", ".join(f"{k}={json.dumps(body[k], default=repr)[:40]}" for k in unsupported)
        raise bad(f"not implemented by this server: {shown}; leave them out (or at their default)", unsupported[0],
                  "unsupported_parameter")
    return body


def _spec(kind, prompt, body, max_tokens, limits: Limits, add_special_tokens: bool) -> Spec:
    model = body.get("model")
    if model is not None and model != limits.model:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{limits.model}`", "model",
                       "model_not_found")
    params: dict = {}
    if body.get("temperature") is not None:
        t = _number(body, "temperature", ">= 0 (0: greedy)", lambda x: x >= 0)
        params["temperature"] = 0.0 if t < TEMPERATURE_EPS else t
    if body.get("top_p") is not None:
        params["top_p"] = _number(body, "top_p", "in (0, 1]", lambda x: 0 < x <= 1)
    if body.get("top_k") is not None:
        k = body["top_k"]
        if not _is_int(k) or not -1 <= k <= MAX_TOP_K:
            raise bad(f"top_k must be an int in [-1, {MAX_TOP_K}] (-1 or 0: off), got {show(k)}", "top_k")
        params["top_k"] = max(int(k), 0)
    if body.get("seed") is not None:
        if not _is_int(body["seed"]) or not 0 <= body["seed"] <= MAX_SEED:
            raise bad(f"seed must be an int in [0, 2**63 - 1], got {show(body['seed'])}", "seed")
        params["seed"] = int(body["seed"])
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("stop must be a non-empty string or a list of them", "stop")
        if len(stops) > limits.max_stop:
            raise bad(f"stop holds {len(stops)} strings; at most {limits.max_stop}", "stop")
        if stops:
            params["stop"] = stops
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise bad("ignore_eos must be true or false", "ignore_eos")
        if body["ignore_eos"]:
            params["eos_token_id"] = []
    if body.get("speculation") is not None:
        if body["speculation"] not in ("on", "off", "adaptive"):
            raise bad(f"speculation must be \"on\", \"off\" or \"adaptive\", got {show(body['speculation'])}",
                      "speculation")
        params["speculation"] = body["speculation"]
    if body.get("tree") is not None:
        if not isinstance(body["tree"], (list, dict)):  # a string would be a file name on the server
            raise bad('tree must be Medusa paths (a list of lists) or an EAGLE {"topk", "depth", "total_tokens"}',
                      "tree")
        tree = body["tree"]
        if isinstance(tree, list) and (len(tree) > limits.max_tree or any(
                not isinstance(p, list) or len(p) > limits.max_tree for p in tree)):
            raise bad(f"tree: at most {limits.max_tree} Medusa paths of at most {limits.max_tree} ranks each", "tree")
        params["tree"] = tree
    if body.get("acceptance") is not None:
        if body["acceptance"] not in ("lossless", "typical"):
            raise bad(f"acceptance must be \"lossless\" or \"typical\", got {show(body['acceptance'])}", "acceptance")
        params["acceptance"] = body["acceptance"]
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise bad("stream_options must be {\"include_usage\": bool}", "stream_options")
        include_usage = bool(opts.get("include_usage"))
    return Spec(kind, prompt, params, max_tokens, stream=stream, include_usage=include_usage,
                add_special_tokens=add_special_tokens)


def _max_tokens(body, key: str, limits: Limits) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v) or v < 1:
        raise bad(f"{key} must be an int >= 1, got {show(v)}", key)
    if limits.max_tokens is not None and v > limits.max_tokens:
        raise bad(f"{key} {v} is over this server's ceiling of {limits.max_tokens}", key)
    return int(v)


def _number(body, key: str, what: str, ok) -> float:
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v) or not ok(v):
        raise bad(f"{key} must be a finite number {what}, got {show(v)}", key)
    return float(v)


def _finite(v) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past float's range
        return False


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------------- responses


def spec_stats(stats, speculation: str | None) -> dict:
    """That request's acceptance statistics (graphs.results.Stats), vLLM's counter names."""
    if stats is None:
        return {}
    return {"speculation": speculation, "num_drafts": stats.speculative_steps,
            "num_draft_tokens": stats.draft_tokens, "num_accepted_tokens": stats.accepted_drafts,
            "accepted_per_pos": list(stats.accepted_per_pos), "mean_accepted_length": stats.mean_accepted_length,
            "steps": stats.steps, "plain_steps": stats.plain_steps,
            "acceptance_rate": stats.accepted_drafts / stats.draft_tokens if stats.draft_tokens else 0.0}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(spec: Spec, model: str, text: str, finish: str, use: dict, stats: dict) -> dict:
    if spec.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return {"id": spec.id, "object": obj, "created": spec.created, "model": model, "choices": [choice],
            "usage": use, "spec_decode": stats}


def chunk(spec: Spec, model: str, text: str | None, finish: str | None = None, role: bool = False,
          use: dict | None = None, stats: dict | None = None, no_choice: bool = False) -> dict:
    """One stream chunk; ``no_choice``: the usage chunk (choices: [])."""
    if spec.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        obj = "chat.completion.chunk"
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
        obj = "text_completion"
    out = {"id": spec.id, "object": obj, "created": spec.created, "model": model,
           "choices": [] if no_choice else choices}
    if spec.include_usage:
        out["usage"] = use
    if stats is not None:
        out["spec_decode"] = stats
    return out


def sse(obj) -> bytes:
    data = obj if isinstance(obj, bytes) else json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    return b"data: " + data + b"\n\n"


DONE = b"data: [DONE]\n\n"
