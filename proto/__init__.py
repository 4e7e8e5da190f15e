"""kvpush.proto: wire messages, their msgpack codec, and the KV layout description.

Both the engine plugin and the daemons import only this package to talk to each other.
"""

from kvpush.proto.codec import Limits, decode, encode
from kvpush.proto.errors import ProtocolError
from kvpush.proto.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    Attach,
    AttachAck,
    Cancel,
    CancelConfirmed,
    Error,
    Heartbeat,
    HeartbeatAck,
    Hello,
    MemoryHandle,
    Message,
    OpsReply,
    OpsRequest,
    PeerRegister,
    PrefillDone,
    Received,
    ReceiveFailed,
    Register,
    Released,
    SendFailed,
    Sent,
    WriteFailedNotice,
)

__all__ = [
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "Abort",
    "Attach",
    "AttachAck",
    "Cancel",
    "CancelConfirmed",
    "Error",
    "Heartbeat",
    "HeartbeatAck",
    "Hello",
    "Limits",
    "MemoryHandle",
    "Message",
    "OpsReply",
    "OpsRequest",
    "PeerRegister",
    "PrefillDone",
    "ProtocolError",
    "ReceiveFailed",
    "Received",
    "Register",
    "Released",
    "SendFailed",
    "Sent",
    "WriteFailedNotice",
    "decode",
    "encode",
]
