"""TF Serving's REST API as an ASGI app (`model_servers/http_rest_api_handler.cc`).

    GET  /v1/models/NAME[/versions/V | /labels/L]            status
    GET  /v1/models/NAME[/versions/V | /labels/L]/metadata   metadata
    POST /v1/models/NAME[/versions/V | /labels/L]:predict    predict

Every answer is JSON; errors are `{"error": MESSAGE}` with TF Serving's HTTP codes. Status and
metadata are answered on the event loop, so they never wait behind predictions. A predict reads
its body within `body_timeout_seconds`, none of it stalling longer than `body_stall_seconds`
(408 otherwise, its bytes released; a client that leaves mid-body has nothing run), refuses a
body over `max_request_bytes` (413) before reading it, and waits for its model run at most until
its deadline (`--rest_api_timeout_in_ms`, 504); a request whose client has gone, or whose
deadline passed, is dropped if its run has not started. An answer's bytes count in flight until
at most 64 KiB of it is left unsent (the transport's write buffer is under its high-water mark,
or has drained to its low-water mark), and a connection whose client reads none of its answer
for `write_stall_seconds`, or has not taken all but those 64 KiB of it out of the server within
`write_timeout_seconds`, is aborted, its unsent bytes dropped (uvicorn has no write timeout: an
unread answer stayed in memory for as long as its client kept the connection open, and one read
a byte at a time for as long as its client kept reading).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import struct
import time
import urllib.parse

from google.protobuf import json_format
from uvicorn.protocols.http.h11_impl import H11Protocol

from tworec.serving.errors import MAX_ECHOED, ServingError, echo, truncate
from tworec.serving.json_tensor import format_predict, parse_json, parse_predict, signature_name
from tworec.serving.limits import (BytesInFlight, Reservation, default_max_elements,
                                   default_max_request_bytes_in_flight, default_max_rows)
from tworec.serving.manager import ModelManager
from tworec.serving.protocol import DEFAULT_SIGNATURE

log = logging.getLogger(__name__)

_MODEL = r"/v1/models/(?P<name>[^/:]+)(?:/versions/(?P<version>[0-9]+)|/labels/(?P<label>[^/:]+))?"
VERBS = ("classify", "regress", "predict")
_PREDICT = re.compile(_MODEL + r":(?P<verb>%s)" % "|".join(VERBS), re.IGNORECASE)
_STATUS = re.compile(_MODEL + r"(?P<metadata>/metadata)?", re.IGNORECASE)
_NO_NAME = re.compile(r"/v1/models/?(?:/metadata)?", re.IGNORECASE)
_INT64_MAX = 2**63 - 1
# Bodies and answers larger than this are parsed and formatted off the event loop.
_INLINE_BYTES = 64 << 10
# The scope extension holding a future that is done once the client's connection is lost.
DISCONNECTED = "tworec.disconnected"
# The scope extension that is True when the request is over the server's concurrency limit.
OVER_LIMIT = "tworec.over_limit"
# The scope extension holding an async function that returns once the connection's write
# buffer is below its low-water mark, or the connection is lost.
DRAINED = "tworec.drained"


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def proto_json(message) -> dict:
    """Proto3 JSON of a message with its field names and default values kept."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


class RestApp:
    """The ASGI app.

    Args:
        manager: the served models.
        scheduler: runs checked requests (`batching.Direct` or `batching.Batcher`).
        timeout_seconds: a predict's deadline, from its arrival (`--rest_api_timeout_in_ms`);
            None for none.
        max_request_bytes: larger bodies are refused (HTTP 413).
        max_rows: the most rows an input of one request may have.
        body_timeout_seconds: a body not fully received by then is refused (HTTP 408).
        max_elements: the most elements the inputs of one request may have together.
        in_flight: the request bytes the server holds at once (shared with gRPC; None: one
            of its own, of `limits.default_max_request_bytes_in_flight`).
        body_stall_seconds: a body none of which arrives for this long is refused (HTTP 408):
            a stalled upload would otherwise hold its bytes of `in_flight` for the whole
            body timeout, and a few such uploads refuse every other request.
    """

    def __init__(self, manager: ModelManager, scheduler, timeout_seconds: float = 30.0,
                 max_request_bytes: int = 64 << 20, max_rows: int | None = None,
                 body_timeout_seconds: float = 30.0, max_elements: int | None = None,
                 in_flight: BytesInFlight | None = None, body_stall_seconds: float = 5.0):
        self.manager = manager
        self.in_flight = in_flight or BytesInFlight(
            default_max_request_bytes_in_flight(max_request_bytes))
        self.scheduler = scheduler
        self.timeout_seconds = timeout_seconds
        self.max_request_bytes = max_request_bytes
        self.max_rows = max_rows or default_max_rows()
        self.max_elements = max_elements or default_max_elements()
        self.body_timeout_seconds = body_timeout_seconds
        self.body_stall_seconds = body_stall_seconds

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        over_limit = scope.get("extensions", {}).get(OVER_LIMIT, False)
        unread = False                      # a body left partly unread closes the connection
        try:
            if over_limit:                # refused unread, as uvicorn's limit_concurrency does
                raise ServingError("UNAVAILABLE", "The server is serving as many requests as it "
                                   "may (--max_concurrent_requests); retry later")
            status, data = await self._answer(scope, receive)
        except ClientGone:
            return
        except ServingError as error:
            status, data = error.http_status, _json_bytes({"error": error.message})
            unread = getattr(error, "body_unread", False)
        except Exception:  # no request may take the server down; the log keeps the details
            log.exception("REST request %s %s failed", scope["method"], scope["path"])
            status, data = 500, _json_bytes({"error": "the request failed on the server; the "
                                                      "server log has the details"})
        with self.in_flight.reserve() as answer:           # until its client has read it
            answer.cover(len(data), refuse=False)
            await _send_json(send, status, data,
                             close=over_limit or unread or status in (408, 413))
            del data                          # what is unsent is in the transport's buffer
            drained = scope.get("extensions", {}).get(DRAINED)
            if drained is not None:
                await drained()

    async def _answer(self, scope, receive) -> tuple[int, bytes]:
        """(HTTP status, JSON body) of a request, serialized here so that an answer that
        cannot be written is an error answer too."""
        method = scope["method"]
        path = scope["raw_path"].decode("latin-1") if scope.get("raw_path") else scope["path"]
        if scope.get("query_string"):          # TF Serving matches the path with its query
            path += "?" + scope["query_string"].decode("latin-1")
        if not path.lower().startswith("/v1/"):
            raise ServingError("NOT_FOUND", f"Not found: {echo(path)}; the API is under /v1/")
        predict, status = _PREDICT.fullmatch(path), _STATUS.fullmatch(path)
        # The paths match in any case, the verb and "metadata" only as written (TF Serving's
        # handler compares them so: ":PREDICT" is malformed, "/METADATA" asks the status).
        if method == "POST" and predict and predict["verb"] in VERBS:
            deadline = (None if self.timeout_seconds is None else
                        time.monotonic() + self.timeout_seconds)
            self._refuse_declared_too_large(scope)
            with self.in_flight.reserve() as held:      # what has arrived, until the answer
                body = await self._read_body(receive, held)
                return 200, await self._predict(predict["verb"], *_model_spec(predict), body,
                                                scope, deadline, held)
        if method == "GET" and status:
            handler = self._metadata if status["metadata"] == "/metadata" else self._status
            return 200, _json_bytes(handler(*_model_spec(status)))
        if method == "GET" and _NO_NAME.fullmatch(path):
            raise ServingError("INVALID_ARGUMENT", "Missing model name in request.")
        raise ServingError("INVALID_ARGUMENT", f"Malformed request: {echo(method)} {echo(path)}")

    def _refuse_declared_too_large(self, scope) -> None:
        """Refuses unread a body whose Content-Length is over the limit."""
        length = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.max_request_bytes:
            raise self._too_large(int(length))

    async def _read_body(self, receive, held: Reservation) -> bytes:
        """The whole request body, its bytes `held` as they arrive, refused when it is not
        complete within the body timeout."""
        try:
            async with asyncio.timeout(self.body_timeout_seconds):
                return await self._receive_body(receive, held)
        except TimeoutError as error:
            raise ServingError("DEADLINE_EXCEEDED", "The request body did not arrive within "
                               f"{self.body_timeout_seconds:g} s", http_status=408) from error

    async def _receive_body(self, receive, held: Reservation) -> bytes:
        chunks, size = [], 0
        while True:
            try:
                async with asyncio.timeout(self.body_stall_seconds):
                    message = await receive()
            except TimeoutError as error:
                raise ServingError("DEADLINE_EXCEEDED", f"The request body stalled: none of "
                                   f"it arrived for {self.body_stall_seconds:g} s",
                                   http_status=408) from error
            if message["type"] == "http.disconnect":      # a partial body is never run
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                raise self._too_large(size)
            try:
                held.cover(size)
            except ServingError as error:
                error.body_unread = message.get("more_body", False)
                raise
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, size: int) -> ServingError:
        return ServingError("RESOURCE_EXHAUSTED", f"Request body of {size} bytes or more "
                            f"exceeds the limit of {self.max_request_bytes} bytes "
                            "(--max_request_bytes)", http_status=413)

    async def _predict(self, verb: str, name: str, version: int | None, label: str | None,
                       body: bytes, scope, deadline: float | None, held: Reservation) -> bytes:
        if verb.lower() != "predict":
            parse_json(body)             # as TF Serving: the body, then the model, then this
            with self.manager.lease(name, version, label):
                pass
            raise ServingError("UNIMPLEMENTED", f"{verb} is not supported by this server; use "
                               ":predict with a predict signature")
        big = len(body) > _INLINE_BYTES
        request = await _maybe_offload(big, parse_json, body)
        signature = signature_name(request)
        with self.manager.lease(name, version, label) as (_, model):
            inputs, row_form = await _maybe_offload(
                big, parse_predict, request, _rest_signature(model, signature), self.max_rows,
                self.max_elements)
            gone = scope.get("extensions", {}).get(DISCONNECTED)
            future = self.scheduler.submit(model, inputs, signature, (), deadline,
                                           gone.done if gone else lambda: False)
            held.hold_until(future)               # a run left behind still holds its bytes
            outputs = await _wait(future, scope, deadline, self.timeout_seconds)
        big = sum(getattr(value, "nbytes", 0) for value in outputs.values()) > _INLINE_BYTES
        return await _maybe_offload(big, format_predict, outputs, row_form)

    def _status(self, name: str, version: int | None, label: str | None) -> dict:
        return proto_json(self.manager.status(name, version))      # a label: every version

    def _metadata(self, name: str, version: int | None, label: str | None) -> dict:
        with self.manager.lease(name, version, label) as (number, model):
            signatures = model.signature_def_map()
        spec = {"name": name, "signature_name": "", "version": str(number)}
        return {"model_spec": spec, "metadata": {"signature_def": proto_json(signatures)}}


async def _maybe_offload(big: bool, function, *args):
    """`function(*args)`, in a worker thread when the data is big (the loop stays free)."""
    if not big:
        return function(*args)
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)


async def _wait(future, scope, deadline: float | None, timeout_seconds: float | None):
    """The result of a scheduled run; cancels it (dropped if not started) when the client
    disconnects (`ClientGone`) or the deadline, if any, passes (DEADLINE_EXCEEDED)."""
    result = asyncio.wrap_future(future)
    gone = scope.get("extensions", {}).get(DISCONNECTED)

    def cancel(_) -> None:
        result.cancel()
    if gone is not None:
        gone.add_done_callback(cancel)
    timed_out = ServingError("DEADLINE_EXCEEDED", f"Request timed out after "
                             f"{timeout_seconds or 0:g} s (--rest_api_timeout_in_ms)")
    try:
        async with asyncio.timeout(None if deadline is None else
                                   max(deadline - time.monotonic(), 0)):
            return await result
    except TimeoutError as error:
        raise timed_out from error
    except asyncio.CancelledError:
        if gone is not None and gone.done():
            raise ClientGone() from None
        raise
    except ServingError as error:
        raise timed_out if error.code == "DEADLINE_EXCEEDED" else error
    finally:
        if gone is not None:
            gone.remove_done_callback(cancel)


def _model_spec(match: re.Match) -> tuple[str, int | None, str | None]:
    """(name, version or None, label or None) of a matched path, URL-decoded."""
    return (urllib.parse.unquote(match["name"]),
            _version(match["version"]) if match["version"] else None,
            urllib.parse.unquote(match["label"]) if match["label"] else None)


def _version(digits: str) -> int:
    """A path's version as an int64, as TF Serving parses it (`absl::SimpleAtoi`)."""
    significant = digits.lstrip("0") or "0"         # int() refuses over 4300 digits
    if len(significant) > len(str(_INT64_MAX)) or int(significant) > _INT64_MAX:
        raise ServingError("INVALID_ARGUMENT",
                           f"Failed to convert version: {echo(digits)} to numeric.")
    return int(significant)


def _json_bytes(body: dict) -> bytes:
    """JSON with NaN and Infinity written as TF Serving writes them."""
    return json.dumps(body).encode("utf-8")


async def _send_json(send, status: int, data: bytes, close: bool = False) -> None:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode("ascii"))]
    if close:                             # the body may be unread: end the connection
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _rest_signature(model, name: str):
    """`model.signature(name)`, refused in the words of TF Serving's REST API
    (`HttpRestApiHandler::GetInfoMap`), not of its gRPC one."""
    try:
        return model.signature(name)
    except ServingError as error:
        if error.code != "FAILED_PRECONDITION":
            raise
        raise ServingError("INVALID_ARGUMENT", 'Serving signature name: '
                           f'"{truncate(name or DEFAULT_SIGNATURE, MAX_ECHOED)}" not found in '
                           "signature def") from None


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request head (request line and
    headers) has not fully arrived `config.header_timeout_seconds` after the connection opened
    or, on a kept-alive connection, after the head's first bytes (uvicorn itself has no such
    timeout; an idle kept-alive connection is closed by its keep-alive timeout). Each request's
    scope carries, under `extensions[DISCONNECTED]`, a future done once the connection is lost,
    and under `extensions[OVER_LIMIT]` whether it is beyond `config.max_concurrent_requests`
    requests in flight, itself counted (uvicorn's `limit_concurrency` would also count idle
    connections, so a client's pool of kept-alive ones could refuse every other client; its
    503 answer is not JSON either), and under `extensions[DRAINED]` a wait for its write
    buffer to drain, which aborts the connection when it has not drained within
    `config.write_timeout_seconds`. While writes are paused (the buffer over its high-water
    mark), a connection whose client reads nothing for `config.write_stall_seconds` is aborted.
    """

    _header_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None
    _seen_cycle = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._disconnected = self.loop.create_future()
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()                   # the first bytes of the next request's head
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not self._seen_cycle:   # a new request's head has arrived
            self._seen_cycle = self.cycle
            self._disarm()
            extensions = self.scope.setdefault("extensions", {})
            extensions[DISCONNECTED] = self._disconnected
            extensions[DRAINED] = self._drain
            limit = self.config.max_concurrent_requests   # its own task counted
            extensions[OVER_LIMIT] = limit is not None and len(self.tasks) > limit

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._stop_watching_writes()
        if not self._disconnected.done():
            self._disconnected.set_result(None)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_writes(None)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_watching_writes()

    async def _drain(self) -> None:
        """Returns once the write buffer is below its low-water mark, or the connection is
        lost; aborts the connection, dropping what is unsent, when its client has not read
        that much within `config.write_timeout_seconds` (a client reading a byte now and then
        is never stalled, yet would hold its answer for as long as it liked)."""
        try:
            async with asyncio.timeout(self.config.write_timeout_seconds):
                await self.flow.drain()
        except TimeoutError:
            log.info("aborting a connection whose client did not read its answer within %g s",
                     self.config.write_timeout_seconds)
            self._abort()

    def _watch_writes(self, left_before: int | None) -> None:
        """Aborts the connection when none of its write buffer has been sent since the last
        look, `config.write_stall_seconds` ago; otherwise looks again that much later."""
        left = self.transport.get_write_buffer_size()
        if left == left_before:
            log.info("aborting a connection whose client read none of its %d unsent bytes for "
                     "%g s", left, self.config.write_stall_seconds)
            self._write_timer = None
            self._abort()
            return
        self._write_timer = self.loop.call_later(self.config.write_stall_seconds,
                                                 self._watch_writes, left)

    def _abort(self) -> None:
        """Closes the connection with a reset, dropping what is unsent in the server's buffer
        and in the kernel's (a plain close goes on sending the kernel's megabytes to a client
        that reads them slowly)."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):                 # a socket already closed
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _stop_watching_writes(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.config.header_timeout_seconds,
                                                  self._header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()
