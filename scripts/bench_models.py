#!/usr/bin/env python3
"""Thin entry point: per model family, colocated vs kvpush vs vLLM's NixlConnector (``kvpush_dev.bench.models``; ``--help`` there)."""
from kvpush_dev.bench.models import main

if __name__ == "__main__":
    raise SystemExit(main())
