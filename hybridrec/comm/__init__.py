"""hybridrec.comm: what goes over the wire (codecs) and how (ZeroMQ request/reply transport)."""

from hybridrec.comm.codec import (
    ID_CODECS, VALUE_CODECS, Encoded, Fp16BlockCodec, RawIdCodec, RawValueCodec, UniqueIdCodec,
    make_id_codec, make_value_codec,
)
from hybridrec.comm.transport import (
    Client, Message, Operation, ProtocolError, RemoteError, Server, request_all,
)

__all__ = [
    "ID_CODECS", "VALUE_CODECS", "Encoded", "Fp16BlockCodec", "RawIdCodec", "RawValueCodec",
    "UniqueIdCodec", "make_id_codec", "make_value_codec",
    "Client", "Message", "Operation", "ProtocolError", "RemoteError", "Server", "request_all",
]
