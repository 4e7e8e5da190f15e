#!/usr/bin/env python3
"""Thin entry point: what a revocation's NIXL rotation costs (``kvpush_dev.bench.rotation``; ``--help`` there)."""
from kvpush_dev.bench.rotation import main

if __name__ == "__main__":
    raise SystemExit(main())
