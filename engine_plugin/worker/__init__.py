"""The connector's worker half: exports the KV memory, publishes, reports completions."""
