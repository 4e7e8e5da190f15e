#!/usr/bin/env python3
"""Thin entry point: the local 1P1D push demo on CPU with real vLLM engines and kvpush daemons (``kvpush_dev.demo``; ``--help`` there)."""
from kvpush_dev.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
