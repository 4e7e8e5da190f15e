"""The first token from the prefill leg: what the client's stream starts with, and how the
decode leg's stream is spliced behind it. Pure: no I/O, events in, bytes out.

Why: the prefill engine samples the request's first token anyway (its leg has
``max_tokens: 1``), and the decode engine recomputes it from the pushed KV (vLLM's P/D
recomputes the last prompt token to get logits) and only then streams. That recompute, one
forward of the decode engine plus its step boundary, is on the time to first token of every
P/D request. Sending the prefill leg's token to the client as soon as the leg answers takes it
off (DistServe and Splitwise hand out the prefill machine's first token the same way).

The invariant: **the client's text is the decode engine's text.** The prefill leg's token only
lets the router send the decode stream's first characters early; every decode event is then
checked against what was sent and stripped of it. Where the decode text does not start with
the prefill leg's text (a near-tie that the two engines' numerics broke differently, a sampler
that drew differently), the splice reports a mismatch and the router continues the client's
stream from what it was sent (``Splice.recovery``), never from the decode leg's own token.

Only plain text generation takes this path (``eligible``): one choice, no logprobs, no stop
strings, no tools or structured output; a sampled request without a seed gets one seed drawn by
the router for both legs, so both draw the same first token.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

__all__ = ["PATHS", "Splice", "eligible", "event_data", "leg_bodies"]

PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat?
# Request keys whose every value keeps the first token a plain sample both engines agree on.
# Anything else (stop strings, logprobs, n, tools, response_format, echo, ...) takes the
# decode engine's first token, as without this feature.
SAFE_KEYS = frozenset({
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "seed", "stream", "stream_options", "ignore_eos", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "user", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "add_generation_prompt", "chat_template_kwargs",
    "add_special_tokens", "priority",
})
# vLLM's detokenizer holds back text that ends inside a UTF-8 character (its streamed text for
# such a token is ""), and shows the replacement character for bytes it gave up on (after a
# prompt that ended inside a character, the first token's text even repeats the prompt's). Both
# legs run the same detokenizer over the same token IDs, so the prefill leg's text for the
# first token is the decode stream's text for it, either way.
REPLACEMENT = "\ufffd"


def eligible(path: str, body: dict[str, Any]) -> bool:
    """Whether a request's first token may come from its prefill leg."""
    if path not in PATHS or body.get("stream") is not True or not set(body) <= SAFE_KEYS:
        return False
    for k in ("max_tokens", "max_completion_tokens"):
        v = body.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            return False  # the engines answer it (400): nothing to send early
    so = body.get("stream_options")
    return so is None or (isinstance(so, dict) and set(so) <= {"include_usage", "continuous_usage_stats"}
                          and not so.get("continuous_usage_stats"))


def leg_bodies(body: dict[str, Any], p_body: dict[str, Any], d_body: dict[str, Any]) -> None:
    """Shape both legs for an eligible request: the prefill leg answers with its token IDs (the
    recovery needs them), and a sampled request without a seed gets one for both legs."""
    p_body["return_token_ids"] = True
    temp = body.get("temperature")
    sampled = temp is None or (isinstance(temp, int | float) and temp > 0)
    if sampled and body.get("seed") is None:
        seed = secrets.randbits(31)
        p_body["seed"] = d_body["seed"] = seed


def event_data(ev: bytes) -> bytes:
    """The payload of one server-sent event (its ``data:`` lines joined)."""
    return b"".join(line[5:].lstrip() for line in ev.split(b"\n") if line.startswith(b"data:"))


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class Events:
    """A server-sent-event body that arrives in pieces: ``feed`` returns the whole events (each
    with its blank line) and keeps a partial one for the next piece."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, raw: bytes) -> list[bytes]:
        *whole, self.pending = (self.pending + raw).split(b"\n\n")
        return [ev + b"\n\n" for ev in whole]

    def take(self) -> bytes:
        """The partial event held back, handed over as it is."""
        rest, self.pending = self.pending, b""
        return rest


class Splice:
    """One streamed request's splice: ``prefill(answer)`` when the prefill leg answers,
    ``decode(raw)`` for each piece of the decode leg's body; both return the bytes to send the
    client now. States: waiting (nothing sent yet), splicing (the prefill text is out, decode
    events are checked against it), passing (everything after it goes through untouched),
    mismatch (stop forwarding the decode leg: ``recovery`` says how to go on)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.state = "waiting"
        self.expect = ""  # the prefill text the decode stream has not yet shown
        self.sent = ""  # the prefill leg's text, sent early
        self.early = False  # the prefill leg's chunk went out (its text may be "": see prefill)
        self.token_ids: list[int] = []
        self.prompt_ids: list[int] = []
        self.head: dict[str, Any] = {}  # id, created, model of the stream
        self.usage: dict[str, Any] = {}  # the prefill leg's (prompt tokens, one completion token)
        self._events = Events()

    # ---------------------------------------------------------------- prefill leg
    def prefill(self, answer: Any) -> list[bytes]:
        if self.state != "waiting":
            return []
        text, ids, prompt_ids = _first(answer, self.chat)
        if not ids or text.endswith(REPLACEMENT):  # not a text the stream would show: left to it
            self.state = "passing"
            return []
        if not text:
            # The token ends inside a character: the engine's own stream sends an empty chunk for
            # it, and so does the router, early. No text went out, so a recovery does not continue
            # after it by ID (the character's remaining bytes would decode alone): it recomputes it.
            ids = []
        self.sent = self.expect = text
        self.token_ids, self.prompt_ids = ids, prompt_ids
        self.head = {"id": answer.get("id"), "created": answer.get("created"), "model": answer.get("model")}
        self.usage = answer["usage"] if isinstance(answer.get("usage"), dict) else {}
        self.state, self.early = "splicing", True
        if not self.chat:
            return [_event({**self.head, "object": "text_completion", "choices": [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}]})]
        chunk = {**self.head, "object": "chat.completion.chunk"}
        return [_event({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]}),
                _event({**chunk, "choices": [{"index": 0, "delta": {"content": text},
                                              "logprobs": None, "finish_reason": None}]})]

    # ---------------------------------------------------------------- decode leg
    def decode(self, raw: bytes) -> list[bytes]:
        if self.state == "mismatch":
            return []
        if self.state == "waiting":
            self.state = "passing"  # the decode leg spoke first: it streams as without the feature
        if self.state == "passing" and not self._events.pending:
            return [raw]
        out: list[bytes] = []
        for ev in self._events.feed(raw):
            if self.state == "splicing":
                out.extend(self._event(ev))
            elif self.state == "passing":
                out.append(ev)  # checked up to here: the rest goes through untouched
            else:
                return out  # mismatch: nothing more from the decode leg
        if self.state == "passing" and self._events.pending:
            out.append(self._events.take())
        return out

    def _event(self, ev: bytes) -> list[bytes]:
        data = event_data(ev)
        if data == b"[DONE]":
            self.state = "mismatch"  # the decode stream ended short of the text already sent
            return []
        try:
            obj = json.loads(data)
        except ValueError:
            self.state = "mismatch"
            return []
        if not isinstance(obj, dict) or "error" in obj or not isinstance(obj.get("choices"), list):
            self.state = "passing"  # an engine's error event: the client sees it as it is
            return [ev]
        if not obj["choices"]:
            return [ev]  # usage
        choice = obj["choices"][0]
        if not isinstance(choice, dict):
            self.state = "mismatch"
            return []
        if self.chat:
            delta = choice.get("delta") or {}
            if any(v is not None for k, v in delta.items() if k not in ("role", "content")):
                self.state = "mismatch"  # reasoning or tool calls: not the plain text sent
                return []
            s = delta.get("content") or ""
        else:
            s = choice.get("text") or ""
        if self.expect.startswith(s):
            self.expect = self.expect[len(s):]
            if choice.get("finish_reason") is not None:
                if self.expect:
                    self.state = "mismatch"
                    return []
                self.state = "passing"
                return [self._with_text(obj, choice, "")]
            if not self.expect:
                self.state = "passing"
            return []
        if s.startswith(self.expect):
            rest, self.expect, self.state = s[len(self.expect):], "", "passing"
            return [self._with_text(obj, choice, rest)]
        self.state = "mismatch"
        return []

    def _with_text(self, obj: dict[str, Any], choice: dict[str, Any], text: str) -> bytes:
        if self.chat:
            delta = dict(choice.get("delta") or {})
            delta.pop("role", None)
            delta["content"] = text
            choice = {**choice, "delta": delta}
        else:
            choice = {**choice, "text": text}
        return _event({**obj, "choices": [choice, *obj["choices"][1:]]})

    # ---------------------------------------------------------------- mismatch
    def recovery(self, body: dict[str, Any]) -> dict[str, Any]:
        """The completion request that continues the client's stream after the text it was
        sent: the prompt's token IDs and the prefill leg's token, computed by the decode engine
        alone (no transfer), for the remaining tokens."""
        rb: dict[str, Any] = {k: v for k, v in body.items()
                              if k not in ("prompt", "messages", "max_completion_tokens", "stream_options",
                                           "add_generation_prompt", "chat_template_kwargs")}
        rb["prompt"] = [*self.prompt_ids, *self.token_ids]
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None:
            rb["max_tokens"] = limit - len(self.token_ids)
        if body.get("min_tokens"):
            rb["min_tokens"] = max(0, body["min_tokens"] - len(self.token_ids))
        rb["stream"] = True
        rb["stream_options"] = {"include_usage": True}
        rb["add_special_tokens"] = False  # the IDs are the prompt as the engine tokenized it
        return rb

    def finished(self, want_usage: bool) -> bytes:
        """The end of a stream whose first token was its whole answer (``max_tokens`` 1)."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}
        out = _event({**self.head, "object": _object(self.chat), "choices": [choice]})
        if want_usage and self.usage:
            out += _event({**self.head, "object": _object(self.chat), "choices": [], "usage": self.usage})
        return out + b"data: [DONE]\n\n"

    def recovered(self, obj: dict[str, Any], want_usage: bool) -> bytes | None:
        """A recovery stream event as the client's stream shows it (None: not shown)."""
        if "error" in obj or not isinstance(obj.get("choices"), list):
            return _event(obj)
        if not obj["choices"]:
            usage = obj.get("usage")
            if not want_usage or not isinstance(usage, dict):
                return None
            n = len(self.token_ids)
            usage = {**usage, "prompt_tokens": usage.get("prompt_tokens", n) - n,
                     "completion_tokens": usage.get("completion_tokens", 0) + n}
            return _event({**obj, **self.head, "object": _object(self.chat), "usage": usage})
        c = obj["choices"][0]
        fin = {"finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason")}
        if self.chat:
            choice = {"index": 0, "delta": {"content": c.get("text") or ""}, "logprobs": None, **fin}
        else:
            choice = {"index": 0, "text": c.get("text") or "", "logprobs": None, **fin}
        return _event({**self.head, "object": _object(self.chat), "choices": [choice]})


def _object(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"


def _first(answer: Any, chat: bool) -> tuple[str, list[int], list[int]]:
    """The prefill leg's text, its token IDs and the prompt's ("" when it is not plain text)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list) or not answer["choices"]:
        return "", [], []
    c = answer["choices"][0]
    if not isinstance(c, dict) or c.get("logprobs") is not None:
        return "", [], []
    if chat:
        msg = c.get("message") or {}
        if not isinstance(msg, dict) or any(msg.get(k) for k in ("tool_calls", "reasoning", "reasoning_content",
                                                                 "function_call", "refusal")):
            return "", [], []
        text = msg.get("content")
        prompt_ids = answer.get("prompt_token_ids")
    else:
        text = c.get("text")
        prompt_ids = c.get("prompt_token_ids")
    ids = c.get("token_ids")
    ok = (isinstance(text, str) and _int_list(ids) and _int_list(prompt_ids))
    return (text, list(ids), list(prompt_ids)) if ok else ("", [], [])  # type: ignore[arg-type]


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
