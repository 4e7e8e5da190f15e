"""LayerProgress checks (prefill daemon): a frame fits the attached layout and the configured
bounds, or it is refused whole; a good one becomes one rendezvous event per chunk."""

from __future__ import annotations

import pytest

from kvpush import proto
from kvpush.daemon.core.checks import check_progress, progress_events
from kvpush.daemon.core.rendezvous import LayersReady, Rendezvous, StartGroupWrite
from kvpush_dev.daemon_harness import amx_layout
from tests.unit.test_rendezvous import reg

LAYOUT = amx_layout(num_blocks=64)[0]  # the harness engines' layout
BS, NL = LAYOUT.block_size, LAYOUT.num_layers


def chunk(**kw) -> proto.LayerChunk:
    base = dict(transfer_id="t", epoch=0, first_block=0, block_ids=(1, 2), first_token=0, num_tokens=2 * BS)
    base.update(kw)
    return proto.LayerChunk(**base)


def progress(*chunks, lo=0, hi=1, event=0) -> proto.LayerProgress:
    return proto.LayerProgress(lo, hi, tuple(chunks) or (chunk(),), event)


def test_a_binding_longer_than_the_configured_names_is_refused() -> None:
    assert "binding" in check_progress(LAYOUT, progress(chunk(bind_secret="x" * 10_000)), 8, 0)


def test_a_good_frame_passes_and_becomes_one_event_per_chunk() -> None:
    msg = progress(chunk(), chunk(transfer_id="u", first_block=2, block_ids=(5,), first_token=2 * BS,
                                  num_tokens=3 * BS, bind_node="d1", bind_secret="s"), lo=0, hi=NL)
    assert check_progress(LAYOUT, msg, 8, 0) == ""
    evs = progress_events(msg, 1.0, 30.0)
    assert evs == [LayersReady("t", 0, 0, NL, 0, (1, 2), 1.0, 31.0, ("", ""), 2 * BS),
                   LayersReady("u", 0, 0, NL, 2, (5,), 1.0, 31.0, ("d1", "s"), 3 * BS)]
    rv = Rendezvous()
    for ev in evs:
        rv.handle(ev)
    assert rv.info("t").state == "streamed" and rv.info("u").state == "streamed"


@pytest.mark.parametrize("msg, why", [
    (progress(lo=1, hi=1), "layers"),
    (progress(lo=0, hi=NL + 1), "layers"),
    (proto.LayerProgress(0, 1, (), 0), "chunks"),
    (progress(*[chunk()] * 9), "chunks"),
    (progress(event=1), "event"),
    (progress(chunk(transfer_id="")), "transfer_id"),
    (progress(chunk(block_ids=(1, 64))), "out of range"),
    (progress(chunk(block_ids=(1,))), "cannot hold"),
    (progress(chunk(first_block=1)), "first_block"),
    (progress(chunk(first_token=BS + 1, first_block=1, block_ids=(3,))), ""),  # completes a partial block
])
def test_bad_frames_are_refused_with_a_reason(msg, why) -> None:
    got = check_progress(LAYOUT, msg, 8, 0)
    assert (why in got and got) if why else got == ""


def test_progress_then_register_streams_in_one_write() -> None:
    """Groups ready before the registration go out together, once the stream's binding is
    known (every LayerChunk carries it); an event that knows no binding streams nothing: the
    seal's check decides where the KV goes."""
    import dataclasses

    evs = progress_events(progress(lo=0, hi=1), 0.0, 30.0) + progress_events(progress(lo=1, hi=2), 0.0, 30.0)
    rv = Rendezvous()
    for ev in evs:
        rv.handle(dataclasses.replace(ev, binding=None))
    assert not [a for a in rv.handle(reg()) if isinstance(a, StartGroupWrite)]
    rv = Rendezvous()
    for ev in evs:
        rv.handle(ev)
    out = rv.handle(reg())
    (g,) = [a for a in out if isinstance(a, StartGroupWrite)]
    assert [(p.layer_lo, p.layer_hi) for p in g.parts] == [(0, 1), (1, 2)]
