"""A client of TF Serving's public REST and gRPC APIs (real TF Serving or the embedded server).

    client = Client(url="http://127.0.0.1:8501")   # or Client(grpc_target="127.0.0.1:8500")
    outputs = client.predict("retrieval", {"user_id": np.array([b"42"])})
    outputs["item_ids"]                                  # [1, k] bytes

Both transports take and return dicts of NumPy arrays (strings as bytes), send numbers as the
signature's dtype reads them (a float64 array to a float32 input, over gRPC too), raise
`ServingError` with the TF error code, and retry UNAVAILABLE (HTTP 503, refused connections)
with exponential backoff. A predict with more rows than `max_rows_per_request` is sent in
parts (servers bound the rows of one request) and the answers are joined along dimension 0.

TensorFlow and the TF Serving protos are imported by the calls that need them, so that
importing the client (a script's `--help`) does not load TensorFlow.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
import threading
import time
import urllib.parse

import grpc
import numpy as np
import requests
from google.protobuf import json_format

from tworec.serving.errors import CODE_OF_HTTP_STATUS, ServingError
from tworec.serving.protocol import DEFAULT_SIGNATURE, INT32_MAX

# NumPy kinds of the inputs gRPC sends in the dtype of the signature (REST sends JSON numbers).
NUMERIC = "iuf"


class Client:
    """Calls a model server over REST (`url`) or gRPC (`grpc_target`); give one of them.

    Args:
        url: the REST base URL, e.g. "http://127.0.0.1:8501".
        grpc_target: the gRPC "HOST:PORT", e.g. "127.0.0.1:8500".
        timeout: seconds for each request to the server (a predict may first look up the
            version and its signature).
        retries: extra attempts after an UNAVAILABLE answer.
        backoff: seconds before the first retry, doubled for every further one.
        max_rows_per_request: larger predicts are split into requests of this many rows.
    """

    def __init__(self, url: str | None = None, grpc_target: str | None = None,
                 timeout: float = 10.0, retries: int = 3, backoff: float = 0.1,
                 max_rows_per_request: int = 256):
        if (url is None) == (grpc_target is None):
            raise ValueError("give exactly one of url (REST) or grpc_target (HOST:PORT)")
        self.transport = (RestTransport(url, timeout) if url
                          else GrpcTransport(grpc_target, timeout))
        self.retries = retries
        self.backoff = backoff
        self.max_rows_per_request = max_rows_per_request

    def predict(self, model: str, inputs: dict[str, np.ndarray],
                signature_name: str = DEFAULT_SIGNATURE,
                version: int | None = None) -> dict[str, np.ndarray]:
        """Runs a signature; inputs and outputs are name -> array [batch, ...]. A request
        split into parts sends every part after the first to the version that answered the
        first, so a hot swap meanwhile never joins two versions' answers (a request for the
        latest version whose first answer's version is retired meanwhile starts over once; a
        request for a given version retired meanwhile is NOT_FOUND)."""
        return self.predict_version(model, inputs, signature_name, version)[0]

    def predict_version(self, model: str, inputs: dict[str, np.ndarray],
                        signature_name: str = DEFAULT_SIGNATURE, version: int | None = None
                        ) -> tuple[dict[str, np.ndarray], int | None]:
        """`predict`, and the version that answered, to send a dependent request to the same
        version.

        Args:
            model, inputs, signature_name, version: as `predict`'s.

        Returns:
            (outputs name -> [batch, ...], the version that answered: an int, or None when the
            server does not say).
        """
        inputs = {name: _request_array(name, value) for name, value in inputs.items()}
        rows = {len(value) if value.ndim else None for value in inputs.values()}
        if len(rows) != 1 or None in rows or rows.pop() <= self.max_rows_per_request:
            return self._retry(self.transport.predict, model, inputs, signature_name, version)
        for attempt in range(2):
            try:
                return self._in_parts(model, inputs, signature_name, version)
            except ServingError as error:
                if version is not None or error.code != "NOT_FOUND" or attempt == 1:
                    raise

    def _in_parts(self, model: str, inputs: dict[str, np.ndarray], signature_name: str,
                  version: int | None) -> tuple[dict[str, np.ndarray], int | None]:
        """`predict_version` in requests of `max_rows_per_request` rows, all to one version."""
        size, parts = self.max_rows_per_request, []
        for start in range(0, len(next(iter(inputs.values()))), size):
            part, version = self._retry(self.transport.predict, model,
                                        {name: value[start:start + size]
                                         for name, value in inputs.items()},
                                        signature_name, version)
            parts.append(part)
        return ({name: np.concatenate([part[name] for part in parts]) for name in parts[0]},
                version)

    def status(self, model: str, version: int | None = None
               ) -> get_model_status_pb2.GetModelStatusResponse:
        """The state of every version of `model` (or of one version)."""
        return self._retry(self.transport.status, model, version)

    def metadata(self, model: str, version: int | None = None
                 ) -> get_model_metadata_pb2.SignatureDefMap:
        """The signatures of the latest (or a given) version of `model`."""
        return self._retry(self.transport.metadata, model, version)

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _retry(self, call, *args):
        for attempt in range(self.retries + 1):
            try:
                return call(*args)
            except ServingError as error:
                if error.code != "UNAVAILABLE" or attempt == self.retries:
                    raise
            time.sleep(self.backoff * 2**attempt)


class _NoLookup(ServingError):
    """The server does not answer GetModelStatus or GetModelMetadata (UNIMPLEMENTED)."""


class Transport:
    """What both transports share: the latest AVAILABLE version of a model as its status last
    said (read again when over `LATEST_SECONDS` old), and the signature of the version a
    request goes to, read from the metadata and kept until the model's next look (a moved
    model may reuse a version number). One client may be shared by threads. Subclasses give
    `status` and `metadata`."""

    LATEST_SECONDS = 1.0       # how long a looked-up latest version is used before a new look

    def __init__(self):
        self._signatures: dict[tuple, object] = {}
        self._latest_seen: dict[str, tuple[int, float]] = {}   # model -> (version, when)
        self._lock = threading.Lock()                           # guards the two caches

    def _at_version(self, model: str, version: int | None, signature_name: str, send):
        """`send(number, signature)` for `version`, or for the latest AVAILABLE version when
        None, with that version's signature; once more at a fresh look when the latest version
        looked up was retired meanwhile (NOT_FOUND).

        Returns:
            (what `send` returned, the version it was sent to, that version's signature).
        """
        for attempt in range(2):
            number = version if version is not None else self._latest(model, fresh=attempt > 0)
            try:
                signature = self._signature(model, number, signature_name)
                return send(number, signature), number, signature
            except ServingError as error:
                if version is not None or error.code != "NOT_FOUND" or attempt == 1:
                    raise

    def _latest(self, model: str, fresh: bool = False) -> int:
        """The latest AVAILABLE version of `model`, as its status said at most
        `LATEST_SECONDS` ago (now, if `fresh`); NOT_FOUND as a predict answers it."""
        from tensorflow_serving.apis import get_model_status_pb2
        with self._lock:
            seen = self._latest_seen.get(model)
        if seen and not fresh and time.monotonic() - seen[1] < self.LATEST_SECONDS:
            return seen[0]
        try:
            states = self.status(model, None).model_version_status
        except ServingError as error:
            if error.code == "UNIMPLEMENTED":
                raise _NoLookup(error.code, error.message) from error
            if error.code != "NOT_FOUND":
                raise
            states = []
        available = [s.version for s in states
                     if s.state == get_model_status_pb2.ModelVersionStatus.AVAILABLE]
        if not available:
            raise ServingError("NOT_FOUND", f"Servable not found for request: Latest({model})")
        with self._lock:
            self._latest_seen[model] = (max(available), time.monotonic())
            for key in [key for key in self._signatures if key[0] == model]:
                del self._signatures[key]         # a moved model may reuse a version number
        return max(available)

    def _signature(self, model: str, version: int, name: str):
        with self._lock:
            signature = self._signatures.get((model, version, name))
        if signature is None:
            try:
                signatures = self.metadata(model, version).signature_def
            except ServingError as error:
                if error.code == "UNIMPLEMENTED":
                    raise _NoLookup(error.code, error.message) from error
                raise
            if name not in signatures:
                raise ServingError("FAILED_PRECONDITION",
                                   f'Serving signature key "{name}" not found.')
            signature = signatures[name]
            with self._lock:
                self._signatures[model, version, name] = signature
        return signature

    def _forget(self, model: str, version: int, name: str) -> None:
        """Drops a cached signature that an answer showed stale."""
        with self._lock:
            self._signatures.pop((model, version, name), None)


class GrpcTransport(Transport):
    """`PredictionService` and `ModelService` stubs on one channel. Tensors are typed, so a
    predict with a numeric input (NumPy kinds i, u, f) sends each input in the dtype the
    signature declares for it (`_typed_inputs`), as a REST server reads JSON values, and goes
    to the version whose signature it read (GetModelStatus and GetModelMetadata, cached as
    `Transport` says; a server without them gets the inputs as given); a predict without a
    numeric input is sent as it is."""

    def __init__(self, target: str, timeout: float):
        from tensorflow_serving.apis import model_service_pb2_grpc, prediction_service_pb2_grpc
        super().__init__()
        self.timeout = timeout
        self.typed = True             # False once the server says it has no lookups
        self.channel = grpc.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", INT32_MAX),
            ("grpc.max_send_message_length", INT32_MAX)])
        self.prediction = prediction_service_pb2_grpc.PredictionServiceStub(self.channel)
        self.models = model_service_pb2_grpc.ModelServiceStub(self.channel)

    def predict(self, model: str, inputs: dict[str, np.ndarray], signature_name: str,
                version: int | None) -> tuple[dict[str, np.ndarray], int | None]:
        """(the outputs, the version that answered)."""
        if self.typed and any(value.dtype.kind in NUMERIC for value in inputs.values()):
            try:
                return self._at_version(model, version, signature_name, lambda number, sig: (
                    self._typed_predict(model, inputs, signature_name, number, sig)))[0]
            except _NoLookup:             # no ModelService or metadata to read the dtypes from
                self.typed = False
        return self._predict(model, inputs, signature_name, version)

    def _typed_predict(self, model: str, inputs: dict[str, np.ndarray], signature_name: str,
                       version: int, signature) -> tuple[dict[str, np.ndarray], int | None]:
        """A predict of `inputs` typed by `signature`; refused by the server (INVALID_ARGUMENT),
        sent once more when the signature read again differs (a cached one was stale: a moved
        model reusing the version number), else the refusal stands. An integer the cached
        signature's dtype cannot hold is refused here, before any send."""
        typed = _typed_inputs(inputs, signature)
        try:
            return self._predict(model, typed, signature_name, version)
        except ServingError as refused:
            if refused.code != "INVALID_ARGUMENT":
                raise
            self._forget(model, version, signature_name)
            try:
                fresh = self._signature(model, version, signature_name)
            except ServingError:
                raise refused from None
            if fresh == signature:
                raise
        return self._predict(model, _typed_inputs(inputs, fresh), signature_name, version)

    def _predict(self, model: str, inputs: dict[str, np.ndarray], signature_name: str,
                 version: int | None) -> tuple[dict[str, np.ndarray], int | None]:
        import tensorflow as tf
        from tensorflow_serving.apis import predict_pb2
        request = predict_pb2.PredictRequest()
        _fill_spec(request.model_spec, model, version, signature_name)
        for name, value in inputs.items():
            request.inputs[name].CopyFrom(tf.make_tensor_proto(value))
        response = self._call(self.prediction.Predict, request)
        return ({name: tf.make_ndarray(proto) for name, proto in response.outputs.items()},
                response.model_spec.version.value if response.model_spec.HasField("version")
                else version)

    def status(self, model: str, version: int | None):
        from tensorflow_serving.apis import get_model_status_pb2
        request = get_model_status_pb2.GetModelStatusRequest()
        _fill_spec(request.model_spec, model, version)
        return self._call(self.models.GetModelStatus, request)

    def metadata(self, model: str, version: int | None):
        from tensorflow_serving.apis import get_model_metadata_pb2
        request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        _fill_spec(request.model_spec, model, version)
        response = self._call(self.prediction.GetModelMetadata, request)
        signatures = get_model_metadata_pb2.SignatureDefMap()
        response.metadata["signature_def"].Unpack(signatures)
        return signatures

    def close(self) -> None:
        self.channel.close()

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as error:
            raise ServingError(error.code().name, error.details() or "") from error


class RestTransport(Transport):
    """The `/v1/models` REST API; predict sends the columnar form (`inputs`).

    A predict response does not name a single output nor carry dtypes, so the transport decodes
    it with the signature of the version that answered. A predict of the latest version is
    sent to the model's latest AVAILABLE version as its status last said, so a hot swap to a
    version with another signature never decodes an answer with the old one (a version
    retired meanwhile is looked up again once). An answer that does not fit the cached
    signature refetches it once, then is an INTERNAL `ServingError`, never a wrong answer.
    """

    def __init__(self, url: str, timeout: float):
        super().__init__()
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()
        # One kept-alive connection per concurrent caller (requests keeps 10 by default).
        self.session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=64))

    def predict(self, model: str, inputs: dict[str, np.ndarray], signature_name: str,
                version: int | None) -> tuple[dict[str, np.ndarray], int]:
        """(the outputs, the version that answered)."""
        body = {"signature_name": signature_name,
                "inputs": {name: _json_of_array(value) for name, value in inputs.items()}}
        answer, number, signature = self._at_version(
            model, version, signature_name, lambda number, signature: self._request(
                "POST", _model_path(model, number) + ":predict", body))
        try:
            return _outputs_of_json(answer, signature), number
        except ServingError:                 # the version's signature changed: refetch once
            self._forget(model, number, signature_name)
            return _outputs_of_json(answer, self._signature(model, number, signature_name)), \
                number

    def status(self, model: str, version: int | None):
        from tensorflow_serving.apis import get_model_status_pb2
        answer = self._request("GET", _model_path(model, version))
        return json_format.ParseDict(answer, get_model_status_pb2.GetModelStatusResponse(),
                                     ignore_unknown_fields=True)

    def metadata(self, model: str, version: int | None):
        return _signature_map(self._request("GET", _model_path(model, version) + "/metadata"))

    def close(self) -> None:
        self.session.close()

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        # json.dumps writes NaN and Infinity, which TF Serving parses (requests' json= refuses).
        data = None if body is None else json.dumps(body).encode("utf-8")
        try:
            response = self.session.request(
                method, self.url + path, data=data, timeout=self.timeout,
                headers=None if data is None else {"Content-Type": "application/json"})
        except requests.Timeout as error:
            raise ServingError("DEADLINE_EXCEEDED", f"{method} {path}: {error}") from error
        except requests.ConnectionError as error:
            raise ServingError("UNAVAILABLE", f"{method} {self.url}{path}: "
                               f"{_connection_failure(error)}") from error
        try:
            answer = response.json()
        except ValueError:
            answer = {"error": response.text}
        if response.status_code != 200:
            raise ServingError(CODE_OF_HTTP_STATUS.get(response.status_code, "UNKNOWN"),
                               answer.get("error", response.text) if isinstance(answer, dict)
                               else response.text, http_status=response.status_code)
        return answer


def _connection_failure(error: requests.ConnectionError) -> str:
    """What urllib3's nested exception text comes to: "cannot connect ([Errno 111]
    Connection refused)", or its first line when it names no OS error."""
    text = str(error)
    found = re.search(r"\[Errno -?\d+\] [^'\")(]+", text)
    to = " through the proxy" if isinstance(error, requests.exceptions.ProxyError) else ""
    return (f"cannot connect{to} ({found.group(0).strip()})" if found else
            text.splitlines()[0] if text else type(error).__name__)


def _fill_spec(spec, model: str, version: int | None, signature_name: str = "") -> None:
    spec.name = model
    spec.signature_name = signature_name
    if version is not None:
        spec.version.value = version


def _model_path(model: str, version: int | None) -> str:
    path = "/v1/models/" + urllib.parse.quote(model, safe="")
    return path if version is None else f"{path}/versions/{version}"


def _request_array(name: str, value) -> np.ndarray:
    """An input as both transports send it alike: text (str or bytes, in an object or a
    unicode array) as UTF-8 bytes in an object array; anything else as NumPy makes it.

    Raises:
        ValueError: text that is not valid Unicode (a lone surrogate), or an object array
            holding something besides text (ints among ids).
    """
    try:
        array = np.asarray(value)
    except UnicodeDecodeError:              # bytes that are not ASCII beside str, in a list
        array = np.array(value, dtype=object)
    if isinstance(value, (list, tuple)) and array.dtype.kind in "US":
        array = np.array(value, dtype=object)      # NumPy made ints among text into text
    if array.dtype.kind not in "OU":
        return array
    flat = np.empty(array.size, object)
    for index, item in enumerate(array.reshape(-1).tolist()):
        if isinstance(item, np.ndarray) and item.ndim == 0:       # [np.array("u1"), ...]
            item = item.item()
        if isinstance(item, str):
            try:
                item = item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"input {name!r}: {item!r} is not valid Unicode text (a lone "
                                 "surrogate?)") from None
        elif not isinstance(item, bytes):
            raise ValueError(f"input {name!r}: a {type(item).__name__} ({item!r}) among text; "
                             "give ids as str or bytes, or numbers as a numeric array")
        flat[index] = item
    return flat.reshape(array.shape)


def _typed_inputs(inputs: dict[str, np.ndarray], signature) -> dict[str, np.ndarray]:
    """`inputs` with each numeric one in the dtype `signature` declares for it, as a REST server
    reads JSON values (`json_tensor`): any number into a floating input (a float64 array to
    float32; float16 and bfloat16 too, which REST does not read), an integer into an integer
    input within what JSON may give it (int8, int16 and uint8 read as int32 and wrapped;
    uint16, which REST does not read, within its range), an empty array into any input; any
    other input as given (the server refuses a dtype that does not fit, a float for an
    integer input).

    Raises:
        ServingError: INVALID_ARGUMENT, an integer outside what its input's dtype reads.
    """
    import tensorflow as tf
    from tworec.serving.json_tensor import JSON_INT_RANGES
    typed = dict(inputs)
    for name, value in inputs.items():
        if name not in signature.inputs or value.dtype.kind not in NUMERIC:
            continue
        dtype = tf.as_dtype(signature.inputs[name].dtype)
        if not value.size:
            pass                                     # an empty array fits any input
        elif dtype.is_integer and value.dtype.kind in "iu":
            low, high = JSON_INT_RANGES.get(dtype, (dtype.min, dtype.max + 1))
            if not low <= value.min() <= value.max() < high:
                raise ServingError("INVALID_ARGUMENT", f'Input "{name}": a value is outside '
                                   f"what an input of {dtype.name} reads ({low} to {high - 1})")
        elif not dtype.is_floating:
            continue
        with np.errstate(over="ignore"):             # 1e39 is float32's inf, as over REST
            typed[name] = value.astype(dtype.as_numpy_dtype)
    return typed


def _json_of_array(value: np.ndarray):
    """Nested lists; strings as text when they are UTF-8, else `{"b64": ...}`."""
    if value.dtype.kind not in "OSU":
        return value.tolist()
    flat = np.empty(value.size, object)
    flat[:] = [_json_of_string(item) for item in value.reshape(-1)]
    return flat.reshape(value.shape).tolist()


def _json_of_string(item):
    if isinstance(item, str):
        return item
    try:
        return item.decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(item).decode("ascii")}


def _signature_map(answer: dict):
    """The `SignatureDefMap` of a metadata answer."""
    from tensorflow_serving.apis import get_model_metadata_pb2
    try:
        return json_format.ParseDict(answer["metadata"]["signature_def"],
                                     get_model_metadata_pb2.SignatureDefMap(),
                                     ignore_unknown_fields=True)
    except (KeyError, TypeError, json_format.ParseError) as error:
        raise ServingError("INTERNAL", f"Malformed metadata answer: {error}") from error


def _outputs_of_json(answer: dict, signature) -> dict[str, np.ndarray]:
    """The outputs of a columnar predict answer, typed by `signature`; INTERNAL when the answer
    does not fit the signature (its names, dtypes or shapes)."""
    import tensorflow as tf
    names = sorted(signature.outputs)
    outputs = answer.get("outputs") if isinstance(answer, dict) else None
    if len(names) == 1 and not (isinstance(outputs, dict) and list(outputs) != ["b64"]):
        outputs = {names[0]: outputs}
    if not isinstance(outputs, dict) or sorted(outputs) != names:
        got = sorted(outputs) if isinstance(outputs, dict) else type(outputs).__name__
        raise ServingError("INTERNAL", f"The predict answer's outputs {got} do not match the "
                           f"signature's {names}")
    try:
        return {name: _in_its_rank(_array_of_json(value, tf.as_dtype(signature.outputs[name]
                                                                     .dtype)),
                                   signature.outputs[name].tensor_shape)
                for name, value in outputs.items()}
    except (TypeError, ValueError, OverflowError, AttributeError, KeyError,
            binascii.Error) as error:
        raise ServingError("INTERNAL", f"The predict answer does not match the signature's "
                           f"dtypes or shapes: {error}") from error


def _in_its_rank(array: np.ndarray, shape) -> np.ndarray:
    """An empty answer (JSON `[]`, which keeps no inner sizes) in the rank of the signature's
    `shape` (a TensorShapeProto): [0, ...] with its known sizes, as gRPC's tensors carry it,
    and 0 for the sizes the signature leaves open (gRPC's may be larger)."""
    if array.size or shape.unknown_rank or array.ndim == len(shape.dim) or not shape.dim:
        return array
    return array.reshape([0] + [max(dim.size, 0) for dim in shape.dim[1:]])


def _array_of_json(value, dtype: tf.DType) -> np.ndarray:
    """An output of the JSON response as an array of the signature's dtype; ValueError when a
    value is not of that dtype (an integer for a float output, a string for a number)."""
    import tensorflow as tf
    if dtype == tf.bool:
        return _typed_array(value, dtype, lambda v: isinstance(v, bool))
    if dtype.is_integer:
        return _typed_array(value, dtype, lambda v: isinstance(v, int) and not isinstance(v, bool))
    if dtype.is_floating:            # both servers write floats with a "." or an exponent
        return _typed_array(value, dtype, lambda v: isinstance(v, float))
    if dtype != tf.string:
        return np.asarray(value, dtype=dtype.as_numpy_dtype)
    strings = np.asarray(value, dtype=object)
    flat = np.empty(strings.size, object)
    flat[:] = [base64.b64decode(s["b64"], validate=True) if isinstance(s, dict)
               else s.encode("utf-8") for s in strings.reshape(-1)]
    return flat.reshape(strings.shape)


def _typed_array(value, dtype: tf.DType, accepts) -> np.ndarray:
    """`value` (nested lists) as an array of `dtype`, every element checked by `accepts`."""
    array = np.asarray(value, dtype=object)
    if not all(accepts(item) for item in array.reshape(-1)):
        raise ValueError(f"a value is not of dtype {dtype.name}")
    return array.astype(dtype.as_numpy_dtype)
