"""The router's first-token splice (kvpush.router.first_token): the client's text is always the
decode leg's text, whatever the split of its stream; a decode leg that does not start with the
token sent early is a mismatch, and nothing of it reaches the client."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.common.machine import Row
from kvpush.proto.params import PROMPT_TRUNCATED
from kvpush.router.first_token import EVENTS, TABLE, Events, Splice, State, eligible, leg_bodies

HEAD = {"id": "cmpl-x", "created": 1, "model": "tiny"}
WORDS = st.lists(st.sampled_from([" a", " bb", "c", " 4817", "é", " x y", ""]), min_size=1, max_size=8)


def d_events(tokens: list[str], chat: bool, usage: bool = False) -> bytes:
    """A decode leg's stream in vLLM's shape: one event per token, the last one finishing."""
    evs = []
    if chat:
        evs.append({**HEAD, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    for i, t in enumerate(tokens):
        fin = "length" if i == len(tokens) - 1 else None
        c = ({"index": 0, "delta": {"content": t}, "finish_reason": fin} if chat
             else {"index": 0, "text": t, "finish_reason": fin, "stop_reason": None})
        evs.append({**HEAD, "object": "x", "choices": [c]})
    if usage:
        evs.append({**HEAD, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": len(tokens)}})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in evs) + b"data: [DONE]\n\n"


def answer(text: str, chat: bool) -> dict[str, Any]:
    if chat:
        return {**HEAD, "choices": [{"message": {"role": "assistant", "content": text}, "logprobs": None,
                                     "token_ids": [7]}], "prompt_token_ids": [1, 2, 3]}
    return {**HEAD, "choices": [{"text": text, "logprobs": None, "token_ids": [7], "prompt_token_ids": [1, 2, 3]}]}


def client_text(out: bytes, chat: bool) -> tuple[str, bool]:
    """The text a client reads from the spliced stream, and whether it ended with [DONE]."""
    text, done = "", False
    for ev in out.split(b"\n\n"):
        if not ev:
            continue
        data = ev[len(b"data: "):]
        if data == b"[DONE]":
            done = True
            continue
        obj = json.loads(data)
        for c in obj["choices"]:
            text += (c["delta"].get("content") or "") if chat else c["text"]
    return text, done


def cuts(data: bytes, points: list[int]) -> list[bytes]:
    ps = sorted({min(p, len(data)) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in zip(ps, ps[1:], strict=False) if b > a]


@settings(max_examples=300, deadline=None)
@given(tokens=WORDS, chat=st.booleans(), points=st.lists(st.integers(0, 2000), max_size=12),
       p_first=st.booleans())
def test_the_client_reads_the_decode_legs_text_whatever_the_split(tokens: list[str], chat: bool,
                                                                  points: list[int], p_first: bool) -> None:
    sp = Splice(chat)
    out = b""
    pieces = cuts(d_events(tokens, chat), points)
    if p_first:
        out += b"".join(sp.prefill(answer(tokens[0], chat)))
    for piece in pieces:
        out += b"".join(sp.decode(piece))
    if not p_first:  # the decode leg spoke first: the prefill answer changes nothing
        assert sp.prefill(answer(tokens[0], chat)) == []
    assert sp.state == "passing"
    assert client_text(out, chat) == ("".join(tokens), True)
    if p_first and tokens[0]:
        assert sp.sent == tokens[0]
    if not p_first:
        assert out == b"".join(pieces)  # untouched


@settings(max_examples=200, deadline=None)
@given(tokens=WORDS, chat=st.booleans(), points=st.lists(st.integers(0, 2000), max_size=12))
def test_events_are_the_streams_events_whatever_the_split(tokens: list[str], chat: bool, points: list[int]) -> None:
    """The one SSE framer (the splice's and the recovery's): every whole event once, in order,
    each as it was sent; a partial one is held until it is whole."""
    body = d_events(tokens, chat)
    ev = Events()
    got = [e for piece in cuts(body, points) for e in ev.feed(piece)]
    assert got == [e + b"\n\n" for e in body.split(b"\n\n")[:-1]] and ev.pending == b""
    half = Events()
    assert half.feed(body[:7]) == [] and half.take() == body[:7] and half.pending == b""


@settings(max_examples=200, deadline=None)
@given(tokens=WORDS, chat=st.booleans(), points=st.lists(st.integers(0, 2000), max_size=12),
       wrong=st.sampled_from([" zz", "q", " 4818"]))
def test_a_decode_leg_that_does_not_start_with_the_sent_token_is_a_mismatch(
        tokens: list[str], chat: bool, points: list[int], wrong: str) -> None:
    if "".join(tokens).startswith(wrong):
        return
    sp = Splice(chat)
    early = b"".join(sp.prefill(answer(wrong, chat)))
    out = b""
    for piece in cuts(d_events(tokens, chat), points):
        out += b"".join(sp.decode(piece))
    assert sp.state == "mismatch"
    assert client_text(early + out, chat)[0] == wrong  # nothing of the decode leg went out


def test_what_takes_the_early_path() -> None:
    base = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 8}
    assert eligible("/v1/completions", base)
    assert eligible("/v1/chat/completions", {**base, "messages": [], "stream_options": {"include_usage": True}})
    assert not eligible("/v1/completions", {**base, "stream": False})
    assert not eligible("/v1/completions", {**base, "stop": ["x"]})
    assert not eligible("/v1/completions", {**base, "logprobs": 2})
    assert not eligible("/v1/completions", {**base, "n": 2})
    assert not eligible("/v1/completions", {**base, "max_tokens": 0})
    assert not eligible("/v1/embeddings", base)


def test_a_sampled_request_without_a_seed_gets_one_for_both_legs() -> None:
    p: dict[str, Any] = {}
    d: dict[str, Any] = {}
    leg_bodies({"temperature": 0.7}, p, d)
    assert p["return_token_ids"] and p["seed"] == d["seed"]
    p, d = {}, {}
    leg_bodies({"temperature": 0.0}, p, d)
    assert "seed" not in p and "seed" not in d
    p, d = {}, {}
    leg_bodies({"seed": 3}, p, d)
    assert "seed" not in p and "seed" not in d  # the client's own seed goes to both legs as it is


def test_prefill_text_that_is_not_plain_leaves_the_first_token_to_the_decode_leg() -> None:
    for text in ("a\ufffd", "\ufffd"):  # not a text vLLM's stream shows: it holds such text back
        sp = Splice(False)
        assert sp.prefill(answer(text, False)) == [] and sp.state == "passing" and not sp.early
    sp = Splice(False)
    assert sp.prefill({**answer("x", False), "choices": [{"text": "x", "logprobs": None}]}) == []  # no IDs
    sp = Splice(True)
    a = answer("x", True)
    a["choices"][0]["message"]["tool_calls"] = [{"id": "t"}]
    assert sp.prefill(a) == [] and sp.state == "passing"


@pytest.mark.parametrize("chat", [False, True])
def test_a_prefill_leg_that_dropped_the_prompts_last_token_leaves_the_first_token_to_the_decode_leg(
        chat: bool) -> None:
    """A model with state groups (Mamba, linear attention): the prefill leg computed all but the
    prompt's last token, so its one token predicts the prompt's last token, not the answer's
    first. Its answer says so; the client's stream is the decode leg's, from its first token."""
    a = {**answer(" wrong", chat), "kv_transfer_params": {PROMPT_TRUNCATED: True, "transfer_id": "t"}}
    sp = Splice(chat)
    assert sp.prefill(a) == [] and sp.state == "passing" and not sp.early
    out = b"".join(sp.decode(d_events([" right", " on"], chat)))
    assert client_text(out, chat) == (" right on", True)
    # the same answer without the mark: its token goes out early, as for any other model
    sp = Splice(chat)
    plain = {**answer(" right", chat), "kv_transfer_params": {"transfer_id": "t"}}
    assert sp.prefill(plain) != [] and sp.early


def test_recovery_continues_after_the_sent_token_and_counts_it_in_usage() -> None:
    sp = Splice(True)
    sp.prefill({**answer("x", True), "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    rb = sp.recovery({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4,
                      "stream": True, "temperature": 0.0})
    assert rb["prompt"] == [1, 2, 3, 7] and rb["max_tokens"] == 3 and "messages" not in rb
    ev = sp.recovered({"id": "cmpl-r", "choices": [{"text": " y", "finish_reason": None}]}, True)
    assert ev is not None
    obj = json.loads(ev[6:])
    assert obj["id"] == "cmpl-x" and obj["choices"][0]["delta"] == {"content": " y"}
    ev = sp.recovered({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}, True)
    assert ev is not None and json.loads(ev[6:])["usage"] == {"prompt_tokens": 3, "completion_tokens": 4}
    assert sp.recovered({"choices": [], "usage": {}}, False) is None
    text, done = client_text(sp.finished(False), True)
    assert text == "" and done


@settings(max_examples=200, deadline=None)
@given(tokens=WORDS, chat=st.booleans(), points=st.lists(st.integers(0, 2000), max_size=12))
def test_a_first_token_inside_a_character_goes_out_early_as_the_engine_streams_it(
        tokens: list[str], chat: bool, points: list[int]) -> None:
    """The first token ends inside a UTF-8 character: vLLM's detokenizer gives it no text, in
    the prefill leg's answer and in the decode stream alike. The router sends that empty chunk
    early; the client's text is still the decode leg's, whatever the split and whatever the
    decode leg's first token turned out to be."""
    stream = ["", *tokens]  # the decode leg's first token: no text yet
    sp = Splice(chat)
    early = b"".join(sp.prefill(answer("", chat)))
    assert early and client_text(early, chat) == ("", False) and sp.state == "splicing" and sp.early
    out = b"".join(b"".join(sp.decode(piece)) for piece in cuts(d_events(stream, chat), points))
    assert sp.state == "passing" and client_text(early + out, chat) == ("".join(tokens), True)
    # nothing went out by ID: a recovery recomputes the token from the prompt alone
    assert sp.recovery({"prompt": "p", "max_tokens": 5})["prompt"] == [1, 2, 3] and sp.recovery(
        {"prompt": "p", "max_tokens": 5})["max_tokens"] == 5
    # a decode leg whose first token had text (the engines drew differently) still reaches the
    # client whole
    sp = Splice(chat)
    early = b"".join(sp.prefill(answer("", chat)))
    out = b"".join(b"".join(sp.decode(piece)) for piece in cuts(d_events(tokens, chat), points))
    assert client_text(early + out, chat) == ("".join(tokens), True)


def test_a_first_token_after_bytes_the_prompt_left_open_goes_out_with_its_replacement_character() -> None:
    """A prompt that ends inside a character: vLLM gives up on those bytes, and the first
    token's text starts with U+FFFD in both legs. It goes out early and is checked as any text."""
    text = "\ufffd106"
    sp = Splice(False)
    early = b"".join(sp.prefill(answer(text, False)))
    assert client_text(early, False) == (text, False)
    out = b"".join(sp.decode(d_events([text, " 7"], False)))
    assert client_text(early + out, False) == (text + " 7", True)
    sp = Splice(False)
    sp.prefill(answer(text, False))
    assert sp.decode(d_events(["106", " 7"], False)) == [] and sp.state == "mismatch"
    assert sp.recovery({"prompt": "p", "max_tokens": 5})["prompt"] == [1, 2, 3, 7]


# ---------------------------------------------------------------- the splice's table


def test_the_splice_table_is_total_and_closed_over_its_states() -> None:
    for s in State:
        for e in EVENTS:
            assert TABLE.rows_for(s, e)
    assert all(r.to is not None for r in TABLE.rows)


_ODD = {  # decode events the splice must not take for the text it sent (or must pass as they are)
    "done": b"data: [DONE]\n\n",
    "garbled": b"data: {not json\n\n",
    "error": b'data: {"error": {"message": "boom"}}\n\n',
    "usage": b'data: {"id": "cmpl-x", "choices": [], "usage": {"prompt_tokens": 5}}\n\n',
    "not_an_object": b'data: {"id": "cmpl-x", "choices": [7]}\n\n',
    "tool_call": b'data: {"id": "cmpl-x", "choices": [{"index": 0, "delta": {"tool_calls": [{}]}}]}\n\n',
}


def _splice_run(rng: random.Random, taken: set[Row]) -> None:
    """One request: a prefill answer (its text the decode leg's first token, more or less of
    it, another, none, or one the stream would not show), a decode body (now and then an odd
    event first) cut at random, fed in random order; the state after every call is the row's."""
    tokens = [rng.choice([" a", " bb", "c", " 4817", "é", ""]) for _ in range(rng.randint(1, 5))]
    chat = rng.random() < 0.5
    first = tokens[0]
    text = rng.choice([first, first, first + (tokens[1] if len(tokens) > 1 else ""), first[:1], " zz", "",
                       "a\ufffd"])
    body = d_events(tokens, chat, usage=rng.random() < 0.3)
    if rng.random() < 0.3:
        body = rng.choice(list(_ODD.values())) + body
    pieces = cuts(body, [rng.randrange(len(body) + 1) for _ in range(rng.randint(0, 6))])
    sp = Splice(chat)
    was = [sp.state]

    def saw(r: Row) -> None:
        assert not r.unreachable, f"{r} taken"
        assert r.state is was[0] and r.to is sp.state, r  # the row of the state it was in, and its state
        was[0] = sp.state
        taken.add(r)

    sp.on_row = saw
    at = rng.randint(0, len(pieces))  # the prefill leg answers before piece ``at``
    for i, piece in enumerate([*pieces, None]):
        if i == at or (rng.random() < 0.1 and i > at):  # now and then a second answer
            sp.prefill(answer(text, chat))
        if piece is not None:
            sp.decode(piece)
        assert isinstance(sp.state, State)
    if sp.state is State.PASSING:
        assert sp._events.pending == b""  # nothing held back once passing


def test_every_splice_row_is_taken_or_documented_unreachable_and_never_taken() -> None:
    taken: set[Row] = set()
    rng = random.Random(5)
    for _ in range(3000):
        _splice_run(rng, taken)
    missing = [str(r) for r in TABLE.rows if r not in taken and not r.unreachable]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("r", [r for r in TABLE.rows if r.unreachable], ids=str)
def test_unreachable_splice_rows_keep_the_state(r: Row) -> None:
    """Were one ever taken, the splice stays where it was (and sends nothing it was not sent)."""
    assert r.to is r.state
