"""Benchmarks across the multi-host lab (see kvpush_dev.bench.lab)."""
from kvpush_dev.bench.lab import main

if __name__ == "__main__":
    raise SystemExit(main())
