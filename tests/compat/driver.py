"""Drive KVPushConnector with one vLLM release's own Scheduler; print per-scenario results.

Run in a child process, one per release, by ``tests/compat/test_vllm_releases.py``: the
release's Python tree first on ``PYTHONPATH`` (or the installed vLLM), and
``VLLM_TARGET_DEVICE=cpu``. Importing vLLM takes 12-21 s, so every scenario of a release
runs in this one process and the results go back as one JSON document (``--out``).

What is vLLM's and what is played here:

* vLLM's: ``EngineArgs.create_engine_config`` (config validation, the connector factory
  resolving ``KVPushConnector`` by module path or by its registered name), ``Scheduler``
  (which builds the scheduler-side connector itself), ``Request``, ``SamplingParams``,
  ``KVCacheConfig``, ``ModelRunnerOutput`` and ``KVConnectorOutput``.
* Played: the model runner and the worker half. Each step samples one token for every
  request whose prompt is computed; what the worker would report from the daemon
  (``finished_recving``, ``finished_sending``, ``invalid_block_ids``) is given by the scenario
  after reading the step's ``KVPushMetadata``, as the worker half does.

No daemon is needed: the scheduler half never talks to one. The model is a folder with a
``config.json`` only (``skip_tokenizer_init``); nothing runs a kernel. Prefix caching is off
(no block hasher is played); vLLM 0.34's check that an x86 CPU build has Triton is bypassed
for the config step only (no kernel runs).

    python tests/compat/driver.py --out results.json [--only scenario ...]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

# The scenarios, in the order they run; the test module parametrizes over these names
# without importing vLLM, so they are listed here, not discovered.
SCENARIOS: tuple[str, ...] = (
    "factory_and_config",
    "hook_signatures",
    "sleep_mode_refused",
    "cudagraph_piecewise",
    "kv_cache_access",
    "decode_loads_then_runs",
    "decode_load_error_recomputes",
    "decode_abort_while_loading",
    "decode_abort_immediately",
    "decode_preempted_recomputes_locally",
    "prefill_sends_early_holds_frees",
    "prefill_chunked_sends_when_finished",
    "prefill_preempted_resumes_new_epoch",
    "prefill_abort_immediately_withdraws",
    "prefill_held_blocks_avoid_preemption",
    "finish_stopped",
    "finish_length_capped",
    "finish_repetition",
    "finish_aborted",
    "finish_error",
    "finish_ignored",
)

BLOCK = 16
LAYERS = 4
DAEMON = "ipc:///nonexistent/kvpush-compat/engine-{rank}.sock"  # never dialled: scheduler side only
D_LEG = {"do_remote_prefill": True, "transfer_id": "t-d", "prefill_endpoints": ["tcp://10.0.0.1:17500"],
         "prefill_tp_size": 1}
EOS = 2


class Failed(AssertionError):
    pass


def check(cond: Any, what: str) -> None:
    if not cond:
        raise Failed(what)


def p_leg(tid: str) -> dict[str, Any]:
    return {"do_remote_decode": True, "transfer_id": tid}


# ============================================================================ the release


class Release:
    """vLLM as imported here, and builders that work across 0.32-0.34."""

    def __init__(self) -> None:
        t0 = time.monotonic()
        import vllm
        from vllm.engine.arg_utils import EngineArgs
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
        from vllm.v1.request import Request, RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager

        self.import_s = time.monotonic() - t0
        self.vllm = vllm
        self.version = str(vllm.__version__)
        self.EngineArgs, self.SamplingParams, self.Scheduler = EngineArgs, SamplingParams, Scheduler
        self.FullAttentionSpec, self.KVCacheConfig, self.KVCacheGroupSpec = FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        self.KVConnectorOutput, self.ModelRunnerOutput = KVConnectorOutput, ModelRunnerOutput
        self.Request, self.RequestStatus, self.SOM = Request, RequestStatus, StructuredOutputManager
        self.model_dir = tempfile.mkdtemp(prefix="kvpush-compat-model-")
        with open(os.path.join(self.model_dir, "config.json"), "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                       "intermediate_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "vocab_size": 3000, "bos_token_id": 1, "eos_token_id": EOS,
                       "pad_token_id": 3, "max_position_embeddings": 4096, "tie_word_embeddings": False,
                       "torch_dtype": "float32"}, f)
        self._configs: dict[str, Any] = {}
        self.notes: dict[str, str] = {}

    @contextlib.contextmanager
    def _no_triton_check(self) -> Iterator[None]:
        """0.34 refuses an x86 CPU build without triton-cpu at config time; nothing here runs
        a kernel, so the config step is told Triton is there."""
        try:
            import vllm.triton_utils as tu
        except Exception:
            yield
            return
        had = getattr(tu, "HAS_TRITON", None)
        tu.HAS_TRITON = True
        try:
            yield
        finally:
            tu.HAS_TRITON = had

    def config(self, role: str = "kv_both", extra: dict[str, Any] | None = None, by_name: bool = False,
               **engine: Any) -> Any:
        ktc: dict[str, Any] = {"kv_connector": "KVPushConnector", "kv_role": role,
                               "kv_load_failure_policy": "recompute",
                               "kv_connector_extra_config": {"daemon": DAEMON, **(extra or {})}}
        if not by_name:
            ktc["kv_connector_module_path"] = "kvpush.engine_plugin"
        key = json.dumps([ktc, engine], sort_keys=True)
        if key not in self._configs:
            kw = dict(model=self.model_dir, skip_tokenizer_init=True, enforce_eager=True, max_model_len=2048,
                      block_size=BLOCK, enable_prefix_caching=False, kv_transfer_config=ktc, **engine)
            with self._no_triton_check():
                self._configs[key] = self.EngineArgs(**kw).create_engine_config()
        return self._configs[key]

    def scheduler(self, cfg: Any, num_blocks: int = 64) -> Any:
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = self.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=_torch().float32)
        kcc = self.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                 kv_cache_groups=[self.KVCacheGroupSpec(names, spec)])
        cfg.cache_config.num_gpu_blocks = num_blocks
        params = inspect.signature(self.Scheduler.__init__).parameters
        kw: dict[str, Any] = {"block_size": BLOCK, "log_stats": True}
        return self.Scheduler(cfg, kcc, self.SOM(cfg), **{k: v for k, v in kw.items() if k in params})


def _torch() -> Any:
    import torch

    return torch


# ============================================================================ one engine


class Engine:
    """vLLM's Scheduler with a played model runner and worker half."""

    def __init__(self, rel: Release, cfg: Any, num_blocks: int = 64) -> None:
        self.rel = rel
        self.s = rel.scheduler(cfg, num_blocks)
        self.c = self.s.connector
        check(type(self.c).__name__ == "KVPushConnector", f"the scheduler built {type(self.c).__name__}")
        self.pool = self.s.kv_cache_manager.block_pool
        self.free0 = self.pool.get_num_free_blocks()
        self.metas: list[Any] = []
        self.outputs: list[Any] = []
        self.finished: dict[str, Any] = {}  # req_id -> FinishReason, as the engine's client sees it
        self.sample: dict[str, list[int]] = {}  # req_id -> tokens to sample, in order (default 7)

    def add(self, rid: str, n: int, params: dict[str, Any] | None = None, max_tokens: int = 4,
            **kw: Any) -> Any:
        sp_kw: dict[str, Any] = {"max_tokens": max_tokens}
        if params is not None:
            sp_kw["extra_args"] = {"kv_transfer_params": params}
        sp_kw.update(kw.pop("sampling", {}))
        sp = self.rel.SamplingParams(**sp_kw)
        r = self.rel.Request(rid, list(range(10, 10 + n)), sp, None, **kw)
        self.s.add_request(r)
        return r

    def free(self) -> int:
        return int(self.pool.get_num_free_blocks())

    def blocks(self, rid: str) -> list[int]:
        return list(self.s.kv_cache_manager.get_block_ids(rid)[0])

    def step(self, *, recved: set[str] | None = None, sent: set[str] | None = None,
             invalid: set[int] | None = None) -> tuple[Any, Any]:
        """One engine step: schedule (the connector's metadata is built in it), the played
        forward, then update_from_output with what the worker half reports this step."""
        out = self.s.schedule()
        meta = out.kv_connector_metadata
        check(type(meta).__name__ == "KVPushMetadata", f"metadata is {type(meta).__name__}")
        self.metas.append(meta)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            r = self.s.requests[rid]
            if r.num_computed_tokens >= r.num_tokens:  # the prompt (and earlier outputs) computed
                queue = self.sample.get(rid)
                sampled.append([queue.pop(0) if queue else 7])
            else:
                sampled.append([])  # a chunk of the prompt: nothing sampled
        kv = None
        if recved or sent or invalid:
            kv = self.rel.KVConnectorOutput(finished_sending=set(sent or ()) or None,
                                            finished_recving=set(recved or ()) or None,
                                            invalid_block_ids=set(invalid or ()))
        eco = self.s.update_from_output(out, self.runner_output(req_ids, sampled, kv))
        for outs in (eco or {}).values():
            for o in getattr(outs, "outputs", ()) or ():
                if getattr(o, "finish_reason", None) is not None:
                    self.finished[o.request_id] = o.finish_reason
        return out, meta

    def report(self, *, recved: set[str] | None = None, sent: set[str] | None = None,
               invalid: set[int] | None = None) -> None:
        """The worker's report arriving with an idle step's output."""
        self.step(recved=recved, sent=sent, invalid=invalid)

    def runner_output(self, req_ids: list[str], sampled: list[list[int]], kv: Any) -> Any:
        cls = self.rel.ModelRunnerOutput
        kw: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled, "kv_connector_output": kv}
        for f in dataclasses.fields(cls):
            if f.name == "req_id_to_index":  # 0.32 / 0.33 only
                kw[f.name] = {r: i for i, r in enumerate(req_ids)}
            elif f.name not in kw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                kw[f.name] = {} if "dict" in f.name else None
        return cls(**kw)

    def abort(self, rid: str, status: str = "FINISHED_ABORTED") -> None:
        self.s.finish_requests([rid], getattr(self.rel.RequestStatus, status))

    def idle(self, n: int = 1) -> None:
        for _ in range(n):
            self.step()

    def run_until(self, cond: Callable[[], bool], limit: int = 200, **report: Any) -> None:
        for _ in range(limit):
            if cond():
                return
            self.step(**report)
            report = {}
        raise Failed("condition not reached in time")


def of(meta: Any, kind: str) -> list[Any]:
    """The step's events of one kind: the worker lifecycle's own ("Register", "Send",
    "AbortLoad", "SendAbort", "StreamAbort"), as the scheduler half put them in the metadata."""
    return [x for x in meta.events if type(x).__name__ == kind]


def registers(meta: Any) -> list[Any]:
    return of(meta, "Register")


def all_of(e: Engine, kind: str) -> list[Any]:
    return [x for m in e.metas for x in of(m, kind)]


# ============================================================================ scenarios


def factory_and_config(rel: Release) -> str:
    """Config validation resolves the class by module path, and by the name kvpush's
    vllm.general_plugins entry registers; each role builds its scheduler-side connector."""
    from kvpush.engine_plugin.vllm_plugin import register

    for role in ("kv_producer", "kv_consumer", "kv_both"):
        e = Engine(rel, rel.config(role))
        check(e.c.scheduler is not None and e.c.worker is None, "a scheduler-side connector has its scheduler half")
        check(e.s.recompute_kv_load_failures, "kv_load_failure_policy recompute reached the scheduler")
    register()
    e = Engine(rel, rel.config("kv_consumer", by_name=True))
    return f"by module path (3 roles) and by registered name: {type(e.c).__module__}"


_NEWER_HOOKS = {"supports_sleep_mode": (0, 33), "kv_cache_access": (0, 34), "has_pending_block_frees": (0, 32)}


def hook_signatures(rel: Release) -> str:
    """Every hook kvpush's connector overrides exists in this release's base class (or its
    ``SupportsHMA`` interface, for the hybrid allocator's hook) with the same parameters (a
    renamed or reshaped hook would silently never be called)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    from kvpush.engine_plugin.compat import release_tuple
    from kvpush.engine_plugin.connector import KVPushConnector

    have = release_tuple(rel.version)[:2]
    checked, absent = [], []
    for name in list(vars(KVPushConnector)):
        if name.startswith("_") or not callable(getattr(KVPushConnector, name, None)):
            continue
        base = getattr(KVConnectorBase_V1, name, None) or getattr(SupportsHMA, name, None)
        if base is None:
            since = _NEWER_HOOKS.get(name)
            check(since is not None and have < since,
                  f"{name} is not a hook of vLLM {rel.version}'s KVConnectorBase_V1")
            absent.append(name)
            continue
        ours = [p for p in inspect.signature(getattr(KVPushConnector, name)).parameters if p != "self"]
        theirs = [p for p in inspect.signature(base).parameters if p != "self"]
        check(ours[:len(theirs)] == theirs or ours == theirs,
              f"{name}{tuple(ours)} does not match vLLM {rel.version}'s {name}{tuple(theirs)}")
        checked.append(name)
    check(issubclass(KVPushConnector, SupportsHMA), "KVPushConnector is not SupportsHMA: vLLM turns its hybrid allocator off")
    abstract = sorted({*getattr(KVConnectorBase_V1, "__abstractmethods__", ()),
                       *getattr(SupportsHMA, "__abstractmethods__", ())})
    missing = [m for m in abstract if m not in vars(KVPushConnector)]
    check(not missing, f"abstract hooks not implemented: {missing}")
    return f"{len(checked)} hooks match" + (f"; not in this release: {', '.join(absent)}" if absent else "")


def sleep_mode_refused(rel: Release) -> str:
    """--enable-sleep-mode with kvpush stops the engine at start-up: vLLM 0.33+ asks
    supports_sleep_mode when it validates the config; 0.32 does not, and the connector
    refuses when it is built. (A CPU platform refuses sleep mode before either, so the flag
    is set on a validated config and vLLM's own check of the connector is run on it.)"""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = rel.config("kv_consumer", max_num_seqs=3)  # its own config: the flag is set on it
    cls = KVConnectorFactory.get_connector_class(cfg.kv_transfer_config)
    check(cls.supports_sleep_mode(cfg.kv_transfer_config) is False, "supports_sleep_mode is not False")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    asks = hasattr(KVConnectorBase_V1, "supports_sleep_mode")
    cfg.model_config.enable_sleep_mode = True
    try:
        if asks:
            try:
                cfg._verify_kv_transfer_compat()
            except ValueError as e:
                check("does not support sleep mode" in str(e), f"refused for another reason: {e}")
                return f"vLLM refused at config time: {e}"
            raise Failed("vLLM's config validation let sleep mode through with kvpush")
        try:
            Engine(rel, cfg)
        except Exception as e:
            check("sleep mode" in str(e), f"refused for another reason: {e}")
            return f"this release does not ask; the connector refused at start-up: {str(e)[:100]}"
        raise Failed("an engine with sleep mode started with kvpush")
    finally:
        cfg.model_config.enable_sleep_mode = False


def cudagraph_piecewise(rel: Release) -> str:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory.get_connector_class(rel.config("kv_producer").kv_transfer_config)
    got = {mode: cls.requires_piecewise_for_cudagraph({"daemon": DAEMON, "layerwise": mode})
           for mode in ("on", "auto", "off")}
    check(got == {"on": True, "auto": False, "off": False}, f"requires_piecewise_for_cudagraph: {got}")
    return f"requires_piecewise_for_cudagraph {got}"


def kv_cache_access(rel: Release) -> str:
    ktc = rel.config("kv_producer").kv_transfer_config
    if not hasattr(ktc, "kv_cache_access"):
        from kvpush.engine_plugin.compat import release_tuple

        check(release_tuple(rel.version)[:2] < (0, 34), "vLLM 0.34+ must ask kv_cache_access")
        return "this release does not ask (no KVCacheAccess): the legacy allocation is its only one"
    from vllm.config.kv_transfer import KVCacheAccess

    access = ktc.kv_cache_access()  # vLLM's own path: the factory asks the connector class
    check(access == KVCacheAccess.LEGACY_IPC, f"kv_cache_access through vLLM's factory: {access!r}")
    cfg = rel.config("kv_producer")
    ext = getattr(cfg.cache_config, "enable_extensible_kv_cache", None)
    check(ext is not True, f"enable_extensible_kv_cache resolved to {ext!r} with LEGACY_IPC asked")
    return f"kv_cache_access {access!r}; extensible KV cache {ext!r}"


def _load(e: Engine, rid: str, n: int = 40, max_tokens: int = 2, leg: dict[str, Any] | None = None) -> Any:
    """A decode leg: claimed, allocated, registered; returns the Register."""
    r = e.add(rid, n, dict(leg or D_LEG), max_tokens=max_tokens)
    out, meta = e.step()
    check(out.total_num_scheduled_tokens == 0 or rid not in out.num_scheduled_tokens,
          "a request waiting for remote KV was scheduled")
    check(r.status == e.rel.RequestStatus.WAITING_FOR_REMOTE_KVS, f"status {r.status}")
    (reg,) = [x for x in registers(meta) if x.req_id == rid]
    return reg


def decode_loads_then_runs(rel: Release) -> str:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    e = Engine(rel, rel.config("kv_consumer"))
    reg = _load(e, "d1", 40, max_tokens=2)
    check(reg.transfer_id == "t-d" and reg.attempt == 0, f"register {reg}")
    check(list(reg.block_ids) == e.blocks("d1") and len(reg.block_ids) == 3, f"registered {reg.block_ids}, "
          f"vLLM allocated {e.blocks('d1')}")
    check(reg.num_tokens == 40 and reg.first_token == 0, f"register tokens {reg.num_tokens}/{reg.first_token}")
    check(reg.prefill_endpoints == ("tcp://10.0.0.1:17500",), f"endpoints {reg.prefill_endpoints}")
    e.idle(2)  # still waiting: nothing scheduled, no second registration
    check(not any(registers(m) for m in e.metas[1:]), "registered twice")
    src = e.c.get_external_cache_hit_sources(e.s.requests["d1"], 39)
    check(src == {CacheHitSource.P2P: 39}, f"external cache-hit source {src}")
    out, _ = e.step(recved={"d1"})  # the worker: Received
    out, _ = e.step()
    check(out.num_scheduled_tokens.get("d1") == 1, f"after the load vLLM schedules {out.num_scheduled_tokens}")
    e.run_until(lambda: "d1" in e.finished)
    check(e.finished["d1"].name == "LENGTH", f"finished {e.finished['d1']}")
    e.idle()
    check(e.free() == e.free0, f"blocks not all back: {e.free()} of {e.free0}")
    check(not e.c.has_pending_push_work() and not e.c.has_pending_block_frees(), "work left")
    return "registered 3 blocks while waiting; after Received one token scheduled; P2P source"


def decode_load_error_recomputes(rel: Release) -> str:
    e = Engine(rel, rel.config("kv_consumer"))
    reg = _load(e, "d1", 40, max_tokens=2)
    e.step(recved={"d1"}, invalid={reg.block_ids[1]})  # the daemon failed the load (ReceiveFailed)
    out, meta = e.step()
    n = out.num_scheduled_tokens.get("d1", 0)
    check(n >= 40 - BLOCK, f"after a failed load vLLM schedules {n} tokens (recompute from the bad block)")
    check(not registers(meta), "registered again after the failure")
    e.run_until(lambda: "d1" in e.finished)
    check(e.finished["d1"].name == "LENGTH", f"finished {e.finished['d1']} (a load error must not fail it)")
    e.idle()
    check(e.free() == e.free0, "blocks not all back")
    return f"recomputed {n} tokens, finished normally"


def decode_abort_while_loading(rel: Release) -> str:
    e = Engine(rel, rel.config("kv_consumer"))
    reg = _load(e, "d1")
    used = e.free0 - e.free()
    e.abort("d1")
    check(e.c.has_pending_block_frees(), "no pending block frees while an aborted load's blocks are held")
    _, meta = e.step()
    aborts = of(meta, "AbortLoad")
    check([(a.transfer_id, a.attempt) for a in aborts] == [("t-d", reg.attempt)], f"aborts {aborts}")
    check(e.free0 - e.free() == used, "blocks freed while a WRITE may still land in them")
    check(e.s.has_requests(), "the engine stops stepping while blocks wait for the daemon")
    e.report(sent={"d1"})  # the worker: Released
    e.idle()
    check(e.free() == e.free0 and not e.c.has_pending_block_frees(), "blocks not back after Released")
    return "abort published, blocks held until Released, then freed"


def decode_abort_immediately(rel: Release) -> str:
    """A decode leg rejected while the engine is paused: added with abort_immediately and
    aborted before any hook but request_finished (vLLM's EngineCore.add_request)."""
    e = Engine(rel, rel.config("kv_consumer"))
    params = inspect.signature(rel.Request.__init__).parameters
    check("abort_immediately" in params, "this release's Request has no abort_immediately")
    e.add("d1", 40, dict(D_LEG), abort_immediately=True)
    e.abort("d1")
    _, meta = e.step()
    check(not registers(meta) and not of(meta, "AbortLoad"), "a never-registered load published something")
    check("d1" not in e.s.requests and e.free() == e.free0, "the request or its blocks stayed")
    check(not e.c.has_pending_push_work() and e.c.scheduler.lifecycle.live_count() == 0, "a record stayed")
    return "nothing registered, nothing held (the prefill side's lease bounds its blocks)"


def decode_preempted_recomputes_locally(rel: Release) -> str:
    """A loaded decode request preempted later is recomputed by its own engine: kvpush never
    claims it again (its transfer is over)."""
    e = Engine(rel, rel.config("kv_consumer"), num_blocks=9)  # 8 usable blocks
    e.add("local", 48, None, max_tokens=40)
    _load(e, "d1", 48, max_tokens=40)
    e.step(recved={"d1"})
    e.run_until(lambda: e.s.requests["d1"].num_preemptions > 0 if "d1" in e.s.requests else True)
    check("d1" in e.s.requests, "d1 finished before it was preempted")
    e.run_until(lambda: "d1" in e.finished, limit=400)
    check(e.finished["d1"].name == "LENGTH", f"finished {e.finished['d1']}")
    regs = [x for x in all_of(e, "Register") if x.req_id == "d1"]
    check(len(regs) == 1, f"registered {len(regs)} times")
    e.run_until(lambda: "local" in e.finished, limit=400)
    e.idle()
    check(e.free() == e.free0, "blocks not all back")
    return "preempted after its load; recomputed locally, one registration"


def prefill_sends_early_holds_frees(rel: Release) -> str:
    e = Engine(rel, rel.config("kv_producer"))
    e.add("p1", 40, p_leg("t-p1"), max_tokens=1)
    out, meta = e.step()
    check(out.num_scheduled_tokens.get("p1") == 40, f"scheduled {out.num_scheduled_tokens}")
    (early,) = of(meta, "Send")
    check(early.early and early.transfer_id == "t-p1" and early.num_tokens == 40, f"send {early}")
    check("p1" in e.finished and e.finished["p1"].name == "LENGTH", "the one-token request did not finish")
    held = e.free0 - e.free()
    check(held == 3, f"{held} blocks held after the finish (3 expected: delay free)")
    check(e.c.has_pending_push_work() and e.s.has_requests(), "the engine would stop stepping while blocks are held")
    check(e.c.has_pending_block_frees(), "no pending block frees while blocks are held")
    _, meta = e.step()  # the confirmation, with the step after request_finished
    (conf,) = of(meta, "Send")
    check(not conf.early and conf.block_ids == early.block_ids, f"confirmation {conf}")
    e.idle(2)
    check(e.free0 - e.free() == 3, "blocks freed before the daemon said Sent")
    e.report(sent={"p1"})
    e.idle()
    check(e.free() == e.free0, "blocks not freed after Sent")
    check(not e.c.has_pending_push_work() and not e.s.has_requests(), "work left after Sent")
    return "PrefillDone with the prompt's forward, 3 blocks held until Sent, then freed"


def prefill_chunked_sends_when_finished(rel: Release) -> str:
    e = Engine(rel, rel.config("kv_producer", max_num_batched_tokens=64, max_num_seqs=4))
    e.add("p1", 100, p_leg("t-p1"), max_tokens=2)
    chunks = []
    for _ in range(10):
        out, meta = e.step()
        chunks.append(out.num_scheduled_tokens.get("p1", 0))
        check(not of(meta, "Send") or "p1" in e.finished, "PrefillDone before vLLM finished the request")
        if "p1" in e.finished:
            break
    check(chunks[:2] == [64, 36], f"chunks {chunks}")
    _, meta = e.step()
    (send,) = all_of(e, "Send")
    check(not send.early and send.num_tokens == 100 and len(send.block_ids) == 7, f"send {send}")
    e.report(sent={"p1"})
    e.idle()
    check(e.free() == e.free0, "blocks not freed after Sent")
    return f"prompt in chunks {chunks[:2]}; PrefillDone once finished, 7 blocks"


def prefill_preempted_resumes_new_epoch(rel: Release) -> str:
    """Layer-wise on: a preempted prefill resumes (0.32/0.33: CachedRequestData.resumed_req_ids;
    0.34: as a new request) and streams again in a new epoch, into its new blocks."""
    e = Engine(rel, rel.config("kv_producer", extra={"layerwise": "on", "layer_group": 2}), num_blocks=9)
    e.add("a", 48, p_leg("t-a"), max_tokens=40)
    e.add("b", 48, p_leg("t-b"), max_tokens=40)
    out, meta = e.step()
    first = {c.transfer_id: c for c in meta.streams}
    check(set(first) == {"t-a", "t-b"} and all(c.epoch == 0 for c in first.values()), f"streams {meta.streams}")
    e.run_until(lambda: e.s.requests["b"].num_preemptions > 0)
    e.run_until(lambda: "a" in e.finished, limit=400)
    e.step()
    e.report(sent={"a"})
    resumed_as = None
    for _ in range(50):
        out, meta = e.step()
        if "b" in out.num_scheduled_tokens:
            new = {nr.req_id for nr in out.scheduled_new_reqs}
            resumed_as = "a new request" if "b" in new else "resumed_req_ids"
            break
    check(resumed_as is not None, "b never resumed")
    again = [c for c in meta.streams if c.transfer_id == "t-b"]
    check(len(again) == 1 and again[0].epoch == 1, f"resumed streams {meta.streams}")
    check(again[0].first_token == 0 and again[0].block_ids == e.blocks("b")[:3],
          f"resumed chunk {again[0]} vs blocks {e.blocks('b')}")
    e.run_until(lambda: "b" in e.finished, limit=400)
    e.step()
    (send,) = [s for s in all_of(e, "Send") if s.transfer_id == "t-b"]
    check(send.streamed and send.epoch == 1, f"seal {send}")
    e.report(sent={"b"})
    e.idle()
    check(e.free() == e.free0, "blocks not all back")
    return f"resumed as {resumed_as}; streamed again in epoch 1 into its new blocks; sealed in epoch 1"


def prefill_abort_immediately_withdraws(rel: Release) -> str:
    e = Engine(rel, rel.config("kv_producer"))
    e.add("p1", 40, p_leg("t-p1"), max_tokens=1, abort_immediately=True)
    e.abort("p1")
    _, meta = e.step()
    withdrawn = of(meta, "StreamAbort")
    check([a.transfer_id for a in withdrawn] == ["t-p1"],
          f"withdrawn {withdrawn} (a decode side registered for it would wait out its timeout)")
    check(not of(meta, "Send") and e.free() == e.free0 and not e.c.has_pending_push_work(), "something held")
    return "the transfer is withdrawn from the daemon in the same step"


def prefill_held_blocks_avoid_preemption(rel: Release) -> str:
    """While a finished prefill's blocks wait for the daemon, a running request that needs a
    block waits a step for them (has_pending_block_frees) instead of being preempted."""
    e = Engine(rel, rel.config("kv_producer"), num_blocks=7)  # 6 usable blocks
    e.add("run", 32, None, max_tokens=40)
    e.add("p1", 64, p_leg("t-p1"), max_tokens=1)
    e.step()
    check("p1" in e.finished, "the prefill did not finish")
    check(e.free() == 0, f"{e.free()} blocks free: the pool should be full")
    out, _ = e.step()  # 'run' needs a third block at token 33
    check(e.s.requests["run"].num_preemptions == 0, "preempted while held blocks were about to come back")
    e.report(sent={"p1"})
    e.run_until(lambda: "run" in e.finished, limit=100)
    check(e.s.requests.get("run") is None and e.finished["run"].name == "LENGTH", "did not finish")
    return "no preemption while held blocks were pending; ran on once they were freed"


def _finish(rel: Release, status: str) -> str:
    """A prefill leg finished with ``status``: normal finishes (stop, length, repetition)
    hold the blocks and push; every other ends the transfer at once."""
    e = Engine(rel, rel.config("kv_producer"))
    kw: dict[str, Any] = {}
    natural = status in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION")
    max_tokens = 6
    if status == "FINISHED_STOPPED":  # a stop token (EOS needs the skipped tokenizer)
        kw["sampling"] = {"stop_token_ids": [EOS]}
        e.sample["p1"] = [5, EOS]
    elif status == "FINISHED_LENGTH_CAPPED":
        max_tokens = 2
    elif status == "FINISHED_REPETITION":
        from vllm.sampling_params import RepetitionDetectionParams

        kw["sampling"] = {"repetition_detection": RepetitionDetectionParams(max_pattern_size=1, min_count=3)}
        e.sample["p1"] = [9, 9, 9]
    check(hasattr(rel.RequestStatus, status), f"this release has no {status}")
    e.add("p1", 40, p_leg("t-p1"), max_tokens=max_tokens, **kw)
    e.step()
    if natural:
        e.run_until(lambda: "p1" in e.finished, limit=20)
        got = e.s.requests.get("p1")
        reason = e.finished["p1"]
    else:
        e.abort("p1", status)
        got, reason = None, status
    _, meta = e.step()
    sends = all_of(e, "Send")
    withdrawn = [a.transfer_id for a in all_of(e, "StreamAbort")]
    if natural:
        check(got is not None and got.status.name == status, f"finished as {got.status if got else None}, not {status}")
        check(len(sends) == 1 and sends[0].transfer_id == "t-p1" and not withdrawn, f"sends {sends}, withdrawn {withdrawn}")
        check(e.free() < e.free0 and e.c.has_pending_block_frees(), "blocks not held for the push")
        e.report(sent={"p1"})
        e.idle()
    else:
        check(not sends and withdrawn == ["t-p1"], f"sends {sends}, withdrawn {withdrawn}")
    check(e.free() == e.free0, "blocks not all back")
    return (f"finish reason {reason}: " + ("held and pushed" if natural else "not held, transfer withdrawn"))


def finish_stopped(rel: Release) -> str:
    return _finish(rel, "FINISHED_STOPPED")


def finish_length_capped(rel: Release) -> str:
    return _finish(rel, "FINISHED_LENGTH_CAPPED")


def finish_repetition(rel: Release) -> str:
    return _finish(rel, "FINISHED_REPETITION")


def finish_aborted(rel: Release) -> str:
    return _finish(rel, "FINISHED_ABORTED")


def finish_error(rel: Release) -> str:
    return _finish(rel, "FINISHED_ERROR")


def finish_ignored(rel: Release) -> str:
    return _finish(rel, "FINISHED_IGNORED")


# ============================================================================ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    doc: dict[str, Any] = {"scenarios": {}}
    try:
        rel = Release()
    except Exception:
        doc["error"] = traceback.format_exc()
        with open(args.out, "w") as f:
            json.dump(doc, f)
        return 1
    doc.update(vllm=rel.version, vllm_file=rel.vllm.__file__, import_s=round(rel.import_s, 1),
               python=sys.version.split()[0])
    for name in args.only or SCENARIOS:
        fn = globals()[name]
        s0 = time.monotonic()
        try:
            note = fn(rel)
            res = {"ok": True, "note": note or ""}
        except Exception as e:
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-4000:]}
        res["s"] = round(time.monotonic() - s0, 3)
        doc["scenarios"][name] = res
    doc["total_s"] = round(time.monotonic() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
