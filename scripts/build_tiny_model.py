#!/usr/bin/env python3
"""Thin entry point: build the deterministic tiny Llama the engines serve (``kvpush_dev.tiny_model``; ``--help`` there)."""
from kvpush_dev.tiny_model import main

if __name__ == "__main__":
    raise SystemExit(main())
