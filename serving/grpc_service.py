"""TF Serving's gRPC `PredictionService` and `ModelService` on the `tensorflow-serving-api` protos.

Status codes are TF's codes unchanged; messages are cut to 1024 characters plus "...TRUNCATED".
A Predict hands its request to the scheduler and waits for it until the call's deadline; a call
that ends first (deadline or client cancel) has its run dropped if it has not started.
Status and metadata never wait for a model run. `HandleReloadConfigRequest` only loads base
paths under the manager's allowed roots (PERMISSION_DENIED otherwise).
"""
from __future__ import annotations

import functools
import logging
import time

import grpc
import tensorflow as tf
from tensorflow_serving.apis import (get_model_metadata_pb2, model_management_pb2,
                                     model_service_pb2_grpc, predict_pb2,
                                     prediction_service_pb2_grpc)

from tworec.serving.errors import ServingError, truncate
from tworec.serving.limits import (BytesInFlight, Reservation, check_elements,
                                   default_max_elements, default_max_request_bytes_in_flight,
                                   default_max_rows)
from tworec.serving.manager import ModelManager, reload_configs
from tworec.serving.protocol import DEFAULT_SIGNATURE
from tworec.serving.tensor_proto import to_array, to_proto

log = logging.getLogger(__name__)
NO_DEADLINE_SECONDS = 1e9         # gRPC's time left beyond this (31 years): the call has none


def _aborts_on_error(method):
    """Turns a `ServingError` (or any failure) into the gRPC status of its TF code."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except ServingError as error:
            context.abort(grpc.StatusCode[error.code], truncate(error.message))
        except Exception:  # no request may take the server down; the log keeps the details
            log.exception("gRPC %s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__} failed on the server; "
                          "the server log has the details")
    return wrapper


def version_of(spec) -> tuple[str, int | None, str | None]:
    """(name, version or None, label or None) of a `ModelSpec`."""
    choice = spec.WhichOneof("version_choice")
    return (spec.name, spec.version.value if choice == "version" else None,
            spec.version_label if choice == "version_label" else None)


def requested(request) -> tuple[str, int | None, str | None]:
    """`version_of` the request's ModelSpec; INVALID_ARGUMENT without one, as TF Serving."""
    if not request.HasField("model_spec"):
        raise ServingError("INVALID_ARGUMENT", "Missing ModelSpec")
    return version_of(request.model_spec)


def _unimplemented(name: str, finds_the_model: bool = True):
    """A method this server does not run: UNIMPLEMENTED, once the model the request names is
    found (NOT_FOUND first, as TF Serving looks the servable up before anything else)."""
    @_aborts_on_error
    def method(self, request, context):
        if finds_the_model:
            with self.manager.lease(*requested(request)):
                pass
        raise ServingError("UNIMPLEMENTED", f"{name} is not supported by this server; use "
                           "Predict with a predict signature")
    return method


class PredictionService(prediction_service_pb2_grpc.PredictionServiceServicer):
    """Predict and GetModelMetadata.

    Args:
        manager: the served models.
        scheduler: runs checked requests (`batching.Direct` or `batching.Batcher`).
        max_rows: the most rows an input of one request may have.
        max_elements: the most elements the inputs of one request may have together.
        in_flight: the request bytes the server holds at once (shared with REST; None: one of
            its own, of `limits.default_max_request_bytes_in_flight` for 64 MiB requests).
    """

    def __init__(self, manager: ModelManager, scheduler, max_rows: int | None = None,
                 max_elements: int | None = None, in_flight: BytesInFlight | None = None):
        self.manager = manager
        self.scheduler = scheduler
        self.max_rows = max_rows or default_max_rows()
        self.max_elements = max_elements or default_max_elements()
        self.in_flight = in_flight or BytesInFlight(default_max_request_bytes_in_flight(64 << 20))

    @_aborts_on_error
    def Predict(self, request: predict_pb2.PredictRequest, context) -> predict_pb2.PredictResponse:
        signature = request.model_spec.signature_name
        left = context.time_remaining()      # ~2^63 ns when the client set no deadline
        deadline = None if left is None or left > NO_DEADLINE_SECONDS else time.monotonic() + left
        with self.in_flight.reserve(request.ByteSize()), \
                self.manager.lease(*requested(request)) as (number, model):
            model.check_input_names(request.inputs, signature)     # before any is converted
            check_elements({name: [dim.size for dim in proto.tensor_shape.dim]
                            for name, proto in request.inputs.items()}, self.max_elements)
            inputs = {name: to_array(name, proto, self.max_rows)
                      for name, proto in request.inputs.items()}
            outputs = self.scheduler.run(model, inputs, signature, list(request.output_filter),
                                         deadline, lambda: not context.is_active())
        response = predict_pb2.PredictResponse()
        response.model_spec.name = request.model_spec.name
        response.model_spec.version.value = number
        response.model_spec.signature_name = signature or DEFAULT_SIGNATURE
        for name, value in outputs.items():
            response.outputs[name].CopyFrom(to_proto(value))
        self._hold_until_sent(response.ByteSize(), context)
        return response

    def _hold_until_sent(self, size: int, context) -> None:
        """Counts an answer's `size` bytes in flight until its RPC ends: gRPC sends it after
        the handler returns, and keeps it while its client reads none of it (a client that
        never read its answers pinned them all, uncounted). Unlike REST's, a gRPC answer
        has no write deadline: one its client never reads is held until the client leaves,
        and meanwhile counts against the others' requests."""
        answer = Reservation(self.in_flight)
        answer.cover(size, refuse=False)
        if not context.add_callback(answer.release):                  # it has ended already
            answer.release()

    @_aborts_on_error
    def GetModelMetadata(self, request: get_model_metadata_pb2.GetModelMetadataRequest,
                         context) -> get_model_metadata_pb2.GetModelMetadataResponse:
        fields = list(request.metadata_field)
        if not fields:
            raise ServingError("INVALID_ARGUMENT",
                               "GetModelMetadataRequest must specify at least one metadata_field")
        for field in fields:
            if field != "signature_def":
                raise ServingError("INVALID_ARGUMENT", f"Metadata field {field} is not supported")
        with self.manager.lease(*requested(request)) as (number, model):
            signatures = model.signature_def_map()
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        response.model_spec.name = request.model_spec.name
        response.model_spec.version.value = number
        response.metadata["signature_def"].Pack(signatures)
        return response

    Classify = _unimplemented("Classify")
    Regress = _unimplemented("Regress")
    MultiInference = _unimplemented("MultiInference", finds_the_model=False)  # one per task


class ModelService(model_service_pb2_grpc.ModelServiceServicer):
    """GetModelStatus and HandleReloadConfigRequest (within the manager's allowed roots)."""

    def __init__(self, manager: ModelManager):
        self.manager = manager

    @_aborts_on_error
    def GetModelStatus(self, request, context):
        name, version, _ = requested(request)      # a label: every version
        return self.manager.status(name, version)

    @_aborts_on_error
    def HandleReloadConfigRequest(self, request: model_management_pb2.ReloadConfigRequest,
                                  context) -> model_management_pb2.ReloadConfigResponse:
        if request.config.WhichOneof("config") != "model_config_list":
            raise ServingError("INVALID_ARGUMENT", "ServerModelConfig type not supported by "
                               "HandleReloadConfigRequest. Only ModelConfigList is currently "
                               "supported")
        configs = reload_configs(request.config)
        self.manager.check_allowed(configs)
        self.manager.reload(configs)
        response = model_management_pb2.ReloadConfigResponse()
        response.status.SetInParent()                       # OK, set as TF Serving sets it
        return response


def add_services(server: grpc.Server, manager: ModelManager, scheduler,
                 max_rows: int | None = None, max_elements: int | None = None,
                 in_flight: BytesInFlight | None = None) -> None:
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionService(manager, scheduler, max_rows, max_elements, in_flight), server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelService(manager), server)
