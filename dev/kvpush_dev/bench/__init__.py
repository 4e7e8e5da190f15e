"""The benchmarks behind scripts/bench_*.py: planner, raw NIXL, transfer, plugin hooks, TTFT."""
