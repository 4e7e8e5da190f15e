"""The daemon's I/O shells: engine and peer sockets, the NIXL transport, KV memory mapping, local credentials."""
