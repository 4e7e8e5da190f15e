#!/usr/bin/env python3
"""Thin entry point: plan time of the TransferPlanner and event rate of the Rendezvous (``kvpush_dev.bench.core_rates``; ``--help`` there)."""
from kvpush_dev.bench.core_rates import main

if __name__ == "__main__":
    raise SystemExit(main())
