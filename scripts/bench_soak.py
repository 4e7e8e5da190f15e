#!/usr/bin/env python3
"""Thin entry point: soak benchmarks, collections and RSS after many transfers (``kvpush_dev.bench.soak``; ``--help`` there)."""
from kvpush_dev.bench.soak import main

if __name__ == "__main__":
    raise SystemExit(main())
