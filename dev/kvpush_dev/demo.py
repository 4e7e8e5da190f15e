"""The main job: a local 1P1D push demo on CPU with real vLLM engines and kvpush daemons.

1. builds the tiny random-weight model of ``--model-preset`` (offline, deterministic; the
   Llama ``tiny`` by default, or one per KV family: ``mla``, ``swa``, ``linear``, ``mamba``,
   each with the engine settings it needs, kvpush_dev.tiny_model.FAMILIES);
2. runs a colocated engine (no disaggregation, the same settings) on the prompts: the
   reference tokens;
3. starts `kvpushd` (one daemon per engine), a prefill and a decode vLLM engine with
   KVPushConnector, and the kvpush router (both legs sent concurrently);
4. sends the same prompts through the router (streaming), prints per-request TTFT,
   TPOT and whether the generated tokens equal the colocated run; exits 1 if any differ
   (bf16 presets: unless it parts from colocated, each prompt alone, at a near tie of its
   top two tokens, docs/models.md; state presets, ``linear`` and ``mamba``: unless it equals,
   token for token, what vLLM's own NixlConnector answers on the same P/D split, run after
   kvpush for those prompts only: both resume the state after N - 1 prompt tokens, a kernel
   path that a colocated engine itself takes on a prefix-cache hit, and whose rounding can part
   from computing the prompt in one go).

Every process runs in its own process group and is cleaned up, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile
from pathlib import Path
from typing import Any

from kvpush_dev import tiny_model
from kvpush_dev import vllm_env as ve
from kvpush_dev.demo_report import near_tie, prompts, report
from kvpush_dev.pd_stack import PDStack, prompt_tokens_by_source
from kvpush_dev.procs import free_port
from kvpush_dev.sse import run_prompts
from kvpush_dev.sweep.launchers import start_nixl

ROOT = ve.ROOT


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="demo.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-preset", default="tiny", choices=tiny_model.ALL_PRESETS,
                    help="which tiny model (and the engine settings it needs); default tiny")
    ap.add_argument("--model-dir", default=None, help="where the preset is built (default .models/PRESET)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--extra-prompts", type=int, default=8, help="more prompts, sent concurrently")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--workdir", default=None, help="logs and sockets (default: a temp dir)")
    ap.add_argument("--ucx-error-handling", choices=("peer", "none"), default="none")
    ap.add_argument("--gpu", action="store_true",
                    help="CUDA vLLM: both engines (and the reference) share one GPU, each a third of its memory")
    ap.add_argument("--hosts", action="store_true",
                    help="2P2D across network namespaces as hosts (UCX over TCP, router on its own host; "
                         "needs root): kvpush_dev.labdemo")
    args = ap.parse_args(argv)
    if args.hosts:
        from kvpush_dev import labdemo

        return labdemo.main(args, prompts(args.extra_prompts))

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvpush-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"kvpush demo: logs and sockets in {work}")
    model = ve.ensure_tiny_model(args.model_dir or ROOT / ".models" / args.model_preset, preset=args.model_preset)
    procs: list[Any] = []
    gpu_args = [*(["--gpu-memory-utilization", "0.3"] if args.gpu else []), *tiny_model.engine_args(args.model_preset)]
    print(f"model preset {args.model_preset}: {model} (engine flags: {' '.join(gpu_args) or 'defaults'})")
    stack = PDStack(model, work, ucx_error_handling_mode=args.ucx_error_handling, engine_args=gpu_args)

    def cleanup() -> None:
        stack.stop()
        for p in procs:
            ve.stop_group(p, grace=10)
        procs.clear()

    def on_signal(signum: int, _frame: Any) -> None:
        cleanup()
        raise SystemExit(130)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    ps = prompts(args.extra_prompts)
    try:
        # 1. colocated reference: the same engine flags and one core, like each P/D engine
        port = free_port()
        print("starting the colocated reference engine ...", flush=True)
        ref = ve.start_engine(model, port, work / "colocated.log", cpu_bind="0", extra_args=gpu_args)
        procs.append(ref)
        ve.wait_healthy(f"http://127.0.0.1:{port}/health", 600, ref)
        url = f"http://127.0.0.1:{port}/v1/completions"
        asyncio.run(run_prompts(url, ps[:1], 2, 1))  # warm-up
        reference = asyncio.run(run_prompts(url, ps, args.max_tokens, args.concurrency))
        judged = None
        if tiny_model.spec_dtype(args.model_preset) != "float32":  # bf16: near ties may tip
            judged = [ve.post_json(url, {"model": "tiny", "prompt": p, "max_tokens": args.max_tokens,
                                         "temperature": 0.0, "ignore_eos": True, "logprobs": 2},
                                   timeout=600)["choices"][0] for p in ps]
        cleanup()

        # 2. kvpushd + P + D + router
        print("starting kvpushd (one daemon per engine), the prefill and decode engines, the router ...",
              flush=True)
        stack.start()
        url = f"{stack.router_url}/v1/completions"
        asyncio.run(run_prompts(url, ps[:1], 2, 1))  # warm-up
        before = prompt_tokens_by_source(stack.d_url).get("external_kv_transfer", 0.0)
        pd = asyncio.run(run_prompts(url, ps, args.max_tokens, args.concurrency))
        after = prompt_tokens_by_source(stack.d_url).get("external_kv_transfer", 0.0)
        cleanup()
        pulled = _nixl_answers(args, model, work, gpu_args, ps, reference, pd, judged)
    finally:
        cleanup()

    def tie(i: int, got: str) -> str | None:
        if judged is not None and (why := near_tie(got, judged[i])):
            return f"near tie: {why}"
        if pulled.get(i) == got:
            return "equals vLLM's NixlConnector on the same split (the state resumed after N - 1 tokens)"
        return None

    return report(ps, reference, pd, after - before, tie)


def _nixl_answers(args: argparse.Namespace, model: Path, work: Path, engine_args: list[str], ps: list[str],
                  reference: list[dict[str, Any]], pd: list[dict[str, Any]],
                  judged: list[dict[str, Any]] | None) -> dict[int, str]:
    """State presets: the prompts whose kvpush answer differs from colocated (beyond a near
    tie), asked one at a time through vLLM's NixlConnector (pull) on the same split."""
    if not tiny_model.resumes_state(args.model_preset):
        return {}
    odd = [i for i, (ref, got) in enumerate(zip(reference, pd, strict=True))
           if "error" not in got and "error" not in ref and got["text"] != ref["text"]
           and (judged is None or near_tie(got["text"], judged[i]) is None)]
    if not odd:
        return {}
    print(f"{len(odd)} answers differ from colocated: asking vLLM's NixlConnector (pull) the same prompts ...",
          flush=True)
    (work / "pull").mkdir(exist_ok=True)
    ms = start_nixl("pull", model, work / "pull", 900, 600, engine_args=tuple(engine_args))
    try:
        return {i: str(ve.post_json(f"{ms.front_url}/v1/completions",
                                    {"model": "tiny", "prompt": ps[i], "max_tokens": args.max_tokens,
                                     "temperature": 0.0, "ignore_eos": True}, timeout=600)["choices"][0]["text"])
                for i in odd}
    finally:
        ms.stop()


if __name__ == "__main__":
    raise SystemExit(main())
