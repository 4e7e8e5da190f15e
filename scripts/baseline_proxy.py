#!/usr/bin/env python3
"""Thin entry point: the OpenAI-API proxy in front of vLLM's own P/D connectors, the baselines (``kvpush_dev.baseline_proxy``; ``--help`` there)."""
from kvpush_dev.baseline_proxy import main

if __name__ == "__main__":
    raise SystemExit(main())
