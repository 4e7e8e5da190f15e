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

Everything here runs on the engine loop and is O(requests touched).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpush.engine_plugin.cards import DaemonCards
from kvpush.engine_plugin.connector_config import PluginConfig
from kvpush.engine_plugin.logonce import OncePer
from kvpush.engine_plugin.logs import plugin_logger
from kvpush.engine_plugin.metadata import AbortReq, KVPushMetadata, RegisterReq, SendReq
from kvpush.proto.params import DO_REMOTE_PREFILL, DecodeLeg, PrefillLeg, decode_leg, prefill_leg
from kvpush.proto.trace import now_ns

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = plugin_logger(__name__)
WARN_KEY_SETS = 32  # distinct unusable decode-leg key sets logged, at most


@dataclass
class _Recv:
    transfer_id: str
    attempt: int
    registered: bool = False


class KVPushScheduler:
    def __init__(self, cfg: PluginConfig, block_size: int, tp_size: int = 1) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.cards = DaemonCards(cfg, tp_size)
        self._named: dict[str, str] = {}  # prefill: req_id -> transfer ID this engine made (serial leg)
        self._meta = KVPushMetadata()
        self._recv: dict[str, _Recv] = {}  # decode: req_id -> live registration
        self._done_recv: set[str] = set()  # decode: loads finished (ok or failed); never re-claim
        self._held: set[str] = set()  # prefill: blocks held until finished_sending
        self._releasing: set[str] = set()  # decode: aborted, waiting for Released
        self._attempts: dict[str, int] = {}  # transfer_id -> last attempt used here
        self._first_step: dict[str, str] = {}  # decode: req_id -> transfer_id, load done, not yet stepped
        self._candidates: dict[str, str] = {}  # prefill: req_id -> transfer_id, may publish early
        self._early: dict[str, str] = {}  # prefill: req_id -> transfer_id published early
        self._warned = OncePer(WARN_KEY_SETS)  # key sets of unusable decode legs already logged

    # ------------------------------------------------------------------ decode side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        tid = self._prefill_tid(request)
        if tid is not None and request.max_tokens == 1 and rid not in self._early:
            # Its one output token is sampled by the step that ends its prompt: PrefillDone
            # can go out right after that forward instead of a step later.
            self._candidates[rid] = tid
        dleg = decode_leg(request.kv_transfer_params)
        if dleg is None:
            self._warn_unusable(request.kv_transfer_params)
            return 0, False
        if rid in self._done_recv or rid in self._recv:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        self._meta.stamps.append((dleg.transfer_id, "d.plugin.claim", now_ns()))
        return count, True

    def _prefill_tid(self, request: Request) -> str | None:
        """The transfer ID of a prefill leg: the router's, or one made here once per request for
        a serial proxy's leg (and only while this engine's daemons can be named in the answer:
        otherwise nothing would come for the blocks, so they are not held)."""
        leg: PrefillLeg | None = prefill_leg(request.kv_transfer_params)
        if leg is None:
            return None
        if leg.transfer_id is not None:
            return leg.transfer_id
        rid = request.request_id
        tid = self._named.get(rid)
        if tid is None:
            if self.cards.endpoints() is None:
                return None
            tid = self._named[rid] = f"kvps-{uuid.uuid4().hex}"
        return tid

    def _answer(self, tid: str) -> dict[str, Any] | None:
        """The decode leg's params this engine answers with (a serial proxy forwards them)."""
        eps = self.cards.endpoints()
        return None if eps is None else DecodeLeg(tid, eps, len(eps)).to_params()

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

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        leg = decode_leg(request.kv_transfer_params)
        if num_external_tokens <= 0 or leg is None or rid in self._recv:
            return
        block_ids = list(blocks.get_block_ids()[0])
        first_token = request.num_prompt_tokens - num_external_tokens
        if first_token % self.block_size:
            # A local hit that ends inside a block cannot be a block boundary: load it all.
            first_token -= first_token % self.block_size
        first_block = first_token // self.block_size
        tid = leg.transfer_id
        attempt = self._attempts.get(tid, -1) + 1
        self._attempts[tid] = attempt
        self._recv[rid] = _Recv(tid, attempt, True)
        self._meta.registers.append(RegisterReq(
            rid, tid, attempt, block_ids[first_block:], request.num_prompt_tokens, first_token,
            list(leg.prefill_endpoints), leg.prefill_tp_size,
        ))

    # ------------------------------------------------------------------ both sides

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        recv = self._recv.pop(rid, None)
        self._done_recv.discard(rid)
        self._first_step.pop(rid, None)
        if recv is not None:
            # Decode request gone while its registration is live (client abort): the
            # blocks must not be reused until no WRITE can land in them any more.
            self._meta.aborts.append(AbortReq(rid, recv.transfer_id, recv.attempt))
            self._releasing.add(rid)
            return True, None
        self._candidates.pop(rid, None)
        early = self._early.pop(rid, None)
        named = self._named.pop(rid, None)
        leg = prefill_leg(request.kv_transfer_params)
        serial = leg is not None and leg.serial
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if early is not None:
            # PrefillDone is out: the daemon may be reading these blocks. Hold them until it
            # answers; tell the worker how the request ended (it reports them free only then).
            self._held.add(rid)
            answer = self._answer(early) if ok else None
            if ok and (answer is not None or not serial):
                self._meta.stamps.append((early, "p.plugin.prefill_finished", now_ns()))
                self._meta.sends.append(SendReq(rid, early, list(block_ids), request.num_prompt_tokens))
            else:  # aborted, or a serial leg nobody will fetch: let go at once
                self._meta.send_aborts.append(AbortReq(rid, early, 0))
            return True, answer
        if leg is None or not ok or not block_ids:
            return False, None
        tid = named or leg.transfer_id or f"kvps-{uuid.uuid4().hex}"
        answer = self._answer(tid)
        if answer is None and serial:
            return False, None  # a serial leg nobody can fetch (no daemon card): free the blocks now
        self._held.add(rid)
        self._meta.stamps.append((tid, "p.plugin.prefill_finished", now_ns()))
        self._meta.sends.append(SendReq(rid, tid, list(block_ids), request.num_prompt_tokens))
        return True, answer

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVPushMetadata:
        meta, self._meta = self._meta, KVPushMetadata()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        if self._candidates and not meta.idle:
            scheduled = scheduler_output.num_scheduled_tokens
            for nr in scheduler_output.scheduled_new_reqs:
                tid = self._candidates.pop(nr.req_id, None)
                if tid is None:
                    continue
                n_prompt = len(nr.prompt_token_ids or ())
                if n_prompt and nr.num_computed_tokens + scheduled.get(nr.req_id, 0) >= n_prompt:
                    # The whole prompt is computed by this step (no chunking): early path.
                    self._early[nr.req_id] = tid
                    meta.sends.append(SendReq(nr.req_id, tid, list(nr.block_ids[0]), n_prompt, early=True))
        if self._first_step and not meta.idle:
            # The first forward after a finished load: the end of the transfer's timeline.
            scheduled = scheduler_output.num_scheduled_tokens
            t = now_ns()
            for rid in [r for r in self._first_step if r in scheduled]:
                meta.stamps.append((self._first_step.pop(rid), "d.plugin.first_decode_step", t))
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_sending or ():
            self._held.discard(rid)
            self._releasing.discard(rid)
        for rid in output.finished_recving or ():
            recv = self._recv.pop(rid, None)
            if recv is not None:
                self._done_recv.add(rid)
                self._first_step[rid] = recv.transfer_id

    def has_pending_push_work(self) -> bool:
        return bool(self._held or self._releasing or self._meta or self._meta.stamps)
