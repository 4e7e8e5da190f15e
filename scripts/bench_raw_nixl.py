#!/usr/bin/env python3
"""Thin entry point: raw two-process NIXL WRITE bandwidth, kvpush's ceiling (``kvpush_dev.bench.raw_nixl``; ``--help`` there)."""
from kvpush_dev.bench.raw_nixl import main

if __name__ == "__main__":
    raise SystemExit(main())
