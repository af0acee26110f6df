"""The worker engines' one error family: :class:`EngineError` with a gRPC status-code name.

An engine raises it when it refuses a request, and ends a request's future or stream with one
when the request fails later. Codes are plain strings named after ``grpc.StatusCode`` members
(engines import no grpc); ``pdserve.rpc.status_code`` maps them onto the wire.
"""

from __future__ import annotations

# the work was done but could not be handed on (a prefill's KV did not reach its decode worker):
# the caller should retry the whole operation elsewhere; not a sign that this worker is down
ABORTED = "ABORTED"
ALREADY_EXISTS = "ALREADY_EXISTS"  # the request id is live here
CANCELLED = "CANCELLED"  # aborted by the caller
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # the request's deadline (or KV wait) passed
FAILED_PRECONDITION = "FAILED_PRECONDITION"  # the worker is not set up for this kind of request
INTERNAL = "INTERNAL"  # a forward or step raised
INVALID_ARGUMENT = "INVALID_ARGUMENT"  # a request field is out of range (the message names it)
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # no KV room
UNAVAILABLE = "UNAVAILABLE"  # shutting down, or the KV transport failed


class EngineError(Exception):
    """A request was refused or failed. ``code``: one of this module's constants; ``message``:
    one line naming the field and the limit where there is one."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"EngineError({self.code}, {self.message!r})"
