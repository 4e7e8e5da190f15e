"""Who a daemon trusts on its peer port: per-node CURVE keys and the allowlist of certificates."""
