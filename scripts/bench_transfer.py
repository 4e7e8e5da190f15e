#!/usr/bin/env python3
"""Thin entry point: kvpushd end to end vs raw NIXL vs memcpy (``kvpush_dev.bench.transfer``; ``--help`` there)."""
from kvpush_dev.bench.transfer import main

if __name__ == "__main__":
    raise SystemExit(main())
