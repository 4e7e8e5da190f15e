#!/usr/bin/env python3
"""Thin entry point: time the vLLM plugin's hooks per engine step under P/D load (``kvpush.testing.bench.plugin_hooks``; ``--help`` there)."""
from kvpush.testing.bench.plugin_hooks import main

if __name__ == "__main__":
    raise SystemExit(main())
