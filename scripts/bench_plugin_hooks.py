#!/usr/bin/env python3
"""Thin entry point: time the vLLM plugin's hooks per engine step under P/D load (``kvpush_dev.bench.plugin_hooks``; ``--help`` there),
or, with ``layerwise`` first, what layer-wise streaming adds per prefill forward (``kvpush_dev.bench.plugin_layerwise``)."""
import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["layerwise"]:
        from kvpush_dev.bench.plugin_layerwise import main as layerwise

        raise SystemExit(layerwise(sys.argv[2:]))
    from kvpush_dev.bench.plugin_hooks import main

    raise SystemExit(main())
