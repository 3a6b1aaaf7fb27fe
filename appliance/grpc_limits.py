"""The largest request message the appliance's gRPC servers take, and the server option that
sets it: the gateway and the engine server set it (gRPC's default is the same 4 MiB; set
explicitly, a change of the default moves neither), the engine's stream socket takes the same,
and `appliance bench` refuses a prompt whose request would not fit."""

from __future__ import annotations

MAX_REQUEST_BYTES = 4 * 2**20
RECEIVE_LIMIT = ("grpc.max_receive_message_length", MAX_REQUEST_BYTES)

# The widest values of the public API's int32 and uint32 fields (GenerateRequest.max_tokens,
# ttft_budget_ms, ...): a larger one cannot be sent, and protobuf raises on it.
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
