#!/usr/bin/env python3
"""Thin entry point: figures and summary.md from a bench_sweep.py results directory (``kvpush_dev.sweep.plot``; ``--help`` there)."""
from kvpush_dev.sweep.plot import main

if __name__ == "__main__":
    raise SystemExit(main())
