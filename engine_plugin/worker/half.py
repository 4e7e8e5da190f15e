"""Worker half of KVPushConnector: attaches the KV memory, publishes, reports completions.

It owns the rank's DaemonClient. Every call is non-blocking: publishing is a
send on the engine link (a unix stream socket) with a bounded local queue, completions come
from a zero-timeout poll.
No NIXL, no threads. If the daemon is unreachable the engine keeps serving:
decode loads fail (vLLM recomputes) and prefill blocks are released.

Each registration's and send's lifecycle is one record of
:mod:`kvpush.engine_plugin.worker.lifecycle`; this shell turns the step's metadata and the
daemon's replies into its events, and carries out its actions (publishes, vLLM's finished
sets and load errors). What it keeps itself is per step (those sets) or bounded (traces).
"""

from __future__ import annotations

import atexit
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from kvpush import proto
from kvpush.common.machine import drive
from kvpush.engine_plugin.compat import check_kv_allocation, target_layers
from kvpush.engine_plugin.config import PluginConfig
from kvpush.engine_plugin.link.client import DaemonClient
from kvpush.engine_plugin.logonce import OncePer
from kvpush.engine_plugin.logs import plugin_logger
from kvpush.engine_plugin.metadata import KVPushMetadata, StreamChunk
from kvpush.engine_plugin.stats import TransferSamples
from kvpush.engine_plugin.worker import lifecycle as wl
from kvpush.engine_plugin.worker.export import export_cpu_tensor, unlink_export
from kvpush.engine_plugin.worker.layer_events import CpuEvents, CudaEvents, EventSource, pool_size
from kvpush.engine_plugin.worker.layer_stream import LayerStream, frame_bytes
from kvpush.proto.layout import KVLayout, vllm_cpu_layout
from kvpush.proto.trace import TraceRing, now_ns

log = plugin_logger(__name__)

_LAYER_NUM = re.compile(r"\.(\d+)\.")
TRACE_BATCH = 16  # TraceReports sent together once this many are queued ...
TRACE_FLUSH_S = 0.2  # ... or this long after the last batch, or when no transfer is pending
TRACE_BATCH_MAX = 512  # queued at most (oldest dropped, counted in trace_dropped)


@dataclass
class TransferCounters:
    """Cumulative, this rank; exported with the link's through vLLM's stats hook."""

    registered: int = 0  # Register handed to the daemon link (decode)
    received: int = 0  # loads the daemon completed (decode)
    load_failed: int = 0  # loads failed here: daemon's ReceiveFailed, unavailable, expired
    prefill_done: int = 0  # PrefillDone handed to the daemon link (prefill)
    sent: int = 0  # the daemon's Sent (prefill)
    send_failed: int = 0  # the daemon's SendFailed (prefill)
    layer_frames: int = 0  # LayerProgress handed to the daemon link (prefill, layer-wise)
    layer_refused: int = 0  # forwards whose stream ended at a refused LayerProgress
    layer_advised_off: int = 0  # auto chunks not streamed: the daemon's link rates make it pointless


def _layer_key(name: str) -> tuple[int, str]:
    m = _LAYER_NUM.search(name)
    return (int(m.group(1)) if m else 1 << 30, name)


def cpu_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The CPU attention backend's kernel choice, which fixes how a block is packed."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, head_size))
    except Exception:  # a vLLM without that helper: treat blocks as opaque
        return "unknown"


def describe_cpu_kv(
    kv_caches: dict[str, torch.Tensor], *, model: str, head_start: int, total_heads: int,
    kv_groups: tuple[str, ...] = (), blocks: int | None = None,
) -> tuple[torch.Tensor, KVLayout]:
    """One uint8 tensor over the shared storage of all layers, and its layout.

    vLLM-cpu gives one tensor per layer, ``[num_blocks, kv_heads, block_size,
    2*head_size]``, all views of one storage. ``kv_groups`` (a hybrid engine): the layers
    are already the distinct tensors in vLLM's order (layouts.hybrid_groups), kept as given;
    where vLLM split each of its ``blocks`` blocks into kernel blocks (an attention block
    raised to a state group's page, e.g. 1152 tokens), a block is read as those kernel blocks
    together, byte for byte ("opaque": P and D must agree, as the handshake checks).
    """
    names = list(kv_caches) if kv_groups else sorted(kv_caches, key=_layer_key)
    first = kv_caches[names[0]]
    storage = first.untyped_storage()
    for n in names:
        t = kv_caches[n]
        if t.untyped_storage().data_ptr() != storage.data_ptr():
            raise RuntimeError("kvpush: KV cache layers are not views of one storage")
        if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
            raise RuntimeError(f"kvpush: layer {n} has shape {tuple(t.shape)}, expected {tuple(first.shape)}")
    kernel_blocks, heads, block_size, two_d = first.shape
    head_size = two_d // 2
    dtype = str(first.dtype).removeprefix("torch.")
    whole = torch.empty(0, dtype=torch.uint8)
    whole.set_(storage, 0, (storage.nbytes(),))
    isa = cpu_isa(first.dtype, block_size, head_size)
    num_blocks = kernel_blocks
    if kv_groups and blocks and kernel_blocks != blocks:
        if kernel_blocks % blocks:
            raise RuntimeError(f"kvpush: {kernel_blocks} kernel blocks for {blocks} KV cache blocks")
        num_blocks, block_size, isa = blocks, block_size * (kernel_blocks // blocks), "opaque"
    lay = _layout(kv_caches, names, whole, num_blocks, block_size, heads, head_size, dtype, isa,
                  model=model, head_start=head_start, total_heads=total_heads)
    return whole, (KVLayout(**{**lay.__dict__, "kv_groups": kv_groups}) if kv_groups else lay)


def _layout(kv_caches: dict[str, torch.Tensor], names: list[str], whole: torch.Tensor, num_blocks: int,
            block_size: int, heads: int, head_size: int, dtype: str, isa: str, **kw: Any) -> KVLayout:
    base = whole.data_ptr()
    offsets = tuple(kv_caches[n].data_ptr() - base for n in names)
    # Packing inside a block is kernel-specific. Known kernels map token by token
    # (different block sizes on P and D work); others (neon, vsx, ...) are opaque
    # whole blocks, which copy byte for byte but refuse a block-size mismatch.
    packing = isa if isa in ("amx", "vec", "vec16") else "opaque"
    lay = vllm_cpu_layout(
        num_layers=len(names), num_blocks=num_blocks, block_size=block_size, num_heads=heads,
        head_size=head_size, dtype=dtype, region_size=whole.numel(), packing=packing, **kw,
    )
    lay = KVLayout(**{**lay.__dict__, "layer_offsets": offsets})
    lay.validate()
    return lay


def first_device_index(kv_caches: dict[str, torch.Tensor]) -> int:
    t = next(iter(kv_caches.values()))
    return int(t.device.index or 0)


class KVPushWorker:
    def __init__(self, cfg: PluginConfig, *, engine_id: str, role: str, rank: int, tp_size: int,
                 model: str, total_kv_heads: int, vllm_config: Any = None, kv_cache_config: Any = None) -> None:
        self.vllm_config = vllm_config  # read on GPU only: the attention backend and layout
        self.kv_cache_config = kv_cache_config
        self.cfg = cfg
        self.engine_id = engine_id
        self.role = role
        self.rank = rank
        self.tp_size = tp_size
        self.model = model
        self.total_kv_heads = total_kv_heads
        self.endpoint = cfg.socket_for(rank)
        self.client = DaemonClient(self.endpoint, dead_after_s=cfg.dead_after_ms / 1000, trusted=cfg.trusted_uids())
        self.counters = TransferCounters()
        self._said = OncePer(64)  # failure reasons already logged
        self.samples = TransferSamples()  # latency and bytes of finished transfers (stats hook)
        self.layout: KVLayout | None = None
        self.lifecycle = wl.WorkerLifecycle(timeout_ms=cfg.timeout_ms, lease_ms=cfg.lease_ms)
        # Per step, handed to vLLM by collect() / take_load_errors() and emptied there:
        self._load_errors: set[int] = set()
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()  # hybrid engines: failed loads, by request (take_failed_recving)
        self._reported: list[str] = []  # received this step: stamp when handed to vLLM
        self._whole: torch.Tensor | None = None
        self._down_logged = False  # the "failing loads" warning of this unavailability was said
        self.idle_step = False
        # This rank's timeline stamps, reported to the daemon once a transfer is behind us.
        self.trace = TraceRing(max_transfers=1024)
        self.trace_dropped = 0
        self._trace_out: deque[proto.TraceReport] = deque(maxlen=TRACE_BATCH_MAX)
        self._trace_flushed = 0.0
        # Layer-wise streaming (prefill): the plan, made when the KV is known (register_kv_caches).
        self.stream: LayerStream | None = None
        self.events: EventSource = CpuEvents()

    # ------------------------------------------------------------------ set-up

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kv_caches = target_layers(kv_caches, self.vllm_config)  # a drafter's KV stays home
        first = next(iter(kv_caches.values()))
        if first.device.type == "cuda":
            self._register_gpu_kv_caches(kv_caches)
            return
        if first.device.type != "cpu":
            raise RuntimeError(f"kvpush: KV caches on {first.device.type} are not supported (CPU and CUDA are)")
        kv_groups: tuple[str, ...] = ()
        if self.kv_cache_config is not None:  # what kvpush cannot move: refused at start-up, not wrong KV
            from kvpush.engine_plugin.worker.layouts import check_kv_cache_config, hybrid_groups

            check_kv_cache_config(self.kv_cache_config, pages=False, windowed_as_full=self.cfg.windowed_as_full)
            kv_groups, names = hybrid_groups(self.kv_cache_config, kv_caches)
            if kv_groups:  # one layer per distinct tensor, in vLLM's order (the groups overlay them)
                kv_caches = {n: kv_caches[n] for n in names}
        from kvpush.engine_plugin.worker.layouts import cpu_mla_layout, is_mla

        heads = next(iter(kv_caches.values())).shape[1]  # (a hybrid's: an attention layer's)
        if is_mla(self.vllm_config, self.kv_cache_config):  # one latent a token, plain rows

            def describe() -> tuple[torch.Tensor, KVLayout]:
                head_size = int(self.vllm_config.model_config.get_head_size())
                return cpu_mla_layout(kv_caches, sorted(kv_caches, key=_layer_key), head_size=head_size,
                                      model=self.model)
        else:

            def describe() -> tuple[torch.Tensor, KVLayout]:
                return describe_cpu_kv(kv_caches, model=self.model, head_start=self.rank * heads,
                                       total_heads=self.total_kv_heads, kv_groups=kv_groups,
                                       blocks=getattr(self.kv_cache_config, "num_blocks", None))
        whole, _ = describe()
        handle = export_cpu_tensor(whole)  # moves the storage into shared memory in place
        # Addresses changed with the move: describe again from the live tensors.
        whole, self.layout = describe()
        if kv_groups:  # a whole page per block moves: every group's page must be the view's block
            from kvpush.engine_plugin.worker.layouts import check_pages

            check_pages(self.kv_cache_config, self.layout.block_bytes // self.layout.num_layers)
        self._whole = whole
        self.handle = handle
        atexit.register(self._unlink_export)  # a normal exit that skips shutdown() too
        self._plan_stream(kv_caches, None)
        self.client.attach(proto.Attach(self.engine_id, self.rank, self.tp_size, self.role, (handle,), self.layout),
                           self._after_attach())
        log.info("kvpush: KV cache (%d bytes, %d layers, %d blocks x %d tokens) attached to %s",
                 whole.numel(), self.layout.num_layers, self.layout.num_blocks, self.layout.block_size, self.endpoint)

    def _register_gpu_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """GPU: the layout from the attention backend in use (engine_plugin.layouts), one
        CUDA IPC handle per distinct allocation; a hybrid's groups (sliding window, Mamba /
        gated-delta-net state beside full attention) attached as on the CPU path. Anything
        not understood is refused here, at start-up, never attached as a guess."""
        from kvpush.engine_plugin.worker.export import export_cuda_tensor
        from kvpush.engine_plugin.worker.layouts import describe_gpu_kv, engine_geometry

        check_kv_allocation(self.vllm_config)  # VMM-backed memory: refused with the fix, not a failed attach
        geo = engine_geometry(self.vllm_config, self.kv_cache_config, self.cfg.windowed_as_full)
        ordered = {n: kv_caches[n] for n in sorted(kv_caches, key=_layer_key)}
        regions, self.layout, names = describe_gpu_kv(
            ordered, geo, self.kv_cache_config, rank=self.rank, total_heads=self.total_kv_heads, model=self.model)
        self._regions = regions  # keeps every exported allocation alive for the daemon
        handles = tuple(export_cuda_tensor(r) for r in regions)
        self.handle = None  # no shm file to unlink
        self._plan_stream({n: kv_caches[n] for n in names}, first_device_index(kv_caches))
        self.client.attach(proto.Attach(self.engine_id, self.rank, self.tp_size, self.role, handles, self.layout),
                           self._after_attach())
        log.info("kvpush: GPU KV cache (%s, %d layers in %d allocations, %d blocks x %d tokens, %d KV cache "
                 "groups) attached to %s", geo.backend, self.layout.num_layers, len(regions), self.layout.num_blocks,
                 self.layout.block_size, len(self.layout.kv_groups) or 1, self.endpoint)

    def _plan_stream(self, kv_caches: dict[str, torch.Tensor], device: int | None) -> None:
        """Layer-wise (not "off", on a rank that may prefill): which layer ends which group;
        on GPU, the event pool the frames name (created once, announced after every Attach)."""
        if self.cfg.layerwise == "off" or self.role == "decode":
            return
        names = sorted(kv_caches, key=_layer_key)
        self.stream = LayerStream(names, self.cfg.layer_group)
        if device is not None:
            self.events = CudaEvents(pool_size(len(names), self.cfg.layer_group), device)

    def _after_attach(self) -> tuple[proto.LayerEvents, ...]:
        ann = self.events.announce() if self.stream is not None else None
        return () if ann is None else (ann,)

    # ------------------------------------------------------------------ per step

    def begin_forward(self, streams: list[StreamChunk]) -> None:
        """bind_connector_metadata: the streamed chunks this step's forward computes."""
        if self.stream is not None:
            self.counters.layer_advised_off += self.stream.begin(streams, self.client.stream_min_tokens)

    def save_kv_layer(self, layer_name: str) -> None:
        """After each attention layer: at a group's end, one LayerProgress for the forward's
        streamed chunks. Never blocks (the link queues or refuses); never waits on the GPU."""
        st = self.stream
        if st is None or not st.chunks:
            return
        span = st.ends.get(layer_name)
        if span is None:
            return
        ok = self.client.send_encoded(frame_bytes(st.head, span, self.events.record()))
        st.sent(ok)
        if ok:
            self.counters.layer_frames += 1
        else:
            self.counters.layer_refused += 1


    def publish(self, meta: KVPushMetadata) -> None:
        """Apply what the scheduler half decided: its events, each stamped with the two facts
        only this half knows (the time, and whether the daemon is known down)."""
        now = time.monotonic()
        if not (self.client.available and self.client.attached):
            self._handle(self.client.poll())  # an AttachAck or a liveness change may be waiting
        down = self._daemon_down()
        for ev in meta.events:
            ev.now, ev.down = now, down
            self._apply(ev)

    def after_forward(self) -> None:
        """Right after the step's forward (vLLM's wait_for_save): publish the PrefillDone of
        requests whose last prompt token this forward computed, a whole step earlier than
        request_finished could. Their blocks are reported free only once the scheduler
        confirmed that vLLM finished them (the plain Send or a SendAbort)."""
        if self.stream is not None:
            self.stream.end()
        if not self.lifecycle.count(wl.State.QUEUED):
            return
        if self._whole is not None and self._whole.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the daemon reads what the kernels wrote
        self._apply(wl.Forward(time.monotonic(), self._daemon_down()))

    def _apply(self, ev: Any) -> None:
        """Feed one event to the lifecycle and carry out its actions, in order (a refused
        publish is told to it as Unsent after the batch: :func:`kvpush.common.machine.drive`)."""
        drive(self.lifecycle, ev, self._carry_out)

    def _carry_out(self, a: Any) -> list[Any] | None:
        if isinstance(a, wl.Publish):
            tid = a.msg.transfer_id
            if a.stamp is not None:
                self.trace.stamp(tid, a.stamp)  # before it can arrive
            if not self.client.send(a.msg):
                return [wl.Unsent(a.key, time.monotonic())]
            if a.counter is not None:
                setattr(self.counters, a.counter, getattr(self.counters, a.counter) + 1)
        elif isinstance(a, wl.Free):
            self._finished_sending.add(a.req_id)
        elif isinstance(a, wl.LoadEnded):
            self._finished_recving.add(a.req_id)
            if a.ok:
                self.counters.received += 1
                self.samples.record("load", a.seconds, len(a.block_ids) * self._block_bytes)
                self.trace.stamp(a.transfer_id, "d.plugin.received_seen")
                self._reported.append(a.transfer_id)
            else:
                if a.say:
                    self._say_once("not received", a.transfer_id, a.reason, "recomputing")
                self.counters.load_failed += 1
                if self.layout is not None and self.layout.kv_groups:
                    # Block IDs are per group there: vLLM takes whole failed requests instead.
                    self._failed_recving.add(a.req_id)
                else:
                    self._load_errors.update(a.block_ids)
                self.trace.stamp(a.transfer_id, "d.plugin.load_failed")
                log.debug("kvpush: load of %s failed: %s", a.transfer_id, a.reason)
        elif isinstance(a, wl.SendSample):
            self.samples.record("send", a.seconds, a.blocks * self._block_bytes)
        elif isinstance(a, wl.ReportTrace):
            self._report_trace(a.transfer_id)
        return None

    def _daemon_down(self) -> bool:
        """Fail publishes at once? Only where the daemon is known unreachable (the link's
        judgement, :meth:`kvpush.engine_plugin.link.state.DaemonLink.down`) and the
        configuration asks for it (``unavailable_fail``)."""
        return self.cfg.unavailable_fail and self.client.down()

    def collect(self) -> tuple[set[str], set[str]]:
        """Poll the daemon and return (finished_sending, finished_recving).

        Zero timeout, except on an idle step (no forward scheduled) while a load is pending,
        or a send on a TP > 1 engine: then we wait up to ``idle_wait_ms`` for the daemon (an
        answer ends the wait at once). For a load, so that its Received reaches vLLM the moment
        it arrives. For a send, because vLLM steps without pause while a request waits on its
        connector: on a TP=2 engine every rank and its gloo threads step with it, and on a
        small host that blocked every daemon on the machine for seconds, a bystander's thread
        creation with them (the lab's TP test). Not on a TP=1 prefill engine: there EngineCore
        spins on the worker's reply anyway, and the wait cost low-load TTFT (about +5 ms at
        1024-token prompts, scripts/bench_ttft.py), a new request arriving during it waiting too.
        """
        msgs = self.client.poll()
        if (not msgs and self.idle_step and self.cfg.idle_wait_ms
                and self._waits_for_daemon() and self.client.available):
            if self.client.wait(self.cfg.idle_wait_ms / 1000.0):
                msgs = self.client.poll()
        self._handle(msgs)
        if self._daemon_down():
            if not self._down_logged:
                log.warning("kvpush: daemon %s unavailable; failing loads and releasing blocks until it returns",
                            self.endpoint)
                self._down_logged = True
            self._daemon_lost("daemon unavailable")
        now = time.monotonic()
        self._apply(wl.Tick(now))  # a load unanswered long past its deadline fails
        self._flush_traces(now)
        fs, fr = self._finished_sending, self._finished_recving
        self._finished_sending, self._finished_recving = set(), set()
        if self._reported:
            t = now_ns()
            for tid in self._reported:
                self.trace.stamp(tid, "d.plugin.finished_recving", t)
            self._reported.clear()
        return fs, fr

    def take_stamps(self, stamps: list[tuple[str, str, int]]) -> None:
        """The scheduler half's stamps (via metadata); the first decode step ends a timeline."""
        for tid, hop, t in stamps:
            self.trace.stamp(tid, hop, t)
            if hop == "d.plugin.first_decode_step":
                self._report_trace(tid)

    def _report_trace(self, tid: str) -> None:
        """Queue this rank's stamps of ``tid`` for the daemon; they go out in batches
        (_flush_traces): every send is a system call that wakes the daemon, which on a core
        shared with the engine preempts it, so one send per request per step was measurable."""
        events = self.trace.pop(tid)
        if not events:
            return
        if len(self._trace_out) == TRACE_BATCH_MAX:
            self.trace_dropped += 1  # the deque drops its oldest
        self._trace_out.append(proto.TraceReport(tid, tuple(h for h, _ in events), tuple(t for _, t in events)))

    def _flush_traces(self, now: float) -> None:
        lc = self.lifecycle
        quiet = self.idle_step or not (lc.count(wl.State.LOADING) or lc.count(wl.State.SENDING)
                                       or lc.count(wl.State.RELEASING))
        if not self._trace_out or (len(self._trace_out) < TRACE_BATCH and now - self._trace_flushed < TRACE_FLUSH_S
                                   and not quiet):
            return
        self._trace_flushed = now
        batch = list(self._trace_out)
        self._trace_out.clear()
        if not self.client.available:
            self.trace_dropped += len(batch)
            return
        for msg in batch:  # back to back: the daemon wakes once for the lot
            if not self.client.send(msg):
                self.trace_dropped += 1

    def _waits_for_daemon(self) -> bool:
        """A load is pending, or a send on a TP > 1 engine (see collect)."""
        lc = self.lifecycle
        return bool(lc.count(wl.State.LOADING) or (lc.count(wl.State.SENDING) and self.tp_size > 1))

    def _handle(self, msgs: list[Any]) -> None:
        for m in msgs:
            now = time.monotonic()
            if isinstance(m, proto.Received):
                self._apply(wl.Received(m.transfer_id, m.attempt, now))
            elif isinstance(m, proto.ReceiveFailed):
                self._apply(wl.ReceiveFailed(m.transfer_id, m.attempt, m.reason, now))
            elif isinstance(m, (proto.Sent, proto.SendFailed)):
                if isinstance(m, proto.SendFailed):
                    self.counters.send_failed += 1
                    self._say_once("not sent", m.transfer_id, m.reason, "its blocks are free")
                    self.trace.stamp(m.transfer_id, "p.plugin.send_failed_seen")
                else:
                    self.counters.sent += 1
                    self.trace.stamp(m.transfer_id, "p.plugin.sent_seen")
                self._apply(wl.SendDone(m.transfer_id, isinstance(m, proto.Sent), now))
            elif isinstance(m, proto.Released):
                self._apply(wl.Released(m.transfer_id, m.attempt, now))
            elif isinstance(m, proto.Error):
                if m.code == "unexpected" and m.message.startswith("LayerProgress") and self.stream is not None:
                    # A daemon without layer-wise streaming: whole-request pushes, as with "off".
                    log.warning("kvpush: daemon %s does not take layer-wise progress (%s); pushing whole "
                                "requests", self.endpoint, m.message)
                    self.stream = None
                    continue
                log.warning("kvpush: daemon error %s: %s (%s)", m.code, m.message, m.ref)
            elif isinstance(m, proto.AttachAck):
                if self.client.take_replaced():  # another daemon than the one that held our work
                    self._daemon_lost("daemon restarted")
                self._down_logged = False

    @property
    def _block_bytes(self) -> int:
        """This rank's bytes per block, all layers (0 before the KV is attached)."""
        return self.layout.block_bytes if self.layout is not None else 0

    def _say_once(self, what: str, tid: str, reason: str, then: str) -> None:
        """A failed transfer, logged once per (what, reason): under a persistent fault (an
        unreachable prefill node) the log says why without a line per request; the counts
        are in the stats (load_failed, send_failed)."""
        if not self._said.first((what, reason)):
            log.debug("kvpush: KV of %s %s: %s", tid, what, reason)
            return
        log.warning("kvpush: KV of %s %s (%s); %s. Further transfers failing for this reason are counted "
                    "(vLLM's KV Transfer metrics), not logged", tid, what, reason, then)

    def _daemon_lost(self, why: str) -> None:
        """Nothing the daemon held will answer: fail the loads, free the blocks."""
        if self.lifecycle.live_count():
            self._apply(wl.Lost(why, time.monotonic()))

    def sizes(self) -> dict[str, int]:
        """Every collection this half keeps, and its size (the soak benchmark's view)."""
        return {**{f"lifecycle.{k}": v for k, v in self.lifecycle.sizes().items()},
                "finished_sending": len(self._finished_sending), "finished_recving": len(self._finished_recving),
                "load_errors": len(self._load_errors), "reported": len(self._reported),
                "trace_ring": len(self.trace._t), "trace_out": len(self._trace_out), "said": len(self._said._seen)}

    def stats_totals(self) -> dict[str, int]:
        """Every counter of this rank, cumulative: the transfers' and the daemon link's."""
        link = {f"link_{k}": v for k, v in self.client.counters.as_dict().items()}
        return {**vars(self.counters), "trace_dropped": self.trace_dropped, **link}

    def take_failed_recving(self) -> set[str]:
        """Loads that failed since the last call, by request (hybrid engines, whose block IDs
        are per KV cache group: vLLM recomputes the whole request)."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def take_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def shutdown(self) -> None:
        self.client.close()
        self._unlink_export()

    def _unlink_export(self) -> None:
        """Remove our KV shm file from /dev/shm (our mapping stays valid until exit; the
        export's pin keeps torch from unlinking it again). A killed engine cannot: its
        daemon unlinks the file once it sees the process gone."""
        handle = getattr(self, "handle", None)
        if handle is not None and handle.kind == "cpu_shm":
            self.handle = None
            try:
                unlink_export(handle)
            except OSError as exc:
                log.warning("kvpush: cannot unlink the KV shm file: %s", exc)
