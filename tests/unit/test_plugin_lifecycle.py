"""The plugin's two lifecycle tables, driven together the way vLLM and the daemon drive them.

A model of vLLM's scheduler loop (requests arrive, are matched and allocated, run forwards,
finish, are aborted or preempted at any point) feeds the scheduler half's core; its actions
become the step's metadata, which feeds the worker half's core; the worker's publishes go
to a model daemon that answers them (or not: it may go down, restart with a new ID, refuse a
publish, or stay silent past the load deadline), and the worker's finished sets go back to
the scheduler core as vLLM would hand them over. Checked:

* every row of each table is taken by some sequence, or documented unreachable and never taken;
* vLLM's contract: a request whose blocks were held is reported free exactly once, a load is
  reported ended exactly once, and never for a request that was not waiting for it;
* nothing is left for a finished request: once vLLM has finished every request and the daemon
  has answered (or been lost), no live record remains in either core, and once tombstone time
  passed every collection either core keeps is empty;
* layer-wise streaming (``stream_min_tokens``: off, on, or a threshold): every chunk a step
  names is a live, running, streamed prefill request's, computed by that step's forward, with
  exactly the blocks the request holds now (block IDs are recycled between requests, so a
  stale list would name another request's blocks), in the request's current epoch (one more
  after each preemption that voided streamed progress).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush import proto
from kvpush.common.machine import Row
from kvpush.engine_plugin.scheduler import lifecycle as sl
from kvpush.engine_plugin.worker import lifecycle as wl
from kvpush.proto.params import DecodeLeg, PrefillLeg

BLOCK = 16
EPS = ("tcp://10.0.0.1:17500",)
# The scheduler core's actions that are the worker core's own events: the step's metadata.
FOR_WORKER = (sl.Register, sl.Send, sl.AbortLoad, sl.SendAbort, sl.StreamAbort)


@dataclass
class Req:
    """One request as vLLM's scheduler sees it."""

    rid: str
    kind: str  # "decode", "prefill", "serial" (a serial proxy's prefill leg) or "plain"
    prompt: int
    max_tokens: int
    tid: str
    status: str = "waiting"  # waiting, remote (waiting for remote KV), running, finished
    computed: int = 0
    out_tokens: int = 0
    new: bool = True  # scheduled for the first time (SchedulerOutput.scheduled_new_reqs)
    started: bool = False
    blocks: tuple[int, ...] = ()
    new_blocks: tuple[int, ...] = ()  # allocated this step (CachedRequestData.new_block_ids)
    resumed: bool = False  # back from preemption (CachedRequestData.resumed_req_ids)
    epoch: int = 0  # restarts that voided streamed progress
    streamed: bool = False  # a chunk was named in this epoch
    held: bool = False  # request_finished answered True: blocks wait for finished_sending
    freed: int = 0  # times reported in finished_sending
    loads_ended: int = 0  # times reported in finished_recving

    def decode(self) -> DecodeLeg | None:
        return DecodeLeg(self.tid, ("tcp://p:1",), 1) if self.kind == "decode" else None

    def prefill(self) -> PrefillLeg | None:
        return {"prefill": PrefillLeg(self.tid), "serial": PrefillLeg(None)}.get(self.kind)


@dataclass
class Sim:
    rng: random.Random
    tombstone_s: float
    now: float = 0.0
    reqs: dict[str, Req] = field(default_factory=dict)
    daemon: list[Any] = field(default_factory=list)  # published, not answered yet
    down: bool = False
    seen: list[Any] = field(default_factory=list)  # recently published
    reuse_ids: bool = True  # a client may send a request ID again once vLLM forgot it
    late: set[int] = field(default_factory=set)  # aborts answered by a late result: Released owed
    cards: bool = True  # this engine's daemon cards are readable (serial legs need them)
    names: Any = field(default_factory=lambda: (f"kvps-{i}" for i in itertools.count()))
    ids: Any = field(default_factory=itertools.count)
    stream_min: int | None = None  # layerwise: None off, 0 on, else auto's threshold
    free: list[int] = field(default_factory=lambda: list(range(40)))  # vLLM's block pool (LIFO: reused soon)
    chunks: int = 0  # Stream actions checked
    stream_aborts: int = 0
    # What the daemon was last told of each prefill transfer, as the link took it: "pd" (a
    # PrefillDone, unanswered), "answered" (its Sent, SendFailed or Released came), "abort",
    # "refused" (the link refused it: nothing can be said). Checked when vLLM frees the blocks.
    told: dict[str, str] = field(default_factory=dict)
    send_tid: dict[str, str] = field(default_factory=dict)  # request -> its send's transfer
    gave_up: int = 0  # gave-up Aborts published

    def __post_init__(self) -> None:
        self.s = sl.SchedulerLifecycle(BLOCK, name_transfer=lambda: next(self.names), tombstone_s=self.tombstone_s,
                                       stream_min_tokens=self.stream_min)
        self.w = wl.WorkerLifecycle(timeout_ms=1000, lease_ms=1000)
        self.meta: list[Any] = []  # scheduler actions for this step's metadata
        self.fs: set[str] = set()  # worker's finished_sending, this step
        self.fr: set[str] = set()

    # -------------------------------------------------------------- the cores' I/O

    def sched(self, ev: Any) -> list[Any]:
        out = self.s.handle(ev)
        loading: dict[str, int] = {}  # n > 1: one request per transfer loads it, its siblings wait
        for k in self.s._recs:
            rec = self.s.record(k)
            if rec is not None and rec.state in (sl.State.CLAIMED, sl.State.LOADING):
                loading[rec.transfer_id] = loading.get(rec.transfer_id, 0) + 1
        assert all(n == 1 for n in loading.values()), loading
        self.meta += [a for a in out if type(a) in FOR_WORKER]
        return out

    def take(self, n: int) -> tuple[int, ...] | None:
        if n > len(self.free):
            return None
        got = tuple(self.free[len(self.free) - n:])
        del self.free[len(self.free) - n:]
        return got

    def give_back(self, r: Req) -> None:
        assert not set(r.blocks) & set(self.free), "a block freed twice"
        self.free += r.blocks
        r.blocks = ()

    def check_chunk(self, c: Any, scheduled: dict[str, int], before: dict[str, int]) -> None:
        """A streamed chunk names this step's tokens of a live request, its blocks now, its epoch."""
        rid = next(k for k, r in self.reqs.items() if r.status == "running" and self.s.record(k) is not None
                   and self.s.record(k).transfer_id == c.transfer_id)
        r = self.reqs[rid]
        assert self.stream_min is not None and r.prefill() is not None and r.prompt >= self.stream_min
        assert rid in scheduled and before[rid] < r.prompt, "streamed a step that computes no prompt token"
        start = before[rid]
        assert c.first_block == start // BLOCK and c.first_token == c.first_block * BLOCK
        assert c.num_tokens == min(start + scheduled[rid], r.prompt)
        assert tuple(c.block_ids) == r.blocks[c.first_block:-(-c.num_tokens // BLOCK)], (c, r.blocks)
        assert c.epoch == r.epoch, (c.epoch, r.epoch)
        r.streamed = True
        self.chunks += 1

    def work(self, ev: Any) -> None:
        if isinstance(ev, wl.Send):
            self.send_tid[ev.req_id] = ev.transfer_id
        elif isinstance(ev, (wl.SendDone, wl.Released)) and self.told.get(ev.transfer_id) == "pd":
            self.told[ev.transfer_id] = "answered"
        todo = self.w.handle(ev)
        freed: list[str] = []
        while todo:
            a = todo.pop(0)
            if isinstance(a, wl.Publish):
                said = {proto.PrefillDone: "pd", proto.Abort: "abort"}.get(type(a.msg))
                if a.key[0] == "gave_up":  # no rng drawn: the other rows' coverage stays as it was
                    assert isinstance(a.msg, proto.Abort)
                    self.gave_up += 1
                    self.told[a.msg.transfer_id] = "abort"
                elif self.rng.random() < 0.04:  # the link's queue is full
                    if a.key[0] == "send":
                        self.told[a.msg.transfer_id] = "refused"
                    todo += self.w.handle(wl.Unsent(a.key, self.now))
                elif a.key[0] != "stream":  # stream aborts: unanswered here (the model's IDs span roles)
                    self.daemon.append(a.msg)
                    if a.key[0] == "send" and said is not None:
                        self.told[a.msg.transfer_id] = said
            elif isinstance(a, wl.Free):
                assert a.req_id not in self.fs, f"{a.req_id} freed twice in one step"
                self.fs.add(a.req_id)
                freed.append(a.req_id)
            elif isinstance(a, wl.LoadEnded):
                assert a.req_id not in self.fr
                self.fr.add(a.req_id)
        for rid in freed:  # the daemon is never left holding a prefill the engine gave up
            r = self.reqs.get(rid)
            if r is not None and r.kind in ("prefill", "serial") and rid in self.send_tid:
                tid = self.send_tid[rid]
                assert self.told.get(tid) in ("answered", "abort", "refused"), (
                    f"{rid}'s blocks freed with the daemon told {self.told.get(tid)!r} of {tid}")

    # -------------------------------------------------------------------- vLLM

    def arrive(self) -> None:
        n = next(self.ids)
        kind = self.rng.choice(["decode", "decode", "prefill", "prefill", "serial", "plain"])
        tid = f"t{self.rng.randrange(n // 3 + 1)}" if kind == "decode" else f"t{n}"  # retries reuse IDs
        reuse = self.reuse_ids and self.reqs and self.rng.random() < 0.05
        rid = self.rng.choice(list(self.reqs)) if reuse else f"r{n}"
        loading = [r.tid for r in self.reqs.values() if r.kind == "decode" and r.status == "remote"]
        if kind == "decode" and loading and (reuse or self.rng.random() < 0.3):
            tid = self.rng.choice(loading)  # n > 1: a sibling child of a request whose load is under way
        old = self.reqs.get(rid)
        if old is not None and (old.status != "finished" or (old.held and not old.freed)):
            return  # vLLM keeps a request (and its ID) until its blocks are free
        self.reqs[rid] = Req(rid, kind, self.rng.randrange(1, 5) * BLOCK + self.rng.randrange(BLOCK),
                             self.rng.choice([1, 1, 3]), tid)

    def schedule(self) -> tuple[dict[str, int], dict[str, sl.NewReq]]:
        """Matched and Allocated for waiting requests; tokens for running ones."""
        scheduled: dict[str, int] = {}
        new: dict[str, sl.NewReq] = {}
        for r in list(self.reqs.values()):
            if r.status == "waiting" and self.rng.random() < 0.7:
                eps = EPS if self.cards else None
                out = self.sched(sl.Matched(r.rid, self.now, r.prompt - r.computed, r.decode(), r.prefill(),
                                            eps if r.kind == "serial" else None, r.max_tokens == 1, r.prompt))
                if any(isinstance(a, sl.Defer) for a in out):
                    assert r.kind == "decode"
                    continue  # a sibling's load of its transfer is under way: asked again next step
                claim = next((a.count for a in out if isinstance(a, sl.Claim)), 0)
                if self.rng.random() < 0.1:
                    continue  # no free blocks this step: matched again later
                if claim and not r.blocks:
                    got = self.take(r.prompt // BLOCK + 1)
                    if got is None:
                        continue
                    r.blocks = got
                self.sched(sl.Allocated(r.rid, self.now, claim, r.blocks if claim else (), r.prompt, r.decode()))
                if claim:
                    r.status = "remote"
                    continue
                r.status, r.new, r.started = "running", not r.started, True  # resumed: not new
            if r.status == "running":
                left = r.prompt - r.computed
                n = max(left if left <= BLOCK or self.rng.random() < 0.6 else BLOCK, 1)  # chunked prefill
                got = self.take(max(0, (r.computed + n) // BLOCK + 1 - len(r.blocks)))  # this chunk's blocks
                if got is None:
                    continue  # no room this step
                r.blocks += got
                r.new_blocks = got
                scheduled[r.rid] = n
                if r.new:
                    new[r.rid] = sl.NewReq(r.prompt, r.computed, scheduled[r.rid], r.blocks)
                    r.new = False
        return scheduled, new

    def cached(self, scheduled: dict[str, int], new: dict[str, sl.NewReq]) -> dict[str, sl.CachedReq]:
        """What the scheduler half's shell builds: the streamed requests scheduled again."""
        out = {}
        for rid in scheduled:
            r = self.reqs[rid]
            if rid not in new and self.s.streaming(rid):
                out[rid] = sl.CachedReq(r.computed, r.blocks if r.resumed else r.new_blocks, r.resumed)
            r.resumed = False
        return out

    def step(self) -> None:
        scheduled, new = self.schedule()
        idle = not scheduled
        if not idle:
            before = {rid: self.reqs[rid].computed for rid in scheduled}
            for a in self.sched(sl.Step(self.now, scheduled, new, self.cached(scheduled, new))):
                if isinstance(a, sl.StreamChunk):
                    self.check_chunk(a, scheduled, before)
        # the worker: bind (publish), forward, wait_for_save, get_finished
        meta, self.meta = self.meta, []
        for ev in meta:  # applied as the scheduler core built them, stamped as the worker half does
            ev.now, ev.down = self.now, self.down
            self.work(ev)
        if self.w.count(wl.State.QUEUED):
            self.work(wl.Forward(self.now, self.down))
        self.answer()
        if self.down:  # collect: the worker sees its daemon unavailable
            self.lose_daemon("daemon unavailable")
        self.work(wl.Tick(self.now))
        fs, fr, self.fs, self.fr = self.fs, self.fr, set(), set()
        # update_from_output: the forward's tokens, the connector's finished sets, finishing
        for rid, n in scheduled.items():
            r = self.reqs[rid]
            r.computed = min(r.prompt, r.computed + n)
            if r.computed == r.prompt:
                r.out_tokens += 1
        for rid in fs:
            self.sched(sl.SendingDone(rid, self.now))
            r = self.reqs.get(rid)
            assert r is not None and r.held and r.status == "finished", f"{rid} freed but not held"
            r.freed += 1
            assert r.freed == 1, f"{rid} freed twice"
            self.give_back(r)
        for rid in fr:
            self.sched(sl.Recved(rid, self.now))
            r = self.reqs.get(rid)
            assert r is not None and r.kind == "decode", rid
            r.loads_ended += 1
            if r.status == "remote":
                r.status, r.computed = "waiting", r.prompt  # loaded, or recomputed after a failure
            else:
                assert r.status == "finished", (rid, r.status)  # ended as it was aborted
        if self.rng.random() < 0.1:
            self.cards = not self.cards  # a card written or removed while the step ran
        for r in list(self.reqs.values()):
            if r.status == "running" and r.out_tokens >= r.max_tokens:
                self.finish(r, ok=True)

    def finish(self, r: Req, ok: bool) -> None:
        """request_finished: vLLM frees the blocks unless told to hold them."""
        eps = EPS if self.cards else None
        out = self.sched(sl.Finished(r.rid, self.now, ok, r.prefill(), r.blocks, r.prompt,
                                     eps if r.prefill() is not None else None))
        r.status = "finished"
        r.held = any(isinstance(a, sl.Hold) for a in out)
        ended = [a for a in out if isinstance(a, sl.StreamAbort)]
        if ended:  # only a prefill leg's transfer that will not be sealed: withdrawn at once
            assert not r.held and r.kind in ("prefill", "serial") and ended[0].req_id == r.rid
            self.stream_aborts += 1
        elif r.kind == "prefill" and not r.held:  # the router named it: a decode side may wait for it
            assert ok and not r.blocks, (r, "a router-named transfer ended unsent but was not withdrawn")
        if not r.held:
            self.give_back(r)

    def abort(self) -> None:
        live = [r for r in self.reqs.values() if r.status != "finished"]
        # matched, not allocated yet (after a preemption too): rare, and where a stream ends unscheduled
        back = [r for r in live if r.status == "waiting" and self.s.state(r.rid) is sl.State.CANDIDATE]
        if back and self.rng.random() < 0.5:
            live = back
        if live:
            self.finish(self.rng.choice(live), ok=False)

    def preempt(self) -> None:
        running = [r for r in self.reqs.values() if r.status == "running" and r.out_tokens < r.max_tokens]
        if running:
            r = self.rng.choice(running)
            r.status, r.computed, r.resumed = "waiting", 0, True  # resumed later: not a new request
            self.give_back(r)  # vLLM frees a preempted request's blocks: another may get them
            if r.streamed:
                r.epoch, r.streamed = r.epoch + 1, False

    # ------------------------------------------------------------------- the daemon

    def answer(self) -> None:
        """Answer some published messages (in any order), and now and then a stray reply."""
        keep = []
        self.seen += [m for m in self.daemon if m not in self.seen[-20:]]
        del self.seen[:-20]
        for m in self.daemon:
            if self.rng.random() < 0.5:
                keep.append(m)
            elif isinstance(m, proto.Register):
                ok = self.rng.random() < 0.8
                self.work(wl.Received(m.transfer_id, m.attempt, self.now) if ok
                          else wl.ReceiveFailed(m.transfer_id, m.attempt, "boom", self.now))
            elif isinstance(m, proto.PrefillDone):
                self.work(wl.SendDone(m.transfer_id, self.rng.random() < 0.8, self.now))
            elif isinstance(m, proto.Abort):
                if id(m) in self.late or self.rng.random() < 0.5:
                    self.late.discard(id(m))
                    self.work(wl.Released(m.transfer_id, m.attempt, self.now))
                else:  # a prefill abort: the daemon's SendFailed; a decode one: a late result, then Released
                    self.work(wl.SendDone(m.transfer_id, False, self.now))
                    self.work(wl.Received(m.transfer_id, m.attempt, self.now))
                    self.late.add(id(m))
                    keep.append(m)
        self.daemon = keep
        if self.rng.random() < 0.15:  # stray: unknown transfers, wrong attempts, duplicates
            tid = f"t{self.rng.randrange(50)}"
            if self.seen and self.rng.random() < 0.7:
                tid = self.rng.choice(self.seen).transfer_id
            self.work(self.rng.choice([wl.Received(tid, 7, self.now), wl.ReceiveFailed(tid, 0, "x", self.now),
                                       wl.SendDone(tid, True, self.now), wl.Released(tid, 0, self.now)]))

    def lose_daemon(self, why: str) -> None:
        self.daemon.clear()
        self.late.clear()  # what it held will not answer
        self.work(wl.Lost(why, self.now))

    # ------------------------------------------------------------------------ runs

    def run(self, n: int) -> None:
        for _ in range(n):
            self.between_steps()
            while self.rng.random() < 0.3:  # several things may happen between two steps
                self.between_steps()
            self.step()
            self.now += 0.01

    def between_steps(self) -> None:
        if True:
            k = self.rng.random()
            if k < 0.25:
                self.arrive()
            elif k < 0.3:
                self.abort()
            elif k < 0.33:
                self.preempt()
            elif k < 0.345:
                self.lose_daemon("daemon restarted")
            elif k < 0.385:
                self.down = not self.down  # the worker fails what it holds at its next collect
            elif k < 0.42:
                self.cards = not self.cards  # a daemon's card written or gone
            elif k < 0.47:
                self.now += self.rng.choice([0.5, 3.0, 8.0])  # 8 s: past a load's deadline

    def drain(self) -> None:
        """vLLM finishes everything; the daemon answers all; then tombstone time passes."""
        self.down = False
        for _ in range(400):
            for r in self.reqs.values():
                if r.status != "finished" and self.rng.random() < 0.3:
                    self.finish(r, ok=self.rng.random() < 0.5)
            self.step()
            self.now += 0.05
            if all(r.status == "finished" for r in self.reqs.values()) and not self.w.live_count() \
                    and not self.s.count(sl.State.HELD) and not self.s.count(sl.State.RELEASING):
                break
        self.now += 100.0  # past every load deadline
        self.step()


def _sim(seed: int, tombstone_s: float) -> Sim:
    return Sim(random.Random(seed), tombstone_s, stream_min=(None, 0, 40)[seed % 3])


# ------------------------------------------------------------ every row, or why not


def test_every_row_is_taken_or_documented_unreachable() -> None:
    taken: set[Row] = set()
    for seed in range(400):
        sim = _sim(seed, tombstone_s=2.0 if seed % 2 else 60.0)  # IDs reused before or after the purge
        sim.s.on_transition = sim.w.on_transition = lambda key, old, ev, r: taken.add(r)
        sim.run(250)
        sim.drain()
    for table in (sl.TABLE, wl.TABLE):
        never = [str(r) for r in table.rows if r not in taken and not r.unreachable]
        assert never == [], "rows never taken (take them, or document why they cannot be):\n" + "\n".join(never)
        wrong = [str(r) for r in table.rows if r in taken and r.unreachable]
        assert wrong == [], "rows documented unreachable but taken:\n" + "\n".join(wrong)


# -------------------------------------------------- nothing is left for a finished request


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([2.0, 120.0]))
def test_nothing_is_left_once_every_request_finished(seed: int, tombstone_s: float) -> None:
    sim = _sim(seed, tombstone_s)
    sim.run(200)
    sim.drain()
    unfinished = [r.rid for r in sim.reqs.values() if r.status != "finished"]
    assert unfinished == []
    stuck = [r.rid for r in sim.reqs.values() if r.held and r.freed != 1]
    assert stuck == [], "held blocks never reported free"
    assert sim.w.live_count() == 0 and sim.s.live_count() == 0
    assert all(v == 0 for v in sim.w.sizes().values()), sim.w.sizes()
    # Only ENDED tombstones remain, and only until tombstone time passed.
    assert set(sim.s.counts()) == set(sl.State) and sum(sim.s.counts().values()) == sim.s.count(sl.State.ENDED)
    sim.now += tombstone_s + 1
    sim.s.handle(sl.SendingDone("nobody", sim.now))
    assert all(v == 0 for v in sim.s.sizes().values()), sim.s.sizes()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
def test_a_transfer_s_attempts_only_increase_while_the_daemon_may_remember_it(seed: int) -> None:
    """Requests of one transfer (a retry) register ever newer attempts while the transfer's
    last attempt is on record here (the tombstone outlives the daemon counter's). Not when a
    request ID is reused for another transfer within the tombstone time: the record then
    remembers the newer transfer's attempt only (vLLM makes request IDs unique)."""
    sim = Sim(random.Random(seed), 1e9, reuse_ids=False)  # never purged within the run
    last: dict[str, int] = {}
    sched = sim.sched

    def watch(ev: Any) -> list[Any]:
        out = sched(ev)
        for a in out:
            if isinstance(a, sl.Register):
                tid, att = a.transfer_id, a.attempt
                assert att > last.get(tid, -1), (tid, att, last)
                last[tid] = att
        return out

    sim.sched = watch  # type: ignore[method-assign]
    sim.run(300)


def test_the_old_attempt_map_would_grow_the_new_core_does_not() -> None:
    """5,000 decode transfers, each through Matched, Allocated, the load's end and finish:
    with tombstones purged, the core keeps nothing (the old ``_attempts`` kept 5,000)."""
    s = sl.SchedulerLifecycle(BLOCK, name_transfer=lambda: "x", tombstone_s=1.0)
    now = 0.0
    for i in range(5000):
        now += 0.01
        leg = DecodeLeg(f"t{i}", ("tcp://p:1",), 1)
        s.handle(sl.Matched(f"r{i}", now, 32, leg, None, None, False))
        s.handle(sl.Allocated(f"r{i}", now, 32, (1, 2), 32, leg))
        s.handle(sl.Recved(f"r{i}", now))
        s.handle(sl.Finished(f"r{i}", now, True, None, (1, 2), 32, None))
    assert s.live_count() == 0 and s.count(sl.State.ENDED) <= 101  # one tombstone second's worth
    s.handle(sl.SendingDone("nobody", now + 2))
    assert all(v == 0 for v in s.sizes().values()), s.sizes()


def test_an_allocation_without_tokens_to_load_changes_nothing() -> None:
    """The scheduler half skips update_state_after_alloc with no external tokens (every plain
    request on every engine): sound only while every Allocated row but the registering ones
    keeps its state and does nothing."""
    for r in sl.TABLE.rows:
        if r.event is sl.Allocated and r.guard is not sl.registers:
            assert r.to is r.state and r.steps == (), str(r)
    leg = DecodeLeg("t", ("tcp://p:1",), 1)
    assert not sl.registers(None, None, sl.Allocated("r", 0.0, 0, (1,), 16, leg))  # type: ignore[arg-type]


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([0, 40]))
def test_streamed_chunks_name_live_blocks_in_the_current_epoch(seed: int, least: int) -> None:
    """Streaming on (or auto at 40 tokens): every chunk is checked as it is named (Sim.check_chunk:
    the step's tokens, the request's blocks now, its epoch after preemptions); and some are."""
    sim = Sim(random.Random(seed), 60.0, stream_min=least)
    sim.run(200)
    sim.drain()
    assert sim.chunks > 0 or not any(r.prefill() is not None and r.prompt >= least for r in sim.reqs.values())


def test_layerwise_off_names_no_chunk() -> None:
    for seed in range(30):
        sim = Sim(random.Random(seed), 60.0, stream_min=None)
        sim.run(150)
        assert sim.chunks == 0
# ---------------------------------------------------------------- binding (docs/security.md)


def _prefill_through(leg: PrefillLeg, endpoints: tuple[str, ...] | None) -> tuple[list, dict | None]:
    s = sl.SchedulerLifecycle(BLOCK, name_transfer=lambda: "named", make_secret=lambda: "fresh-secret")
    s.handle(sl.Matched("r", 0.0, 0, None, leg, endpoints, False))
    out = s.handle(sl.Finished("r", 0.1, True, leg, (1, 2), 32, endpoints))
    sends = [a for a in out if isinstance(a, sl.Send)]
    answers = [a.answer for a in out if isinstance(a, sl.Hold)]
    return sends, answers[0]


def test_a_serial_leg_gets_a_fresh_secret_in_its_answer_and_its_prefill_done() -> None:
    sends, answer = _prefill_through(PrefillLeg(None), ("tcp://p:1",))
    assert answer is not None and answer["kvpush_secret"] == "fresh-secret"
    assert [(r.transfer_id, r.bind_node, r.bind_secret) for r in sends] == [("named", "", "fresh-secret")]
    # The decode engine parses it back from the forwarded answer, and registers with it.
    from kvpush.proto.params import decode_leg
    leg = decode_leg(answer)
    assert leg is not None and leg.secret == "fresh-secret"
    s = sl.SchedulerLifecycle(BLOCK, name_transfer=lambda: "x")
    s.handle(sl.Matched("d", 0.0, 32, leg, None, None, False))
    regs = [a for a in s.handle(sl.Allocated("d", 0.0, 32, (1, 2), 32, leg)) if isinstance(a, sl.Register)]
    assert [r.secret for r in regs] == ["fresh-secret"]


def test_a_router_leg_keeps_the_router_s_binding_and_a_plain_leg_stays_unbound() -> None:
    sends, answer = _prefill_through(PrefillLeg("t1", "dnode", "router-secret"), None)
    assert answer is None  # the router knows both legs: nothing to answer
    assert [(r.transfer_id, r.bind_node, r.bind_secret) for r in sends] == [("t1", "dnode", "router-secret")]
    sends, _ = _prefill_through(PrefillLeg("t2"), None)  # a client naming the transfer itself
    assert [(r.bind_node, r.bind_secret) for r in sends] == [("", "")]


def test_a_secret_is_128_bit_random_and_malformed_bindings_are_not_a_leg() -> None:
    from kvpush.proto import params as pp
    a, b = pp.new_secret(), pp.new_secret()
    assert a != b and len(a) >= 22  # 16 bytes, url-safe base64
    assert pp.prefill_leg({"do_remote_decode": True, "kvpush_secret": 5}) is None
    assert pp.prefill_leg({"do_remote_decode": True, "kvpush_decode_node": "x" * 65}) is None
    assert pp.decode_leg({"do_remote_prefill": True, "transfer_id": "t", "prefill_endpoints": ["tcp://p:1"],
                          "kvpush_secret": "s" * 129}) is None


def test_the_worker_publishes_the_binding_in_prefill_done_and_the_secret_in_register() -> None:
    w = wl.WorkerLifecycle(timeout_ms=1000, lease_ms=1000)
    out = w.handle(wl.Send("t", "r", (1, 2), 32, False, "dnode", "s3"))
    done = [a.msg for a in out if isinstance(a, wl.Publish) and isinstance(a.msg, proto.PrefillDone)]
    assert [(m.bind_node, m.bind_secret) for m in done] == [("dnode", "s3")]
    out = w.handle(wl.Register("u", 0, "q", (1, 2), 32, 0, ("tcp://p:1",), 1, "s3"))
    regs = [a.msg for a in out if isinstance(a, wl.Publish) and isinstance(a.msg, proto.Register)]
    assert [m.secret for m in regs] == ["s3"]


# ------------------------------------------------------- parallel sampling (n > 1, issue 43)


def test_n_children_of_one_transfer_register_once_and_the_siblings_share_its_load() -> None:
    """vLLM splits an n > 1 request into children with the same decode leg. The first claims
    and registers attempt 0; the others wait (Defer) while it loads, then claim nothing (vLLM's
    prefix cache holds the loaded blocks). On the old core every child registered a newer
    attempt, superseding the one before at the prefill daemon: one got the KV, the others
    waited out their deadlines and recomputed."""
    s = sl.SchedulerLifecycle(BLOCK, name_transfer=lambda: "x")
    leg = DecodeLeg("t", ("tcp://p:1",), 1)
    kids = [f"{i}_parent" for i in range(3)]
    regs = []

    def match(rid: str, now: float) -> list[Any]:
        return s.handle(sl.Matched(rid, now, 40, leg, None, None, False, 40))

    assert [type(a) for a in match(kids[0], 0.0)] == [sl.Stamp, sl.Claim]
    regs += [a for a in s.handle(sl.Allocated(kids[0], 0.0, 40, (1, 2, 3), 40, leg)) if isinstance(a, sl.Register)]
    for now in (0.0, 0.1):  # asked again every step while the load is under way
        for rid in kids[1:]:
            assert [type(a) for a in match(rid, now)] == [sl.Defer]
            assert s.state(rid) is None  # nothing is held for a waiting sibling
    s.handle(sl.Recved(kids[0], 0.2))
    for rid in kids[1:]:
        assert match(rid, 0.2) == []  # (0, False): its prompt is a local prefix hit
        assert s.handle(sl.Allocated(rid, 0.2, 0, (), 40, leg)) == []
    assert [(r.req_id, r.attempt) for r in regs] == [(kids[0], 0)]
    # the first child finished: a late sibling still claims nothing (the daemon released the blocks)
    s.handle(sl.Step(0.3, {kids[0]: 1}, {}))
    s.handle(sl.Finished(kids[0], 0.4, True, None, (1, 2, 3), 40, None))
    assert s.state(kids[0]) is sl.State.ENDED and match("3_parent", 0.5) == []


def test_a_sibling_of_a_load_that_never_ended_registers_a_newer_attempt() -> None:
    """The first child was aborted while loading (RELEASING, then ENDED without a load's end):
    nothing is cached, so a later request of the transfer registers a newer attempt, as before."""
    s = sl.SchedulerLifecycle(BLOCK, name_transfer=lambda: "x")
    leg = DecodeLeg("t", ("tcp://p:1",), 1)
    s.handle(sl.Matched("0_p", 0.0, 40, leg, None, None, False, 40))
    s.handle(sl.Allocated("0_p", 0.0, 40, (1, 2, 3), 40, leg))
    s.handle(sl.Finished("0_p", 0.1, False, None, (1, 2, 3), 40, None))
    assert s.state("0_p") is sl.State.RELEASING
    s.handle(sl.SendingDone("0_p", 0.2))
    assert any(isinstance(a, sl.Claim) for a in s.handle(sl.Matched("1_p", 0.3, 40, leg, None, None, False, 40)))
    regs = [a for a in s.handle(sl.Allocated("1_p", 0.3, 40, (4, 5, 6), 40, leg)) if isinstance(a, sl.Register)]
    assert [(r.req_id, r.attempt) for r in regs] == [("1_p", 1)]


def test_without_prefix_caching_a_sibling_computes_at_once_instead_of_waiting() -> None:
    """No prefix cache on this engine: the first child's blocks would never be a hit, so a
    sibling neither waits for its load nor registers (which would supersede it): it computes."""
    s = sl.SchedulerLifecycle(BLOCK, name_transfer=lambda: "x", share_prefix=False)
    leg = DecodeLeg("t", ("tcp://p:1",), 1)
    s.handle(sl.Matched("0_p", 0.0, 40, leg, None, None, False, 40))
    s.handle(sl.Allocated("0_p", 0.0, 40, (1, 2, 3), 40, leg))
    assert s.handle(sl.Matched("1_p", 0.0, 40, leg, None, None, False, 40)) == []


def _published(out: list[Any]) -> list[tuple[Any, Any]]:
    return [(a.key, a.msg) for a in out if isinstance(a, wl.Publish)]


def test_what_the_worker_gives_up_without_the_daemon_s_word_is_told_to_it() -> None:
    """Issue 43: a send while the daemon is down (no PrefillDone), an early send whose forward
    ran while it was down, a send and a load the daemon was lost while holding, and a load
    aborted while it was down: each is one gave-up Abort (no record waits on its answer, a
    refused one is dropped), and the blocks are handed back to vLLM as before."""
    w = wl.WorkerLifecycle(timeout_ms=1000, lease_ms=1000)
    reg = wl.Register("d1", 2, "rd1", (1, 2), 32, 0, EPS, 1, now=0.0)
    assert [type(a) for a in w.handle(reg)] == [wl.Publish]
    assert [type(a) for a in w.handle(wl.Register("d2", 0, "rd2", (3,), 16, 0, EPS, 1, now=0.0))] == [wl.Publish]
    assert [type(a) for a in w.handle(wl.Send("p1", "rp1", (4,), 16, now=0.0))] == [wl.Publish]
    out = w.handle(wl.Send("p2", "rp2", (5,), 16, now=1.0, down=True))
    assert _published(out) == [(("gave_up", "p2"), proto.Abort("p2", 0, wl.GAVE_UP))]
    assert [a for a in out if isinstance(a, wl.Free)] == [wl.Free("rp2")]
    assert w.handle(wl.Send("p3", "rp3", (6,), 16, early=True, now=1.0)) == []
    out = w.handle(wl.Forward(1.0, True))
    assert _published(out) == [(("gave_up", "p3"), proto.Abort("p3", 0, wl.GAVE_UP))]
    assert [type(a) for a in w.handle(wl.Send("p3", "rp3", (6,), 16, now=1.1))] == [wl.Free, wl.ReportTrace]
    out = w.handle(wl.AbortLoad("d2", 0, "rd2", now=1.2, down=True))
    assert _published(out) == [(("gave_up", "d2"), proto.Abort("d2", 0, wl.GAVE_UP))]
    out = w.handle(wl.Lost("daemon unavailable", 2.0))
    assert sorted(_published(out)) == [(("gave_up", "d1"), proto.Abort("d1", 2, wl.GAVE_UP)),
                                       (("gave_up", "p1"), proto.Abort("p1", 0, wl.GAVE_UP))]
    assert {type(a) for a in out} == {wl.Publish, wl.LoadEnded, wl.Free}
    assert w.live_count() == 0
    assert w.handle(wl.Unsent(("gave_up", "p1"), 2.1)) == []  # refused: nothing waits on it
    assert w.handle(wl.Released("p1", 0, 2.2)) == []  # a restarted daemon's answer finds no record


def test_a_register_while_the_daemon_is_down_is_not_told() -> None:
    """Never published: the daemon holds nothing of it, and a decode daemon has no tombstone
    for an unknown registration (the load fails here at once, vLLM recomputes)."""
    w = wl.WorkerLifecycle(timeout_ms=1000, lease_ms=1000)
    out = w.handle(wl.Register("d1", 0, "rd1", (1,), 16, 0, EPS, 1, now=0.0, down=True))
    assert _published(out) == [] and [type(a) for a in out] == [wl.LoadEnded]
