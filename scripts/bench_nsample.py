#!/usr/bin/env python3
"""Thin entry point: parallel sampling (n > 1) TTFT against n = 1 through P/D (``kvpush_dev.bench.nsample``; ``--help`` there)."""
from kvpush_dev.bench.nsample import main

if __name__ == "__main__":
    raise SystemExit(main())
