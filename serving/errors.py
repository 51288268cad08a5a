"""TF status errors as TF Serving reports them, with its HTTP and gRPC mappings."""
from __future__ import annotations

# model_servers/http_server.cc: TF error code -> HTTP status.
HTTP_STATUS = {
    "OK": 200, "CANCELLED": 499, "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400, "DEADLINE_EXCEEDED": 504, "NOT_FOUND": 404, "ALREADY_EXISTS": 409,
    "ABORTED": 409, "PERMISSION_DENIED": 403, "RESOURCE_EXHAUSTED": 429, "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503, "UNAUTHENTICATED": 401, "UNKNOWN": 500, "INTERNAL": 500,
    "DATA_LOSS": 500,
}
# The reverse, for clients of the REST API: the first code listed for each HTTP status.
CODE_OF_HTTP_STATUS = {status: code for code, status in reversed(HTTP_STATUS.items())}

MAX_GRPC_MESSAGE = 1024


class ServingError(Exception):
    """An error with a TF error code name (`"INVALID_ARGUMENT"`, `"NOT_FOUND"`, ...).

    Args:
        code: the TF error code name.
        message: what went wrong, for the user.
        http_status: the HTTP status when it is not the code's usual one (e.g. 413).
    """

    def __init__(self, code: str, message: str, http_status: int | None = None):
        if code not in HTTP_STATUS:
            raise ValueError(f"unknown TF error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.http_status = http_status or HTTP_STATUS[code]

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


def truncate(message: str) -> str:
    """Cuts a gRPC status message the way TF Serving does."""
    if len(message) <= MAX_GRPC_MESSAGE:
        return message
    return message[:MAX_GRPC_MESSAGE] + "...TRUNCATED"


def from_tf_error(error: Exception) -> ServingError:
    """A `ServingError` of a TensorFlow `OpError` (its code kept), or INTERNAL for others."""
    import tensorflow as tf

    if isinstance(error, ServingError):
        return error
    if isinstance(error, tf.errors.OpError):
        return ServingError(_code_name(error.error_code), error.message)
    return ServingError("INTERNAL", f"{type(error).__name__}: {error}")


def _code_name(code: int) -> str:
    from tensorflow.core.protobuf import error_codes_pb2

    return error_codes_pb2.Code.Name(code)
