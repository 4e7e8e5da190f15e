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

A prefill leg of a model with state groups (Mamba, linear attention) computes all but the
prompt's last token (the decode engine derives the last state itself), so its one token is a
prediction one position early: its answer says so (``kv_transfer_params``,
``proto.params.PROMPT_TRUNCATED``) and the client's first token is the decode engine's.

Only plain text generation takes this path (``eligible``): one choice, no logprobs, no stop
strings, no tools or structured output; a sampled request without a seed gets one seed drawn by
the router for both legs, so both draw the same first token.
"""

from __future__ import annotations

import enum
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvpush.common.machine import Row, Single, Table, drive, row
from kvpush.proto.params import prompt_truncated

__all__ = ["PATHS", "TABLE", "Splice", "State", "eligible", "event_data", "leg_bodies"]

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


class State(enum.StrEnum):
    """Where one request's splice is (the values are what it was called before it was a table)."""

    WAITING = "waiting"  # nothing sent yet
    SPLICING = "splicing"  # the prefill leg's text is out; decode events are checked against it
    PASSING = "passing"  # everything from here on goes through untouched
    MISMATCH = "mismatch"  # stop forwarding the decode leg: ``Splice.recovery`` says how to go on


# ------------------------------------------------------------------ events


@dataclass(frozen=True, eq=False)
class Answered:
    """The prefill leg answered (its JSON, or None where it is not JSON)."""

    answer: Any
    chat: bool

    @cached_property
    def first(self) -> tuple[str, list[int], list[int]]:
        """Its text, its token IDs and the prompt's ("" when it is not plain text)."""
        return _first(self.answer, self.chat)


@dataclass(frozen=True)
class Piece:
    """A piece of the decode leg's body, as it arrived (any split)."""

    raw: bytes


class Kind(enum.Enum):
    """What one whole decode event is, for the splice."""

    END = "end"  # [DONE]
    GARBLED = "garbled"  # not JSON
    FOREIGN = "foreign"  # an engine's error, or not a completion chunk: the client sees it as it is
    USAGE = "usage"  # no choices (the usage chunk)
    ODD = "odd"  # a choice that is not plain text (reasoning, tool calls, not an object)
    TEXT = "text"


@dataclass(frozen=True, eq=False)
class Whole:
    """One whole event of the decode leg (framed out of its pieces while splicing)."""

    ev: bytes
    chat: bool

    @cached_property
    def view(self) -> tuple[Kind, str, bool, Any, Any]:
        """(kind, its text, whether it finishes, the event's object, its first choice)."""
        data = event_data(self.ev)
        if data == b"[DONE]":
            return Kind.END, "", False, None, None
        try:
            obj = json.loads(data)
        except ValueError:
            return Kind.GARBLED, "", False, None, None
        if not isinstance(obj, dict) or "error" in obj or not isinstance(obj.get("choices"), list):
            return Kind.FOREIGN, "", False, obj, None
        if not obj["choices"]:
            return Kind.USAGE, "", False, obj, None
        choice = obj["choices"][0]
        if not isinstance(choice, dict):
            return Kind.ODD, "", False, obj, choice
        if self.chat:
            delta = choice.get("delta") or {}
            if any(v is not None for k, v in delta.items() if k not in ("role", "content")):
                return Kind.ODD, "", False, obj, choice
            s = delta.get("content") or ""
        else:
            s = choice.get("text") or ""
        return Kind.TEXT, s, choice.get("finish_reason") is not None, obj, choice


@dataclass(frozen=True)
class Tail:
    """The end of one piece: what is left of it is a partial event."""


EVENTS = (Answered, Piece, Whole, Tail)

# ----------------------------------------------------------------- actions


@dataclass(frozen=True)
class Send:
    """Bytes for the client, now."""

    data: bytes


@dataclass(frozen=True)
class Framed:
    """A piece held these whole events (each is checked in turn: ``Whole``, then ``Tail``)."""

    events: tuple[bytes, ...]


# ----------------------------------------------------------------- guards


def not_plain(sp: Splice, _: Any, ev: Answered) -> bool:
    text, ids, _prompt = ev.first
    return not ids or text.endswith(REPLACEMENT)  # not a text the stream would show: left to it


def pending(sp: Splice, _: Any, ev: Any) -> bool:
    return bool(sp._events.pending)


def _kind(kind: Kind) -> Any:
    def guard(sp: Splice, _: Any, ev: Whole) -> bool:
        return ev.view[0] is kind

    guard.__name__ = kind.value
    return guard


ended, garbled, foreign, usage, odd = map(_kind, (Kind.END, Kind.GARBLED, Kind.FOREIGN, Kind.USAGE, Kind.ODD))


def _shown(sp: Splice, ev: Whole) -> bool:
    """Its text is (the start of) what is still expected."""
    return ev.view[0] is Kind.TEXT and sp.expect.startswith(ev.view[1])


def finishes_short(sp: Splice, _: Any, ev: Whole) -> bool:
    """It finishes the stream before the text sent early was shown."""
    return _shown(sp, ev) and ev.view[2] and len(ev.view[1]) < len(sp.expect)


def finishes(sp: Splice, _: Any, ev: Whole) -> bool:
    return _shown(sp, ev) and ev.view[2]


def shows_the_rest(sp: Splice, _: Any, ev: Whole) -> bool:
    return _shown(sp, ev) and len(ev.view[1]) == len(sp.expect)


def shows_part(sp: Splice, _: Any, ev: Whole) -> bool:
    return _shown(sp, ev)


def goes_beyond(sp: Splice, _: Any, ev: Whole) -> bool:
    """Its text is what was expected and more (the more is new to the client)."""
    return ev.view[0] is Kind.TEXT and ev.view[1].startswith(sp.expect)


# ------------------------------------------------------------------ steps


def send_early(sp: Splice, _: Any, ev: Answered, out: list[Any]) -> None:
    """The prefill leg's token goes out as the stream's first chunk(s)."""
    text, ids, prompt_ids = ev.first
    if not text:
        # The token ends inside a character: the engine's own stream sends an empty chunk for
        # it, and so does the router, early. No text went out, so a recovery does not continue
        # after it by ID (the character's remaining bytes would decode alone): it recomputes it.
        ids = []
    answer = ev.answer
    sp.sent = sp.expect = text
    sp.token_ids, sp.prompt_ids = ids, prompt_ids
    sp.head = {"id": answer.get("id"), "created": answer.get("created"), "model": answer.get("model")}
    sp.usage = answer["usage"] if isinstance(answer.get("usage"), dict) else {}
    sp.early = True
    if not sp.chat:
        out.append(Send(_event({**sp.head, "object": "text_completion", "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}]})))
        return
    chunk = {**sp.head, "object": "chat.completion.chunk"}
    out.append(Send(_event({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})))
    out.append(Send(_event({**chunk, "choices": [{"index": 0, "delta": {"content": text},
                                                  "logprobs": None, "finish_reason": None}]})))


def send_piece(sp: Splice, _: Any, ev: Piece, out: list[Any]) -> None:
    out.append(Send(ev.raw))


def send_held_and_piece(sp: Splice, _: Any, ev: Piece, out: list[Any]) -> None:
    out.append(Send(sp._events.take() + ev.raw))


def frame(sp: Splice, _: Any, ev: Piece, out: list[Any]) -> None:
    out.append(Framed(tuple(sp._events.feed(ev.raw))))


def send_event(sp: Splice, _: Any, ev: Whole, out: list[Any]) -> None:
    out.append(Send(ev.ev))


def send_held(sp: Splice, _: Any, ev: Tail, out: list[Any]) -> None:
    out.append(Send(sp._events.take()))


def consume_finish(sp: Splice, _: Any, ev: Whole, out: list[Any]) -> None:
    """The stream finishes exactly after the text sent: its last event, without that text."""
    sp.expect = ""
    out.append(Send(sp._with_text(ev.view[3], ev.view[4], "")))


def consume_shown(sp: Splice, _: Any, ev: Whole, out: list[Any]) -> None:
    """The event shows (part of) the text sent early: the client has it already."""
    sp.expect = sp.expect[len(ev.view[1]):]


def send_beyond(sp: Splice, _: Any, ev: Whole, out: list[Any]) -> None:
    """What the event shows past the text sent early."""
    rest, sp.expect = ev.view[1][len(sp.expect):], ""
    out.append(Send(sp._with_text(ev.view[3], ev.view[4], rest)))


# ------------------------------------------------------------------ the table

W, SP, PA, MM = State.WAITING, State.SPLICING, State.PASSING, State.MISMATCH
_PIECES_ONLY_WHILE_SPLICING = "Whole and Tail follow a piece framed while splicing, never before a piece"
_NOTHING_HELD_WHILE_PASSING = "a piece that leaves the splice passing sends what it held (Tail)"
_CHECKED = "the decode leg's events are checked against the text sent early, one by one"

TABLE = Table(State, EVENTS, [
    # The prefill leg's answer: the first token goes out early, unless the decode leg spoke first.
    row(W, Answered, not_plain, PA),
    row(W, Answered, None, SP, send_early),
    *[row(s, Answered, None, s) for s in (SP, PA, MM)],  # too late, or answered again: nothing
    # A piece of the decode leg's body.
    row(W, Piece, None, PA, send_piece),  # the decode leg spoke first: it streams as without the feature
    row(PA, Piece, pending, PA, send_held_and_piece, unreachable=_NOTHING_HELD_WHILE_PASSING),
    row(PA, Piece, None, PA, send_piece),
    row(SP, Piece, None, SP, frame),
    row(MM, Piece, None, MM),  # nothing more from the decode leg
    # One whole decode event while splicing (_CHECKED), then what it leaves.
    row(SP, Whole, ended, MM),  # the decode stream ended short of the text already sent
    row(SP, Whole, garbled, MM),
    row(SP, Whole, foreign, PA, send_event),  # an engine's error event: the client sees it as it is
    row(SP, Whole, usage, SP, send_event),
    row(SP, Whole, odd, MM),  # reasoning or tool calls: not the plain text sent
    row(SP, Whole, finishes_short, MM),
    row(SP, Whole, finishes, PA, consume_finish),
    row(SP, Whole, shows_the_rest, PA, consume_shown),
    row(SP, Whole, shows_part, SP, consume_shown),
    row(SP, Whole, goes_beyond, PA, send_beyond),
    row(SP, Whole, None, MM),  # another text than the one sent: never the decode leg's own token
    row(PA, Whole, None, PA, send_event),  # checked up to here: the rest goes through untouched
    row(MM, Whole, None, MM),
    row(W, Whole, None, W, unreachable=_PIECES_ONLY_WHILE_SPLICING),
    row(PA, Tail, pending, PA, send_held),
    row(PA, Tail, None, PA),
    row(SP, Tail, None, SP),  # a partial event waits for the next piece
    row(MM, Tail, None, MM),
    row(W, Tail, None, W, unreachable=_PIECES_ONLY_WHILE_SPLICING),
], keyed=False)  # fmt: skip
"""Every transition of a splice (the table is the spec; tests/unit/test_router_first_token.py)."""
del W, SP, PA, MM


class Splice:
    """One streamed request's splice: ``prefill(answer)`` when the prefill leg answers,
    ``decode(raw)`` for each piece of the decode leg's body; both return the bytes to send the
    client now. Its :class:`State` moves only by :data:`TABLE` (driven by
    :func:`kvpush.common.machine.drive`: a piece framed while splicing is checked event by
    event, each in the state the one before it left)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.state = State.WAITING
        self.expect = ""  # the prefill text the decode stream has not yet shown
        self.sent = ""  # the prefill leg's text, sent early
        self.early = False  # the prefill leg's chunk went out (its text may be "": see send_early)
        self.token_ids: list[int] = []
        self.prompt_ids: list[int] = []
        self.head: dict[str, Any] = {}  # id, created, model of the stream
        self.usage: dict[str, Any] = {}  # the prefill leg's (prompt tokens, one completion token)
        self._events = Events()
        self._machine = Single(TABLE, self, self)
        #: Called with every row taken (tests count them).
        self.on_row: Callable[[Row], None] | None = None

    def prefill(self, answer: Any) -> list[bytes]:
        return self._take(Answered(answer, self.chat))

    def decode(self, raw: bytes) -> list[bytes]:
        return self._take(Piece(raw))

    def _take(self, ev: Any) -> list[bytes]:
        out: list[bytes] = []

        def carry_out(act: Any) -> Any:
            if isinstance(act, Send):
                out.append(act.data)
                return None
            return [*(Whole(e, self.chat) for e in act.events), Tail()]  # Framed

        self._machine.on_row = self.on_row
        drive(self._machine, ev, carry_out)
        return out

    def _with_text(self, obj: dict[str, Any], choice: dict[str, Any], text: str) -> bytes:
        """A decode event as the client sees it: its first choice's text replaced by ``text``."""
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
    if prompt_truncated(answer.get("kv_transfer_params")):
        return "", [], []  # the leg computed all but the prompt's last token (state groups): its token is not ours
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
