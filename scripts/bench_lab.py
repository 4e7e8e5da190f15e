"""Benchmarks across the multi-host lab (see kvpush.testing.bench.lab)."""
from kvpush.testing.bench.lab import main

if __name__ == "__main__":
    raise SystemExit(main())
