#!/usr/bin/env python3
"""Thin entry point: push vs pull side by side, kvpush against vLLM's own P/D connectors (``kvpush_dev.sweep.cli``; ``--help`` there)."""
from kvpush_dev.sweep.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
