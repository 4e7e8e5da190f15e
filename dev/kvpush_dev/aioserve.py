"""Serve an aiohttp application on a free loopback port, for tests and benchmarks that put the
router (or an engine stand-in) in front of real HTTP clients in one process."""

from __future__ import annotations

from aiohttp import web

from kvpush_dev.procs import free_port


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on 127.0.0.1; the runner (``await runner.cleanup()`` to stop) and its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"
