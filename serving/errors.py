"""TF status errors as TF Serving reports them, with its HTTP and gRPC mappings.

What a client reads never names a server path or a Python exception class: `from_tf_error`
keeps a TF error's code and message with paths redacted, and turns any other failure into a
one-line INTERNAL answer while the server log keeps the details.
"""
from __future__ import annotations

import errno
import logging
import re

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
# The most characters of a client's value an error message repeats.
MAX_ECHOED = 100
# An absolute path of two or more components, e.g. /srv/models/m/1/saved_model.pb.
_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.{}|@+=,-]+/)+[\w.{}|@+=,-]*")

log = logging.getLogger(__name__)


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


def truncate(message: str, limit: int = MAX_GRPC_MESSAGE) -> str:
    """Cuts a gRPC status message the way TF Serving does, or with `limit=MAX_ECHOED` a
    client's value that an error repeats, so that no answer grows with the request."""
    if len(message) <= limit:
        return message
    return message[:limit] + "...TRUNCATED"


def echo(value) -> str:
    """A client's value (a model name, a label, a URL path) as an error repeats it: cut to
    `MAX_ECHOED` characters."""
    return truncate(str(value), MAX_ECHOED)


def redact(message: str) -> str:
    """`message` with absolute paths replaced by "<path>"."""
    return _PATH.sub("<path>", message)


def from_tf_error(error: BaseException, context: str = "request") -> ServingError:
    """A `ServingError` for the client: a TF `OpError` keeps its code and its message (paths
    redacted), a missing file is NOT_FOUND, another I/O error UNKNOWN with its message (paths
    redacted), anything else (a bug) INTERNAL with no detail; details go to the log.

    Args:
        error: what was raised.
        context: what failed, for the message and the log ("request", "loading m version 2").
    """
    import tensorflow as tf

    if isinstance(error, ServingError):
        return error
    if isinstance(error, tf.errors.OpError):
        return ServingError(_code_name(error.error_code), redact(error.message))
    if isinstance(error, OSError):
        missing = error.errno == errno.ENOENT or "does not exist" in str(error)
        return ServingError("NOT_FOUND" if missing else "UNKNOWN", redact(str(error)))
    log.error("%s failed", context, exc_info=error)
    return ServingError("INTERNAL", f"{context} failed on the server; the server log has "
                        "the details")


def _code_name(code: int) -> str:
    from tensorflow.core.protobuf import error_codes_pb2

    return error_codes_pb2.Code.Name(code)
