"""``kvpush-router``: the OpenAI-API front for P/D serving that sends both legs at once.

    kvpush-router --port 8000 \\
        --prefill http://127.0.0.1:8100=tcp://127.0.0.1:17500 \\
        --decode http://127.0.0.1:8200

``--prefill URL=ENDPOINT[,ENDPOINT...]`` names the engine and its daemons' peer
endpoints, one per TP rank (rank order). Several ``--prefill`` / ``--decode``
give XpYd with least-loaded (default) or round-robin choice.
"""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from kvpush.router.app import Backend, RouterConfig, build_app, parse_prefill


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvpush-router", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", type=parse_prefill, action="append", required=True, metavar="URL=ENDPOINTS")
    ap.add_argument("--decode", action="append", required=True, metavar="URL")
    ap.add_argument("--policy", choices=("least-loaded", "round-robin"), default="least-loaded")
    ap.add_argument("--prefill-timeout", type=float, default=300.0, help="seconds for the prefill leg")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds for the decode leg")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s kvpush-router %(levelname)s %(message)s")
    cfg = RouterConfig(
        prefill=args.prefill,
        decode=[Backend(u.rstrip("/")) for u in args.decode],
        policy=args.policy,
        prefill_timeout_s=args.prefill_timeout,
        request_timeout_s=args.request_timeout,
    )
    web.run_app(build_app(cfg), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
