"""Push vs pull side by side (scripts/bench_sweep.py): grid, launchers, client, metrics, runner, cli, plot."""
