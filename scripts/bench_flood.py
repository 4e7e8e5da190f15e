#!/usr/bin/env python3
"""Thin entry point: floods against a real daemon's peer port, RSS before/after (``kvpush_dev.bench.flood``; ``--help`` there)."""
from kvpush_dev.bench.flood import main

if __name__ == "__main__":
    raise SystemExit(main())
