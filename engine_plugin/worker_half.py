"""Worker half of KVPushConnector: attaches the KV memory, publishes, reports completions.

It owns the rank's DaemonClient. Every call is non-blocking: publishing is a
zmq send with a bounded local queue, completions come from a zero-timeout poll.
No NIXL, no threads. If the daemon is unreachable the engine keeps serving:
decode loads fail (vLLM recomputes) and prefill blocks are released.
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
from kvpush.engine_plugin.client import DaemonClient
from kvpush.engine_plugin.connector_config import PluginConfig
from kvpush.engine_plugin.kv_export import export_cpu_tensor, unlink_export
from kvpush.engine_plugin.logonce import OncePer
from kvpush.engine_plugin.logs import plugin_logger
from kvpush.engine_plugin.metadata import KVPushMetadata, SendReq
from kvpush.engine_plugin.stats import TransferSamples
from kvpush.proto.layout import KVLayout, vllm_cpu_layout
from kvpush.proto.trace import TraceRing, now_ns

log = plugin_logger(__name__)

_LAYER_NUM = re.compile(r"\.(\d+)\.")
TRACE_BATCH = 16  # TraceReports sent together once this many are queued ...
TRACE_FLUSH_S = 0.2  # ... or this long after the last batch, or when no transfer is pending
TRACE_BATCH_MAX = 512  # queued at most (oldest dropped, counted in trace_dropped)


@dataclass
class _Pending:
    req_id: str
    attempt: int
    block_ids: list[int]
    since: float


@dataclass
class TransferCounters:
    """Cumulative, this rank; exported with the link's through vLLM's stats hook."""

    registered: int = 0  # Register handed to the daemon link (decode)
    received: int = 0  # loads the daemon completed (decode)
    load_failed: int = 0  # loads failed here: daemon's ReceiveFailed, unavailable, expired
    prefill_done: int = 0  # PrefillDone handed to the daemon link (prefill)
    sent: int = 0  # the daemon's Sent (prefill)
    send_failed: int = 0  # the daemon's SendFailed (prefill)


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
    kv_caches: dict[str, torch.Tensor], *, model: str, head_start: int, total_heads: int
) -> tuple[torch.Tensor, KVLayout]:
    """One uint8 tensor over the shared storage of all layers, and its layout.

    vLLM-cpu gives one tensor per layer, ``[num_blocks, kv_heads, block_size,
    2*head_size]``, all views of one storage.
    """
    names = sorted(kv_caches, key=_layer_key)
    first = kv_caches[names[0]]
    storage = first.untyped_storage()
    for n in names:
        t = kv_caches[n]
        if t.untyped_storage().data_ptr() != storage.data_ptr():
            raise RuntimeError("kvpush: KV cache layers are not views of one storage")
        if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
            raise RuntimeError(f"kvpush: layer {n} has shape {tuple(t.shape)}, expected {tuple(first.shape)}")
    num_blocks, heads, block_size, two_d = first.shape
    head_size = two_d // 2
    dtype = str(first.dtype).removeprefix("torch.")
    whole = torch.empty(0, dtype=torch.uint8)
    whole.set_(storage, 0, (storage.nbytes(),))
    isa = cpu_isa(first.dtype, block_size, head_size)
    return whole, _layout(kv_caches, names, whole, num_blocks, block_size, heads, head_size, dtype, isa,
                          model=model, head_start=head_start, total_heads=total_heads)


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
        self._send_since: dict[str, tuple[float, int]] = {}  # prefill: tid -> (published, blocks)
        self.layout: KVLayout | None = None
        self._recv: dict[str, _Pending] = {}  # transfer_id -> decode registration
        self._send: dict[str, str] = {}  # transfer_id -> req_id (prefill, blocks held)
        self._releasing: dict[str, str] = {}  # transfer_id -> req_id (decode abort)
        self._load_errors: set[int] = set()
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._reported: list[str] = []  # received this step: stamp when handed to vLLM
        self._after_forward: list[SendReq] = []  # early PrefillDones of the current step
        self._unconfirmed: set[str] = set()  # early-published, vLLM not yet finished them
        self._done_early: dict[str, str] = {}  # daemon done before vLLM finished: tid -> req_id
        self._whole: torch.Tensor | None = None
        self._daemon_id: str | None = None
        self._down_logged = False
        self.idle_step = False
        self._created = time.monotonic()
        # This rank's timeline stamps, reported to the daemon once a transfer is behind us.
        self.trace = TraceRing(max_transfers=1024)
        self.trace_dropped = 0
        self._trace_out: deque[proto.TraceReport] = deque(maxlen=TRACE_BATCH_MAX)
        self._trace_flushed = 0.0

    # ------------------------------------------------------------------ set-up

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        if first.device.type == "cuda":
            self._register_gpu_kv_caches(kv_caches)
            return
        if first.device.type != "cpu":
            raise RuntimeError(f"kvpush: KV caches on {first.device.type} are not supported (CPU and CUDA are)")
        if self.kv_cache_config is not None:  # hybrid models: refused at start-up, not wrong KV
            from kvpush.engine_plugin.layouts import check_kv_cache_config

            check_kv_cache_config(self.kv_cache_config, pages=False)
        heads = first.shape[1]
        whole, _ = describe_cpu_kv(kv_caches, model=self.model, head_start=self.rank * heads,
                                   total_heads=self.total_kv_heads)
        handle = export_cpu_tensor(whole)  # moves the storage into shared memory in place
        # Addresses changed with the move: describe again from the live tensors.
        whole, self.layout = describe_cpu_kv(kv_caches, model=self.model, head_start=self.rank * heads,
                                             total_heads=self.total_kv_heads)
        self._whole = whole
        self.handle = handle
        atexit.register(self._unlink_export)  # a normal exit that skips shutdown() too
        self.client.attach(proto.Attach(self.engine_id, self.rank, self.tp_size, self.role, (handle,), self.layout))
        log.info("kvpush: KV cache (%d bytes, %d layers, %d blocks x %d tokens) attached to %s",
                 whole.numel(), self.layout.num_layers, self.layout.num_blocks, self.layout.block_size, self.endpoint)

    def _register_gpu_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """GPU: the layout from the attention backend in use (engine_plugin.layouts), one
        CUDA IPC handle per distinct allocation; anything not understood is refused here, at
        start-up, never attached as a guess."""
        from kvpush.engine_plugin.kv_export import export_cuda_tensor
        from kvpush.engine_plugin.layouts import derive_layout, engine_geometry, shape_for_backend

        geo = engine_geometry(self.vllm_config, self.kv_cache_config)
        shape = shape_for_backend(geo.backend, geo.layer_view_order)
        names = sorted(kv_caches, key=_layer_key)
        regions, self.layout = derive_layout(
            {n: kv_caches[n] for n in names}, shape, head_size=geo.head_size, num_kv_heads=geo.num_kv_heads,
            num_blocks=geo.num_blocks, head_start=self.rank * geo.num_kv_heads, total_heads=self.total_kv_heads,
            model=self.model)
        self._regions = regions  # keeps every exported allocation alive for the daemon
        handles = tuple(export_cuda_tensor(r) for r in regions)
        self.handle = None  # no shm file to unlink
        self.client.attach(proto.Attach(self.engine_id, self.rank, self.tp_size, self.role, handles, self.layout))
        log.info("kvpush: GPU KV cache (%s, %d layers in %d allocations, %d blocks x %d tokens) attached to %s",
                 geo.backend, self.layout.num_layers, len(regions), self.layout.num_blocks,
                 self.layout.block_size, self.endpoint)

    # ------------------------------------------------------------------ per step

    def publish(self, meta: KVPushMetadata) -> None:
        now = time.monotonic()
        if not (self.client.available and self.client.attached):
            self._handle(self.client.poll())  # an AttachAck or a liveness change may be waiting
        down = self._daemon_down()
        for r in meta.registers:
            self._recv[r.transfer_id] = _Pending(r.req_id, r.attempt, r.block_ids, now)
            self.trace.stamp(r.transfer_id, "d.plugin.register_published")  # before it can arrive
            sent = not down and self.client.send(proto.Register(
                r.transfer_id, r.attempt, tuple(r.block_ids), r.num_tokens, tuple(r.prefill_endpoints),
                r.prefill_tp_size, self.cfg.timeout_ms, r.first_token,
            ))
            if sent:
                self.counters.registered += 1
            else:
                self._fail_recv(r.transfer_id, "kvpush: daemon unavailable")
        for s in meta.sends:
            if s.early:
                self._after_forward.append(s)  # its KV is computed by this step's forward
            elif s.transfer_id in self._unconfirmed:
                self._confirm(s.transfer_id)  # vLLM finished it normally: may be freed now
            else:
                self._send[s.transfer_id] = s.req_id
                self._prefill_done(s, down)
        for a in meta.send_aborts:
            # Aborted after its early PrefillDone: the daemon must let go of the blocks first.
            if a.transfer_id in self._send and (down or not self.client.publish_abort(
                    a.transfer_id, a.attempt, "prefill request aborted")):
                self._finish_send(a.transfer_id)
            self._confirm(a.transfer_id)
        for a in meta.aborts:
            pending = self._recv.pop(a.transfer_id, None)
            if pending is None and a.transfer_id not in self._recv:
                # Already finished here (or never registered): nothing can land any more.
                self._finished_sending.add(a.req_id)
                continue
            self._releasing[a.transfer_id] = a.req_id
            if down or not self.client.publish_abort(a.transfer_id, a.attempt, "request aborted"):
                self._finished_sending.add(a.req_id)
                self._releasing.pop(a.transfer_id, None)

    def _prefill_done(self, s: SendReq, down: bool) -> None:
        self.trace.stamp(s.transfer_id, "p.plugin.prefill_done_published")  # before it can arrive
        if down or not self.client.publish_prefill_done(s.transfer_id, s.block_ids, s.num_tokens, self.cfg.lease_ms):
            self._finish_send(s.transfer_id)
        else:
            self.counters.prefill_done += 1
            if len(self._send_since) < 65536:  # bounded like everything the engine keeps
                self._send_since[s.transfer_id] = (time.monotonic(), len(s.block_ids))

    def after_forward(self) -> None:
        """Right after the step's forward (vLLM's wait_for_save): publish the PrefillDone of
        requests whose last prompt token this forward computed, a whole step earlier than
        request_finished could. Their blocks are reported free only once the scheduler
        confirmed that vLLM finished them (the plain SendReq or a send_abort)."""
        if not self._after_forward:
            return
        if self._whole is not None and self._whole.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the daemon reads what the kernels wrote
        down = self._daemon_down()
        batch, self._after_forward = self._after_forward, []
        for s in batch:
            self._send[s.transfer_id] = s.req_id
            self._unconfirmed.add(s.transfer_id)
            self._prefill_done(s, down)

    def _confirm(self, tid: str) -> None:
        if tid not in self._unconfirmed:
            return
        self._unconfirmed.discard(tid)
        rid = self._done_early.pop(tid, None)
        if rid is not None:
            self._finished_sending.add(rid)
            self._report_trace(tid)  # the daemon answered before vLLM finished the request

    def _daemon_down(self) -> bool:
        """Is the daemon known to be unreachable? Not merely "no answer yet": right after
        start-up the Attach is in flight and messages queue behind it. Down = it answered
        once and is now lost, or it never answered within the client's dead_after_s."""
        if not self.cfg.unavailable_fail or self.client.available:
            return False
        if self._daemon_id is not None:
            return True
        return time.monotonic() - self._created > self.client.dead_after_s

    def _fail_recv(self, tid: str, why: str) -> None:
        p = self._recv.pop(tid, None)
        if p is None:
            return
        self.counters.load_failed += 1
        self._load_errors.update(p.block_ids)
        self._finished_recving.add(p.req_id)
        self.trace.stamp(tid, "d.plugin.load_failed")
        log.debug("kvpush: load of %s failed: %s", tid, why)

    def _finish_send(self, tid: str) -> None:
        self._send_since.pop(tid, None)
        rid = self._send.pop(tid, None)
        if rid is None:
            return
        if tid in self._unconfirmed:
            self._done_early[tid] = rid  # vLLM has not finished the request yet: not free
        else:
            self._finished_sending.add(rid)

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
                and (self._recv or (self._send and self.tp_size > 1)) and self.client.available):
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
        self._expire(now)
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
        (_flush_traces): every zmq send wakes libzmq's I/O thread, which on a core shared
        with the engine preempts it, so one send per request per step was measurable."""
        events = self.trace.pop(tid)
        if not events:
            return
        if len(self._trace_out) == TRACE_BATCH_MAX:
            self.trace_dropped += 1  # the deque drops its oldest
        self._trace_out.append(proto.TraceReport(tid, tuple(h for h, _ in events), tuple(t for _, t in events)))

    def _flush_traces(self, now: float) -> None:
        quiet = self.idle_step or not (self._recv or self._send or self._releasing)
        if not self._trace_out or (len(self._trace_out) < TRACE_BATCH and now - self._trace_flushed < TRACE_FLUSH_S
                                   and not quiet):
            return
        self._trace_flushed = now
        batch = list(self._trace_out)
        self._trace_out.clear()
        if not self.client.available:
            self.trace_dropped += len(batch)
            return
        for msg in batch:  # back to back: libzmq's I/O thread wakes once for the lot
            if not self.client.send(msg):
                self.trace_dropped += 1

    def _handle(self, msgs: list[Any]) -> None:
        for m in msgs:
            tid = getattr(m, "transfer_id", None)
            if isinstance(m, proto.Received):
                p = self._recv.get(tid)
                if p is not None and p.attempt == m.attempt:
                    del self._recv[tid]
                    self.counters.received += 1
                    self.samples.record("load", time.monotonic() - p.since, len(p.block_ids) * self._block_bytes)
                    self._finished_recving.add(p.req_id)
                    self.trace.stamp(tid, "d.plugin.received_seen")
                    self._reported.append(tid)
            elif isinstance(m, proto.ReceiveFailed):
                p = self._recv.get(tid)
                if p is not None and p.attempt == m.attempt:
                    self._say_once("not received", tid, m.reason, "recomputing")
                    self._fail_recv(tid, m.reason)
            elif isinstance(m, (proto.Sent, proto.SendFailed)):
                if isinstance(m, proto.SendFailed):
                    self.counters.send_failed += 1
                    self._say_once("not sent", tid, m.reason, "its blocks are free")
                    self.trace.stamp(tid, "p.plugin.send_failed_seen")
                else:
                    self.counters.sent += 1
                    self.trace.stamp(tid, "p.plugin.sent_seen")
                    since = self._send_since.get(tid)
                    if since is not None:
                        self.samples.record("send", time.monotonic() - since[0], since[1] * self._block_bytes)
                self._finish_send(tid)
                if tid not in self._unconfirmed:  # else once vLLM finished it (_confirm)
                    self._report_trace(tid)
            elif isinstance(m, proto.Released):
                rid = self._releasing.pop(tid, None)
                if rid is not None:
                    self._finished_sending.add(rid)
                elif tid in self._send:  # an aborted prefill the daemon no longer held
                    self._finish_send(tid)
            elif isinstance(m, proto.Error):
                log.warning("kvpush: daemon error %s: %s (%s)", m.code, m.message, m.ref)
            elif isinstance(m, proto.AttachAck):
                if self._daemon_id is not None and m.daemon_id != self._daemon_id:
                    self._daemon_lost("daemon restarted")
                self._daemon_id = m.daemon_id
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
        for tid in list(self._recv):
            self._fail_recv(tid, why)
        for tid in list(self._send):
            self._finish_send(tid)
        for tid, rid in list(self._releasing.items()):
            self._finished_sending.add(rid)
            del self._releasing[tid]

    def _expire(self, now: float) -> None:
        """The engine never waits unbounded: a load with no answer long past its
        deadline fails (the daemon enforces the real deadline well before this)."""
        limit = 2 * self.cfg.timeout_ms / 1000.0 + 5.0
        for tid in [t for t, p in self._recv.items() if now - p.since > limit]:
            self._fail_recv(tid, "no answer from the daemon")

    def stats_totals(self) -> dict[str, int]:
        """Every counter of this rank, cumulative: the transfers' and the daemon link's."""
        link = {f"link_{k}": v for k, v in self.client.counters.as_dict().items()}
        return {**vars(self.counters), "trace_dropped": self.trace_dropped, **link}

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
