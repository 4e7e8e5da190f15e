"""The engine's link to its daemon: the non-blocking client, its liveness state machine, local trust."""
