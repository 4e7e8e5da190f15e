"""The bf16 judge of the demo and the models tests: a P/D answer may part from colocated only
where colocated's top two tokens are within NEAR_TIE nats and it took the runner-up."""

from __future__ import annotations

from kvpush_dev.demo_report import NEAR_TIE, near_tie


def _ref(tokens: list[str], tops: list[dict[str, float]]) -> dict:
    return {"text": "".join(tokens), "logprobs": {
        "tokens": tokens, "token_logprobs": [t[tok] for t, tok in zip(tops, tokens, strict=True)],
        "top_logprobs": tops}}


REF = _ref([" a", " b", " c"], [{" a": -0.1, " x": -3.0}, {" b": -0.70, " y": -0.72}, {" c": -0.2, " z": -2.0}])


def test_equal_and_near_tie_pass() -> None:
    assert near_tie(" a b c", REF) == "equal"
    why = near_tie(" a y q", REF)
    assert why is not None and "token 1" in why


def test_far_from_a_tie_or_another_token_fails() -> None:
    assert near_tie(" x b c", REF) is None  # 2.9 nats apart at token 0
    assert near_tie(" a q c", REF) is None  # not the runner-up
    assert near_tie(" a b z", REF) is None  # 1.8 nats
    wide = _ref([" a"], [{" a": -0.1, " x": -0.1 - 2 * NEAR_TIE}])
    assert near_tie(" x", wide) is None
