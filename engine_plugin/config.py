"""KVPushConnector settings: the keys of ``kv_connector_extra_config``, as a schema.

Only ``daemon`` is required. Every key, its type, default and meaning: the fields below, and
docs/configuration.md generated from them. ``lease_ms``' default (10 s) covers a router that
sends both legs at once or a serial proxy (the decode side registers within its queueing
delay); a decode side that never comes costs at most that long. Types are strict: JSON
``"false"`` is not a boolean, ``"3000"`` not an integer.
"""

from __future__ import annotations

import pwd
from dataclasses import dataclass, fields
from typing import Any

from kvpush.common.configschema import (
    ConfigError,
    check_count,
    check_fields,
    int_in,
    key,
    p_str,
    parse_layer,
    parsers_of,
    takes_strings,
)
from kvpush.engine_plugin.link.local_trust import trusted_uids
from kvpush.proto.messages import ENGINE_DEAD_AFTER_MIN_S

DEAD_AFTER_MS = 3000
# Above the 1 s heartbeat; below any sane load timeout. The floor is the contract a daemon
# relies on to know when its engine may have given it up (proto.ENGINE_DEAD_AFTER_MIN_S).
DEAD_AFTER_RANGE_MS = (round(ENGINE_DEAD_AFTER_MIN_S * 1000), 60_000)
WHERE = "kv_connector_extra_config"
LAYERWISE_MODES = ("auto", "on", "off")
# Layers per LayerProgress frame, measured (docs/results/layerwise_groups.md): what is left to
# send after the last layer is about one group, so smaller groups shorten the tail (24 layers
# across a capped link: 226 / 170 / 58 ms at 2000 tokens for groups 4 / 2 / 1), while each frame
# costs the engine (32 layers, one forward: +68 / +93 / +117 us for 1 request, and at group 1 with
# 16 requests the link refused frames, +1.1 ms). 2 halves group 4's tail for +25 us a forward.
LAYER_GROUP = 2
LAYER_GROUP_RANGE = (1, 1024)
# ``auto`` sends progress for prompts of this many tokens or more; the prefill daemon then streams
# only to decode peers whose link makes it worth it (its layerwise_min_transfer_ms), so this is a
# floor below which no link would: SGLang's layer-wise PR falls back below 256 tokens (InfiniBand).
LAYERWISE_MIN_TOKENS = 256


class PluginConfigError(ConfigError):
    """A connector config key is missing or malformed."""


@takes_strings
def _p_daemon(v: Any) -> str:
    if not p_str(v):
        raise ValueError('is empty; e.g. "ipc:///run/kvpush/engine-{rank}.sock"')
    return v


@takes_strings
def _p_user(v: Any) -> int:
    """``daemon_user``: a user name known to this host, or a uid."""
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32:
        return v
    if isinstance(v, str) and v:
        try:
            return pwd.getpwnam(v).pw_uid
        except KeyError:
            raise ValueError(f"{v!r}: no such user on this host") from None
    raise TypeError(f"must be a user name or a uid, got {v!r}")


@dataclass(frozen=True)
class PluginConfig:
    """``kv_connector_extra_config`` as data; its fields are the keys (kvpush.common.configschema)."""

    daemon: str = key(doc='socket template of the rank\'s daemon, e.g. "ipc:///run/kvpush/'
                      'engine-{rank}.sock" ({rank}: TP rank, {device}: rank + device_offset)',
                      parse=_p_daemon)
    lease_ms: int = key(10_000, "prefill side: how long the daemon may hold finished blocks "
                        "waiting for a registration before releasing them (the daemon caps it at "
                        "its lease_s)", check=check_count)
    timeout_ms: int = key(30_000, "decode side: how long a registration waits for every "
                          "producer before the load fails and vLLM recomputes", check=check_count)
    device_offset: int = key(0, "added to the rank for {device} (several engines on one node)",
                             check=check_count)
    unavailable_fail: bool = key(True, "fail loads at once while the daemon is unreachable "
                                 "(vLLM recomputes) instead of waiting for timeout_ms")
    idle_wait_ms: int = key(2, "on a step with no forward while a load (or, on a TP > 1 engine, "
                            "a send) is pending, wait up to this long for the daemon's answer "
                            "instead of letting vLLM spin; 0: never", check=check_count)
    dead_after_ms: int = key(DEAD_AFTER_MS, "how long the daemon may leave heartbeats "
                             "unanswered before the plugin treats it as unavailable: lower fails "
                             "a dead daemon's transfers sooner, higher rides out longer stalls",
                             parse=int_in(*DEAD_AFTER_RANGE_MS))
    daemon_user: int | None = key(None, "the user (name or uid) kvpushd runs as, when it is neither "
                                  "root nor the engine's own user: the plugin dials only a daemon "
                                  "socket, and reads only a card, owned by root, the engine's uid or "
                                  "this user, in a directory no other uid can write, with a listener "
                                  "of those uids; unset: the user \"kvpush\" if this host has one",
                                  parse=_p_user, type_name="user name or uid",
                                  shown_default="kvpush, if present")
    layerwise: str = key("auto", "prefill side: stream each request's KV per layer group while its "
                         "prompt is computed (the daemon WRITEs beside the forward): \"on\" every "
                         "pushed prompt, \"auto\" prompts of layerwise_min_tokens or more of a model with more "
                         "than layer_group layers, on a CPU engine, and only to decode peers whose link "
                         "makes it worth it (the daemon's layerwise_min_transfer_ms) (on a GPU, \"on\" once "
                         "scripts/gpu_check.sh's events step passed there), \"off\" "
                         "whole-request pushes only (PrefillDone after the forward). A model with several KV "
                         "cache groups (vLLM's hybrid allocator: sliding-window or state layers) pushes whole "
                         "requests whatever this says, logged at start (measured: "
                         "docs/results/layerwise-hybrid.md)",
                         choices=LAYERWISE_MODES)
    windowed_as_full: bool = key(False, "accept a sliding-window (or chunked) model served with "
                                 "--disable-hybrid-kv-cache-manager, each layer keeping the whole prompt: "
                                 "kvpush then moves every layer's whole prompt (the dense model's bytes, several "
                                 "times what the hybrid allocator's groups move) and may stream it per layer; "
                                 "false: refused at start-up. Measured against the hybrid allocator's "
                                 "whole-request push: docs/results/layerwise-hybrid.md")
    layer_group: int = key(LAYER_GROUP, "layers per progress frame while streaming: fewer frames cost "
                           "the engine less, more let the daemon start sooner",
                           parse=int_in(*LAYER_GROUP_RANGE))
    layerwise_min_tokens: int = key(LAYERWISE_MIN_TOKENS, "with layerwise \"auto\": the shortest "
                                    "prompt that streams (below it the transfer is too short to "
                                    "hide and the frames cost more than they save)",
                                    check=check_count)

    def trusted_uids(self) -> frozenset[int]:
        """Who may own the daemon's socket directory, socket and card, and listen on it."""
        return trusted_uids(self.daemon_user)

    def stream_min_tokens(self, num_layers: int | None = None, gpu: bool = False) -> int | None:
        """The shortest prompt that streams per layer (None: layerwise off). ``auto`` streams
        only a model whose forward has two layer groups or more (``num_layers``, when known):
        a forward's one group ends with the forward itself, so its WRITE could only start
        when the seal's would, one round trip later. Nor on a GPU (``gpu``): there the daemon
        trusts the engine's CUDA events to say a group's KV is written, and that path has not
        run on hardware yet; ``on`` streams there."""
        if self.layerwise == "auto" and (gpu or (num_layers is not None and num_layers <= self.layer_group)):
            return None
        return {"off": None, "on": 0}.get(self.layerwise, self.layerwise_min_tokens)

    def socket_for(self, rank: int) -> str:
        return self.daemon.format(rank=rank, device=rank + self.device_offset)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> PluginConfig:
        """The one load step: JSON-typed values (strict: "false" is not a boolean), checked."""
        if extra is not None and not isinstance(extra, dict):
            raise PluginConfigError(f"{WHERE} must be a JSON object, got {type(extra).__name__}")
        extra = dict(extra or {})
        if "daemon" not in extra:
            raise PluginConfigError(
                f'{WHERE} needs "daemon", e.g. "ipc:///run/kvpush/engine-{{rank}}.sock"')
        try:
            values = parse_layer(WHERE, extra, parsers_of(cls))
            cfg = cls(**values)
            check_fields(cfg, WHERE)
        except PluginConfigError:
            raise
        except ConfigError as e:
            raise PluginConfigError(str(e)) from None
        return cfg


KEYS = tuple(f.name for f in fields(PluginConfig))
