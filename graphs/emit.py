"""A request's accepted tokens become its output: end tokens, stop strings, length, streamed text.

Pure functions of one :class:`graphs.requests.Request` (the engine finishes the request and frees its
row); what one request's text or stop strings raise is that request's own failure.
"""

from __future__ import annotations

from graphs.requests import Request
from graphs.results import RequestEvent


def append_tokens(req: Request, toks: list[int], limit: int, requests) -> list[int]:
    """Append accepted ``toks`` to ``req`` (at most ``limit`` new tokens in all), cut at an end token,
    a completed stop string or the length, setting ``req.done``; its text grows with them (``requests``:
    the tokenizer and ``decode`` of graphs.requests.RequestMaker). Returns the tokens appended."""
    toks = toks[: max(limit - len(req.tokens), 0)]
    for i, t in enumerate(toks):
        if t in req.eos:
            toks, req.done = toks[: i + 1], "eos"
            break
    stops = req.params.stop_strings
    if req.detok is not None and req.text_per_token:
        # text grows token by token (tokenizers' DecodeStream: O(new tokens)); a stop string keeps
        # the tokens up to the one that completes it
        longest = max(map(len, stops), default=0)
        for k, t in enumerate(toks):
            start = max(0, len(req.text) - longest)
            req.text += req.detok.step(requests.tokenizer, t) or ""  # None: a character still incomplete
            cut = find_stop(req.text, stops, start) if stops else None
            if cut is not None:
                toks, req.done, req.text = toks[: k + 1], "stop", req.text[:cut]
                break
    req.tokens.extend(toks)
    if not req.done and len(req.tokens) >= limit:
        req.done = "length"
    if req.done and req.done != "stop" and req.detok is not None:
        req.text = requests.decode(req.tokens)  # once at the end: a trailing partial character shows as U+FFFD
    return toks


def event(req: Request, toks: list[int]) -> RequestEvent | None:
    """What ``req`` says after appending ``toks`` (None: nothing). Streams text that can no longer
    change: the last characters that may begin a stop string wait until the request is done
    (DecodeStream already holds back partial characters)."""
    stops = req.params.stop_strings
    visible = req.text
    if not req.done and stops:
        visible = visible[: max(0, len(visible) - max(map(len, stops)) + 1)]
    new_text = ""
    if visible.startswith(req.streamed):  # (else decoding changed streamed text: nothing to add)
        new_text, req.streamed = visible[len(req.streamed):], visible
    if toks or new_text or req.done:
        return RequestEvent(req.id, toks, new_text, req.done, req.stats if req.done else None)
    return None


def find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Where the earliest stop string begins in ``text[start:]`` (an index into ``text``), or None."""
    hits = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
