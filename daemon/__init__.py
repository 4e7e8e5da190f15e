"""kvpushd: the node-local daemon (a supervisor and one daemon per accelerator) that moves KV for its engines.

Rooms: ``core/`` pure cores, ``io/`` sockets, NIXL and memory, ``trust/`` keys and allowlist,
``ops/`` operator tools, ``node/`` the process tree; at the top, one device daemon's composition
(device_daemon, engine_session, prefill_side, decode_side, context, config, metrics).
"""
