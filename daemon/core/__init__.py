"""The daemon's pure cores: (state, event) -> (state, actions), no I/O, no clock. Rendezvous, counter, planner, peers, quotas, checks."""
