"""TF Serving's REST API as an ASGI app (`model_servers/http_rest_api_handler.cc`).

    GET  /v1/models/NAME[/versions/V | /labels/L]            status
    GET  /v1/models/NAME[/versions/V | /labels/L]/metadata   metadata
    POST /v1/models/NAME[/versions/V | /labels/L]:predict    predict

Every answer is JSON; errors are `{"error": MESSAGE}` with TF Serving's HTTP codes. A body larger
than `max_request_bytes` is refused before it is read.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import urllib.parse

from google.protobuf import json_format

from tworec.serving.batching import run_directly
from tworec.serving.errors import ServingError
from tworec.serving.json_tensor import format_predict, parse_json, parse_predict, signature_name
from tworec.serving.manager import ModelManager

log = logging.getLogger(__name__)

_MODEL = r"/v1/models/(?P<name>[^/:]+)(?:/versions/(?P<version>\d+)|/labels/(?P<label>[^/:]+))?"
_PREDICT = re.compile(_MODEL + r":(?P<verb>classify|regress|predict)", re.IGNORECASE)
_STATUS = re.compile(_MODEL + r"(?P<metadata>/metadata)?", re.IGNORECASE)
_NO_NAME = re.compile(r"/v1/models/?(?:/metadata)?", re.IGNORECASE)


def proto_json(message) -> dict:
    """Proto3 JSON of a message with its field names and default values kept."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


class RestApp:
    """The ASGI app.

    Args:
        manager: the served models.
        timeout_seconds: a request still running after this long answers DEADLINE_EXCEEDED.
        max_request_bytes: larger bodies are refused (HTTP 413).
        run: runs a checked request on a model (`run_directly`, or a `Batcher`).
    """

    def __init__(self, manager: ModelManager, timeout_seconds: float = 30.0,
                 max_request_bytes: int = 64 << 20, run=run_directly):
        self.manager = manager
        self.run = run
        self.timeout_seconds = timeout_seconds
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        try:
            status, body = await self._answer(scope, receive)
        except ServingError as error:
            status, body = error.http_status, {"error": error.message}
        except Exception as error:  # no request may take the server down
            log.exception("REST request failed")
            status, body = 500, {"error": f"{type(error).__name__}: {error}"}
        await _send_json(send, status, body)

    async def _answer(self, scope, receive) -> tuple[int, dict]:
        method = scope["method"]
        path = scope["raw_path"].decode("latin-1") if scope.get("raw_path") else scope["path"]
        if not path.lower().startswith("/v1/"):
            raise ServingError("NOT_FOUND", f"Not found: {path}; the API is under /v1/")
        predict, status = _PREDICT.fullmatch(path), _STATUS.fullmatch(path)
        if method == "POST" and predict:
            body = await self._read_body(scope, receive)
            return 200, await self._run(self._predict, predict["verb"], *_model_spec(predict),
                                        body)
        if method == "GET" and status:
            handler = self._metadata if status["metadata"] else self._status
            return 200, await self._run(handler, *_model_spec(status))
        if method == "GET" and _NO_NAME.fullmatch(path):
            raise ServingError("INVALID_ARGUMENT", "Missing model name in request.")
        raise ServingError("INVALID_ARGUMENT", f"Malformed request: {method} {path}")

    async def _run(self, handler, *args) -> dict:
        """Runs a blocking handler in a worker thread, within the request timeout."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(None, handler, *args),
                                          self.timeout_seconds)
        except asyncio.TimeoutError as error:
            raise ServingError("DEADLINE_EXCEEDED", "Request timed out after "
                               f"{self.timeout_seconds:g} s (--rest_api_timeout_in_ms)") from error

    async def _read_body(self, scope, receive) -> bytes:
        """The request body, refused unread when its Content-Length is over the limit."""
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.max_request_bytes:
            raise self._too_large(int(length))
        chunks, size = [], 0
        while True:
            message = await receive()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                raise self._too_large(size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, size: int) -> ServingError:
        return ServingError("RESOURCE_EXHAUSTED", f"Request body of {size} bytes or more "
                            f"exceeds the limit of {self.max_request_bytes} bytes "
                            "(--max_request_bytes)", http_status=413)

    def _predict(self, verb: str, name: str, version: int | None, label: str | None,
                 body: bytes) -> dict:
        if verb.lower() != "predict":
            raise ServingError("UNIMPLEMENTED", f"{verb} is not supported by this server; use "
                               ":predict with a predict signature")
        request = parse_json(body)
        signature = signature_name(request)
        with self.manager.lease(name, version, label) as (_, model):
            inputs, row_form = parse_predict(request, model.signature(signature))
            outputs = self.run(model, inputs, signature)
        return format_predict(outputs, row_form)

    def _status(self, name: str, version: int | None, label: str | None) -> dict:
        return proto_json(self.manager.status(name, version, label))

    def _metadata(self, name: str, version: int | None, label: str | None) -> dict:
        with self.manager.lease(name, version, label) as (number, model):
            signatures = model.signature_def_map()
        spec = {"name": name, "signature_name": "", "version": str(number)}
        return {"model_spec": spec, "metadata": {"signature_def": proto_json(signatures)}}


def _model_spec(match: re.Match) -> tuple[str, int | None, str | None]:
    """(name, version or None, label or None) of a matched path, URL-decoded."""
    return (urllib.parse.unquote(match["name"]),
            int(match["version"]) if match["version"] else None,
            urllib.parse.unquote(match["label"]) if match["label"] else None)


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode("utf-8")
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode("ascii"))]})
    await send({"type": "http.response.body", "body": data})

