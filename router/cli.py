"""``kvpush-router``: the OpenAI-API front for P/D serving that sends both legs at once.

    kvpush-router --config /etc/kvpush/router.toml
    kvpush-router --listen 127.0.0.1:8000 \\
        --prefill http://127.0.0.1:8100=127.0.0.1:17500,tp=1 \\
        --decode http://127.0.0.1:8200

``--prefill URL=HOST:BASE_PORT[,tp=N]`` names the prefill engine and its node's kvpushd (rank r's
daemon at BASE_PORT + r); ``URL=tcp://h:p[,tcp://h:p...]`` lists the daemons instead. Several
``--prefill`` / ``--decode`` give XpYd, least-loaded (default) or round-robin. The config file's
format is in ``kvpush.router.router_config``. Serves /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics, /router/status, /router/trace. SIGTERM: stop accepting, finish what is in
flight (``--shutdown-grace``), exit 0.
"""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from kvpush.daemon import logfmt
from kvpush.router.app import build_app
from kvpush.router.router_config import LOG_FORMATS, Backend, RouterConfigError, load, parse_prefill


def _prefill(spec: str) -> Backend:
    try:
        return parse_prefill(spec)
    except RouterConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpush-router", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML file (see kvpush.router.router_config)")
    ap.add_argument("--listen", help="HOST:PORT (default 127.0.0.1:8000)")
    ap.add_argument("--host", help=argparse.SUPPRESS)  # older spelling of --listen's parts
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prefill", type=_prefill, action="append", default=[], metavar="URL=NODE")
    ap.add_argument("--decode", action="append", default=[], metavar="URL")
    ap.add_argument("--policy", choices=("least-loaded", "round-robin"))
    ap.add_argument("--prefill-timeout", type=float, help="seconds for the prefill leg (300)")
    ap.add_argument("--request-timeout", type=float, help="seconds for the decode leg (600)")
    ap.add_argument("--shutdown-grace", type=float, help="seconds in-flight requests get at SIGTERM (30)")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--log-format", choices=LOG_FORMATS, help="log lines as text (default) or json, one object a line")
    args = ap.parse_args(argv)
    listen = args.listen
    if listen is None and (args.host or args.port):
        listen = f"{args.host or '127.0.0.1'}:{args.port or 8000}"
    try:
        cfg = load(args.config, {
            "prefill": args.prefill, "decode": [Backend(u.rstrip("/")) for u in args.decode], "listen": listen,
            "policy": args.policy, "prefill_timeout_s": args.prefill_timeout,
            "request_timeout_s": args.request_timeout, "shutdown_grace_s": args.shutdown_grace,
            "log_format": args.log_format,
        })
    except RouterConfigError as exc:
        print(f"kvpush-router: {exc}", file=sys.stderr)
        return 2
    logfmt.configure(args.log_level.upper(), cfg.log_format, "%(asctime)s kvpush-router %(levelname)s %(message)s")
    logging.getLogger("kvpush.router").info(
        "listening on %s:%d; prefill %s; decode %s", cfg.host, cfg.port,
        ", ".join(f"{b.url} ({len(b.kv_endpoints)} daemon(s))" for b in cfg.prefill),
        ", ".join(b.url for b in cfg.decode))
    web.run_app(build_app(cfg), host=cfg.host, port=cfg.port, print=None, access_log=None,
                shutdown_timeout=cfg.shutdown_grace_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
