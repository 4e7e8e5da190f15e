#!/usr/bin/env python3
"""Thin entry point: TTFT at low load, kvpush vs colocated vs pull (``kvpush.testing.bench.ttft``; ``--help`` there)."""
from kvpush.testing.bench.ttft import main

if __name__ == "__main__":
    raise SystemExit(main())
