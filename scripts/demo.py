#!/usr/bin/env python3
"""Thin entry point: the local 1P1D push demo on CPU with real vLLM engines and kvpush daemons (``kvpush.testing.demo``; ``--help`` there)."""
from kvpush.testing.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
