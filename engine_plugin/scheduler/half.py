"""Scheduler half of KVPushConnector: decides, never talks to the daemon.

Decode side: a request with ``do_remote_prefill`` claims its prompt for an async
load; once blocks are allocated it is staged for registration (the worker half
publishes Register next step, overlapping the prefill engine's compute).
Prefill side: a request with ``do_remote_decode`` that finished normally keeps
its blocks ("delay free") and is staged for PrefillDone; the worker half reports
it finished sending once the daemon says Sent or SendFailed. It answers with the
decode leg's params (its transfer ID and its daemons' endpoints), so that a serial
proxy, which forwards them verbatim to the decode engine, gets a push too; a serial
prefill leg carries no transfer ID and the engine names the transfer itself.

Each request's lifecycle (what it is waiting for, its transfer and attempt) is one record
of :mod:`kvpush.engine_plugin.scheduler.lifecycle`; this shell turns vLLM's hooks into its
events and its actions into vLLM's return values and the step's metadata.

Everything here runs on the engine loop and is O(requests touched).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from kvpush.common.machine import drive
from kvpush.engine_plugin.compat import finished_normally
from kvpush.engine_plugin.config import PluginConfig
from kvpush.engine_plugin.logonce import OncePer
from kvpush.engine_plugin.logs import plugin_logger
from kvpush.engine_plugin.metadata import KVPushMetadata
from kvpush.engine_plugin.scheduler import lifecycle as sl
from kvpush.engine_plugin.scheduler.cards import DaemonCards
from kvpush.proto.groups import STATE_BACKOFF, Group, clip_state, pack
from kvpush.proto.params import (
    DO_REMOTE_PREFILL,
    PROMPT_TRUNCATED,
    decode_leg,
    prefill_leg,
    prompt_truncated,
)
from kvpush.proto.trace import now_ns

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = plugin_logger(__name__)
WARN_KEY_SETS = 32  # distinct unusable decode-leg key sets logged, at most
_FOR_WORKER = frozenset({sl.Register, sl.Send, sl.AbortLoad, sl.SendAbort, sl.StreamAbort})


def _fresh_transfer_id() -> str:
    return f"kvps-{uuid.uuid4().hex}"


class KVPushScheduler:
    def __init__(self, cfg: PluginConfig, block_size: int, tp_size: int = 1, num_layers: int | None = None,
                 gpu: bool = False, prefix_caching: bool = True, kv_groups: int = 1,
                 group_kinds: tuple[Group, ...] = ()) -> None:
        self.cfg = cfg
        # Hybrid: each group as proto.groups.parse reads it. A model with state groups (Mamba,
        # linear attention) moves each one's running-state slot and the state after all but the
        # prompt's last token: its prefill legs drop that token, its decode legs load one less.
        self.group_kinds = group_kinds
        self.backoff = STATE_BACKOFF if any(k.state for k in group_kinds) else 0
        self.block_size = block_size
        self.cards = DaemonCards(cfg, tp_size)
        self.kv_groups = kv_groups  # KV cache groups (vLLM's hybrid allocator): > 1 never streams
        least = cfg.stream_min_tokens(num_layers, gpu)
        if kv_groups > 1 and least is not None:
            # A layer frame names no KV cache group: hybrid models push whole requests (their
            # groups' bytes; measured against streaming the dense KV: docs/results/layerwise-hybrid.md).
            log.info("kvpush: %d KV cache groups (a hybrid model): layer-wise streaming is off (layerwise=%s); "
                     "each request is pushed whole (docs/models.md)", kv_groups, cfg.layerwise)
            least = None
        self.lifecycle = sl.SchedulerLifecycle(block_size, name_transfer=_fresh_transfer_id,
                                               stream_min_tokens=least,
                                               stream_auto=cfg.layerwise == "auto", share_prefix=prefix_caching,
                                               group_sizes=tuple(0 if k.state else k.block_size
                                                                 for k in group_kinds))
        self._meta = KVPushMetadata()  # this step's, handed to the worker by build_connector_meta
        self._warned = OncePer(WARN_KEY_SETS)  # key sets of unusable decode legs already logged
        self._answer: Any = None  # the hook's return value among the actions being carried out

    def _apply(self, ev: sl.Event) -> Any:
        """Feed one event; put its actions in this step's metadata; return Claim/Hold if any."""
        self._answer = None
        drive(self.lifecycle, ev, self._carry_out)
        return self._answer

    def _carry_out(self, a: Any) -> None:
        meta = self._meta
        t = type(a)
        if t in _FOR_WORKER:  # the worker lifecycle's own event: handed over as it is
            meta.events.append(a)
        elif t is sl.Stamp:
            meta.stamps.append((a.transfer_id, a.hop, now_ns()))
        elif t is sl.StreamChunk:
            meta.streams.append(a)
        else:  # Claim, Defer, Hold: the hook's return value
            self._answer = a

    # ------------------------------------------------------------------ hooks

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        dleg = decode_leg(params)
        pleg = prefill_leg(params) if dleg is None else None
        if dleg is None and pleg is None:
            self._warn_unusable(params)
            return 0, False
        eps = self.cards.endpoints() if pleg is not None and pleg.serial else None
        num_prompt = self._loaded(request) if dleg is not None else request.num_prompt_tokens
        if dleg is not None and num_prompt <= num_computed_tokens:
            return 0, False  # (state groups) a local hit up to the token this engine computes anyway
        claim = self._apply(sl.Matched(request.request_id, time.monotonic(),
                                       num_prompt - num_computed_tokens, dleg, pleg,
                                       None if eps is None else tuple(eps), request.max_tokens == 1,
                                       num_prompt))
        if isinstance(claim, sl.Defer):
            return None, False  # vLLM skips the request this step and asks again
        return (claim.count, True) if claim is not None else (0, False)

    def _warn_unusable(self, params: dict[str, Any] | None) -> None:
        """A decode leg asks for remote prefill but names no usable prefill daemon: its prompt
        is computed here. Said once per set of keys (not per request), so it is not silent."""
        if not params or not params.get(DO_REMOTE_PREFILL):
            return
        keys = tuple(sorted(params))
        if not self._warned.first(keys):
            return  # said already (the set is bounded: clients choose the keys)
        log.warning("kvpush: a request asks for remote prefill but its kv_transfer_params (keys %s) name no "
                    "usable prefill daemon (kvpush needs transfer_id and prefill_endpoints, or remote_host, "
                    "remote_port and tp_size with pp_size 1): computing its prompt locally; further requests "
                    "with these keys are not logged", ", ".join(keys))

    def _loaded(self, request: Request) -> int:
        """The prompt tokens a decode leg loads: all but the ``backoff`` last (state groups)."""
        n = request.num_prompt_tokens
        return n - self.backoff if n > self.backoff else n

    def _clip(self, lists: Any) -> Any:
        """Each state group's list as its running-state slot (proto.groups.clip_state)."""
        kinds = self.group_kinds
        if not self.backoff or len(lists) != len(kinds):
            return lists
        return tuple(clip_state(ids, k.spec_blocks) if k.state else ids for ids, k in zip(lists, kinds, strict=True))

    def on_new_request(self, request: Request) -> None:
        """A prefill leg of a model with state groups computes its prompt without the last
        ``backoff`` tokens, once (a preempted request comes back with its params marked):
        the decode engine derives the last state from the one before it. A request that reads
        no prefix cache (prompt logprobs) loads nothing on D and is left whole."""
        params = request.kv_transfer_params
        n = self.backoff
        if (not n or prefill_leg(params) is None or prompt_truncated(params) or request.num_prompt_tokens <= n
                or request.prompt_token_ids is None or request.get_skip_reading_prefix_cache()):
            return
        del request.prompt_token_ids[-n:]
        del request._all_token_ids[-n:]
        request.num_prompt_tokens -= n
        request.max_tokens = 1
        params[PROMPT_TRUNCATED] = True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return  # the table's Allocated rows without tokens to load change nothing (a unit test checks)
        block_ids, kv_groups = pack(self._clip(blocks.get_block_ids()))
        self._apply(sl.Allocated(request.request_id, time.monotonic(), num_external_tokens, block_ids,
                                 self._loaded(request), decode_leg(request.kv_transfer_params), kv_groups))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_groups(request, (block_ids,))

    def request_finished_groups(self, request: Request,
                                lists: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """request_finished with one block list per KV cache group (vLLM's hybrid allocator)."""
        rid = request.request_id
        pleg = prefill_leg(request.kv_transfer_params)
        if pleg is None and self.lifecycle.state(rid) is None:
            return False, None  # not ours: no event at all
        eps = self.cards.endpoints() if pleg is not None else None
        ok = finished_normally(request.status)  # stop, length, repetition (engine_plugin.compat)
        block_ids, kv_groups = pack(self._clip(lists))
        hold = self._apply(sl.Finished(rid, time.monotonic(), ok, pleg, block_ids,
                                       request.num_prompt_tokens, None if eps is None else tuple(eps), kv_groups))
        answer = hold.answer if hold is not None else None
        if prompt_truncated(request.kv_transfer_params):  # its token is not the request's first (router)
            answer = {**(answer or {}), PROMPT_TRUNCATED: True}
        return hold is not None, answer

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPushMetadata:
        idle = scheduler_output.total_num_scheduled_tokens == 0
        lc = self.lifecycle
        streams = lc.stream_min_tokens is not None and bool(lc.count(sl.State.PREFILLING)
                                                              or lc.count(sl.State.CANDIDATE))
        if not idle and (lc.count(sl.State.LOADED) or lc.count(sl.State.CANDIDATE) or streams):
            scheduled = scheduler_output.num_scheduled_tokens
            new = {} if not (streams or lc.count(sl.State.CANDIDATE)) else {
                nr.req_id: sl.NewReq(len(nr.prompt_token_ids or ()), nr.num_computed_tokens,
                                     scheduled.get(nr.req_id, 0), *pack(self._clip(nr.block_ids)))
                for nr in scheduler_output.scheduled_new_reqs}
            self._apply(sl.Step(time.monotonic(), scheduled, new, self._cached(scheduler_output) if streams else {}))
        meta, self._meta = self._meta, KVPushMetadata()
        meta.idle = idle
        return meta

    def _cached(self, out: SchedulerOutput) -> dict[str, sl.CachedReq]:
        """The streamed requests among those scheduled again: where their chunk starts and
        the blocks vLLM added (or, resumed from preemption, gave them anew)."""
        c = getattr(out, "scheduled_cached_reqs", None)  # vLLM's always has it; a bench's stand-in may not
        if c is None:
            return {}
        lc = self.lifecycle
        resumed = getattr(c, "resumed_req_ids", ())
        return {rid: sl.CachedReq(c.num_computed_tokens[i], tuple(nb[0]) if (nb := c.new_block_ids[i]) else (),
                                  rid in resumed)
                for i, rid in enumerate(c.req_ids) if lc.streaming(rid)}

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        now = time.monotonic()
        for rid in output.finished_sending or ():
            self._apply(sl.SendingDone(rid, now))
        for rid in output.finished_recving or ():
            self._apply(sl.Recved(rid, now))

    def has_pending_push_work(self) -> bool:
        lc = self.lifecycle
        return bool(lc.count(sl.State.HELD) or lc.count(sl.State.RELEASING) or self._meta or self._meta.stamps)

    def has_pending_block_frees(self) -> bool:
        """Blocks held for the daemon (a finished prefill's until Sent, an aborted load's until
        Released) come back without a preemption; both waits are bounded (lease, timeout)."""
        lc = self.lifecycle
        return bool(lc.count(sl.State.HELD) or lc.count(sl.State.RELEASING))

    def sizes(self) -> dict[str, int]:
        """Every collection this half keeps, and its size (the soak benchmark's view)."""
        m = self._meta
        return {**{f"lifecycle.{k}": v for k, v in self.lifecycle.sizes().items()},
                "meta": len(m.events) + len(m.stamps) + len(m.streams),
                "warned": len(self._warned._seen)}
