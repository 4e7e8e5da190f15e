#!/usr/bin/env python3
"""Thin entry point: TTFT at low load, kvpush vs colocated vs pull (``kvpush_dev.bench.ttft``; ``--help`` there)."""
from kvpush_dev.bench.ttft import main

if __name__ == "__main__":
    raise SystemExit(main())
