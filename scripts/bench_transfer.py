#!/usr/bin/env python3
"""Thin entry point: kvpushd end to end vs raw NIXL vs memcpy (``kvpush.testing.bench.transfer``; ``--help`` there)."""
from kvpush.testing.bench.transfer import main

if __name__ == "__main__":
    raise SystemExit(main())
