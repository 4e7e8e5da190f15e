"""KVPushConnector: the vLLM facade, split into a scheduler half and a worker half.

Loaded by vLLM through ``kv_connector_module_path``::

    --kv-transfer-config '{"kv_connector": "KVPushConnector",
        "kv_connector_module_path": "kvpush.engine_plugin", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"daemon": "ipc:///run/kvpush/engine-{rank}.sock"}}'

The connector moves no bytes: the rank's kvpushd does (NIXL WRITEs out of the
engine process). This class only routes vLLM's hooks to the right half.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpush.engine_plugin import compat
from kvpush.engine_plugin.config import PluginConfig
from kvpush.engine_plugin.metadata import KVPushMetadata
from kvpush.engine_plugin.scheduler.half import KVPushScheduler
from kvpush.engine_plugin.stats import KVPushPromMetrics, KVPushStats, StatsDelta
from kvpush.engine_plugin.worker.half import KVPushWorker

try:  # vLLM's hybrid allocator contract (0.32+): one block list per KV cache group
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults as _TransferResults,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - an older vLLM: no hybrid groups reach a connector
    from dataclasses import dataclass as _dataclass
    from dataclasses import field as _field

    class SupportsHMA:  # type: ignore[no-redef]
        pass

    @_dataclass
    class _TransferResults:  # type: ignore[no-redef]
        finished_sending: set[str] = _field(default_factory=set)
        finished_recving: set[str] = _field(default_factory=set)
        failed_recving: set[str] = _field(default_factory=set)

try:  # vLLM's token-source tiers (0.32+): kvpush's tokens come from a peer engine
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _P2P: Any = CacheHitSource.P2P
except ImportError:  # pragma: no cover - an older vLLM counts them as unspecified
    _P2P = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVCacheAccess, KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def _refuse_hybrid(vllm_config: Any) -> None:
    """Models with layers kvpush cannot move (all sliding window, Mamba1, unknown kinds) are
    refused at start-up, naming their layer kinds (engine_plugin.model_kinds)."""
    from kvpush.engine_plugin.model_kinds import check_model

    mc = getattr(vllm_config, "model_config", None)
    hf = getattr(mc, "hf_text_config", None)
    if hf is not None:
        check_model(hf, os.path.basename(str(mc.model).rstrip("/")))


def _transferable_groups(kv_cache_config: Any) -> int:
    """How many KV cache groups the engine's requests have (1: dense or MLA)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return max(1, len(groups))


def _group_kinds(kv_cache_config: Any) -> tuple[Any, ...]:
    """A hybrid engine's groups as the daemons read them from its layout (proto.groups)."""
    from kvpush.proto.groups import describe, parse

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    return tuple(parse(describe(g.kv_cache_spec)) for g in groups) if len(groups) > 1 else ()


class KVPushConnector(KVConnectorBase_V1, SupportsHMA):
    if _P2P is not None:
        # get_external_cache_hit_sources (vLLM's base answers with this): every token kvpush
        # loads was pushed by a peer engine's daemon, as NIXL's and Mooncake's are.
        _cache_hit_source = _P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        compat.refuse_sleep_mode(vllm_config)  # vLLM 0.32 does not ask supports_sleep_mode
        compat.warn_if_untested()
        _refuse_hybrid(vllm_config)
        ktc = vllm_config.kv_transfer_config
        self.cfg = PluginConfig.from_extra(ktc.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = str(ktc.engine_id)
        self.scheduler: KVPushScheduler | None = None
        self.worker: KVPushWorker | None = None
        self._stats = StatsDelta()
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = KVPushScheduler(self.cfg, self.block_size,
                                             vllm_config.parallel_config.tensor_parallel_size,
                                             vllm_config.model_config.get_num_layers(vllm_config.parallel_config),
                                             gpu=str(vllm_config.device_config.device_type) != "cpu",
                                             prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
                                             kv_groups=_transferable_groups(kv_cache_config),
                                             group_kinds=_group_kinds(kv_cache_config))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            mc = vllm_config.model_config
            tp = vllm_config.parallel_config.tensor_parallel_size
            self.worker = KVPushWorker(
                self.cfg,
                engine_id=self.engine_id,
                role=_ROLES.get(ktc.kv_role or "kv_both", "both"),
                rank=get_tensor_model_parallel_rank(),
                tp_size=tp,
                model=os.path.basename(str(mc.model).rstrip("/")),
                total_kv_heads=mc.get_total_num_kv_heads(),
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
            )
        prefix = os.environ.get("KVPUSH_PROFILE_HOOKS")
        if prefix:  # opt-in: unset, no hook is wrapped and nothing costs anything
            from kvpush.engine_plugin.profiling import install

            install(self, "scheduler" if self.scheduler is not None else "worker", prefix,
                    meta={"engine_id": self.engine_id, "kv_role": str(ktc.kv_role)})

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """No layout of its own. The first hook vLLM's engine core calls with the model's config
        before it builds the KV cache (or fails to, for a Mamba hybrid without the hybrid
        allocator): a model kvpush cannot move is refused here, with its layer kinds."""
        _refuse_hybrid(vllm_config)
        return None

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        """A prefill leg of a model with state groups drops its prompt's last token (the decode
        engine computes it from the state before it, as vLLM's NixlConnector has it)."""
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """SupportsHMA: vLLM's hybrid allocator is on; one block list per KV cache group."""
        assert self.scheduler is not None
        return self.scheduler.request_finished_groups(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    def has_pending_block_frees(self) -> bool:
        """Blocks this connector holds will come back without a preemption (a prefill's
        held blocks once the daemon sent them, an aborted load's once nothing can land):
        vLLM then waits a step for them instead of preempting a running request."""
        return self.scheduler is not None and self.scheduler.has_pending_block_frees()

    # ------------------------------------------------------------------ engine set-up (classmethods)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """No (vLLM 0.33+ asks at config time): after a wake the KV cache lives in new
        physical pages that the daemon's mapping cannot follow."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Yes whenever layer-wise push can stream on a GPU: full CUDA graphs skip
        save_kv_layer, which reports each layer group's progress."""
        return compat.piecewise_needed(extra_config)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> KVCacheAccess:
        """vLLM 0.34+: the legacy allocation, which the daemon maps through CUDA IPC
        (KVCacheAccess.LEGACY_IPC keeps vLLM's VMM-backed KV cache off)."""
        return compat.legacy_ipc_access()  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Publish what the scheduler decided here, before the step's forward: vLLM calls
        # start_load_kv only after the forward (async loads), so a PrefillDone or Register
        # published there waited a whole forward of other requests (20-30 ms under load).
        # Nothing in it depends on this step's forward: PrefillDone names KV computed by an
        # earlier, finished step; registered blocks belong to requests this step skips.
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KVPushMetadata):
            self.worker.idle_step = connector_metadata.idle
            self.worker.begin_forward(connector_metadata.streams)
            if connector_metadata.stamps:  # first: a confirmation below may end a timeline
                self.worker.take_stamps(connector_metadata.stamps)
            if connector_metadata:
                self.worker.publish(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # the daemon writes into our blocks; nothing to start here

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # After each attention layer (vLLM's maybe_transfer_kv_layer): layer-wise progress.
        if self.worker is not None:
            self.worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        # Called right after the forward: early PrefillDones go out here.
        if self.worker is not None:
            self.worker.after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        sending, recving = self.worker.collect()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """As get_finished, with the failed loads of a hybrid engine by request (vLLM refuses
        block-level load errors there: block IDs are per KV cache group)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self.worker.take_failed_recving() if self.worker is not None else set()
        return _TransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()) | failed,
                                failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This rank's counts since the last call (None if nothing happened); vLLM sums the
        ranks' (KVPushStats.aggregate) and logs them once per interval."""
        if self.worker is None:
            return None
        return self._stats.take(self.worker.stats_totals(), self.worker.samples.take())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPushStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVPushPromMetrics:
        """``vllm:kvpush_*`` series on the engine's /metrics (vLLM calls this in its API server)."""
        return KVPushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
