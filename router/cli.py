"""``kvpush-router``: the OpenAI-API front for P/D serving that sends both legs at once.

    kvpush-router --config /etc/kvpush/router.toml
    kvpush-router --listen 127.0.0.1:8000 \\
        --prefill http://127.0.0.1:8100=127.0.0.1:17500,tp=1 \\
        --decode http://127.0.0.1:8200

``--prefill URL=HOST:BASE_PORT[,tp=N]`` names the prefill engine and its node's kvpushd (rank r's
daemon at BASE_PORT + r); ``URL=tcp://h:p[,tcp://h:p...]`` lists the daemons instead. Several
``--prefill`` / ``--decode`` give XpYd, least-loaded (default) or round-robin. The config file's
format is in ``kvpush.router.router_config``. Serves /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics to clients; /router/status, /router/trace and POST /router/drain (and /metrics)
to operators on ``--admin-listen`` (default loopback, the client port + 1). SIGTERM: stop accepting, finish what is in
flight (``--shutdown-grace``), exit 0.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvpush.common import logfmt
from kvpush.proto.buildinfo import version_line
from kvpush.router.router_config import (
    LOG_FORMATS,
    Backend,
    RouterConfigError,
    load,
    parse_decode,
    parse_prefill,
)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _prefill(spec: str) -> Backend:
    try:
        return parse_prefill(spec)
    except RouterConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _decode(spec: str) -> Backend:
    try:
        return parse_decode(spec)
    except RouterConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvpush-router", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=version_line("kvpush-router"))
    ap.add_argument("--config", metavar="FILE",
                    help="router TOML file (keys: docs/configuration.md); flags override it")
    ap.add_argument("--listen", metavar="HOST:PORT",
                    help="address the OpenAI API listens on (default 127.0.0.1:8000)")
    ap.add_argument("--admin-listen", metavar="HOST:PORT",
                    help="address the operator endpoints (/router/*) listen on (default 127.0.0.1, "
                         "the client port + 1); not loopback: set admin_token in the config file")
    ap.add_argument("--host", help=argparse.SUPPRESS)  # older spelling of --listen's parts
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prefill", type=_prefill, action="append", default=[], metavar="URL=NODE",
                    help="a prefill engine and its node's kvpushd: URL=HOST:BASE_PORT[,tp=N] or "
                         "URL=tcp://h:p[,tcp://h:p...] (repeat for several)")
    ap.add_argument("--decode", type=_decode, action="append", default=[], metavar="URL",
                    help="a decode engine's base URL, e.g. http://10.0.0.6:8200, and its node's certificate "
                         "name: URL[,node=NAME] (repeat for several)")
    ap.add_argument("--expose-transfer-id", action="store_true", default=None,
                    help="debugging: answer with x-kvpush-transfer-id (default: never)")
    ap.add_argument("--first-token", choices=("prefill", "decode"),
                    help="where a streamed answer's first token comes from (default prefill: the "
                         "prefill leg's, sent as soon as it answers)")
    ap.add_argument("--policy", choices=("least-loaded", "round-robin"),
                    help="how a request picks its engines among several (default least-loaded)")
    ap.add_argument("--prefill-timeout", type=float, metavar="S",
                    help="seconds for the prefill leg (default 300)")
    ap.add_argument("--request-timeout", type=float, metavar="S",
                    help="seconds for the decode leg (default 600)")
    ap.add_argument("--shutdown-grace", type=float, metavar="S",
                    help="seconds in-flight requests get at SIGTERM (default 30)")
    ap.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO",
                    help="log level (default INFO)")
    ap.add_argument("--log-format", choices=LOG_FORMATS,
                    help="log lines as text (default) or json, one object a line")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    listen = args.listen
    if listen is None and (args.host or args.port):
        listen = f"{args.host or '127.0.0.1'}:{args.port or 8000}"
    try:
        cfg = load(args.config, {
            "prefill": args.prefill, "decode": args.decode, "listen": listen,
            "admin_listen": args.admin_listen,
            "expose_transfer_id": args.expose_transfer_id,
            "policy": args.policy, "prefill_timeout_s": args.prefill_timeout,
            "request_timeout_s": args.request_timeout, "shutdown_grace_s": args.shutdown_grace,
            "log_format": args.log_format, "first_token": args.first_token,
        })
    except RouterConfigError as exc:
        print(f"kvpush-router: {exc}", file=sys.stderr)
        return 2
    # Imported here, not at the top: --version and --help work on a node without aiohttp.
    from aiohttp import web

    from kvpush.router.app import build_app

    logfmt.configure(args.log_level, cfg.log_format, "%(asctime)s kvpush-router %(levelname)s %(message)s")
    logging.getLogger("kvpush.router").info(
        "listening on %s:%d; prefill %s; decode %s", cfg.host, cfg.port,
        ", ".join(f"{b.url} ({len(b.kv_endpoints)} daemon(s))" for b in cfg.prefill),
        ", ".join(b.url for b in cfg.decode))
    web.run_app(build_app(cfg), host=cfg.host, port=cfg.port, print=None, access_log=None,
                shutdown_timeout=cfg.shutdown_grace_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
