#!/usr/bin/env python3
"""Thin entry point: figures and summary.md from a bench_sweep.py results directory (``kvpush.testing.sweep.plot``; ``--help`` there)."""
from kvpush.testing.sweep.plot import main

if __name__ == "__main__":
    raise SystemExit(main())
