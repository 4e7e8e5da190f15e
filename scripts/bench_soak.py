"""Soak benchmarks (testing/bench/soak.py): collections and RSS after many transfers."""

import sys

from kvpush.testing.bench.soak import main

sys.exit(main())
