#!/usr/bin/env python3
"""Thin entry point: a ZeroMQ ipc hop against a plain Unix socket hop between idle processes (``kvpush_dev.bench.wake``; ``--help`` there)."""
from kvpush_dev.bench.wake import main

if __name__ == "__main__":
    raise SystemExit(main())
