"""TF Serving's gRPC `PredictionService` and `ModelService` on the `tensorflow-serving-api` protos.

Status codes are TF's codes unchanged; messages are cut to 1024 characters plus "...TRUNCATED".
A Predict hands its request to the scheduler and waits for it until the call's deadline; a call
that ends first (deadline or client cancel) has its run dropped if it has not started.
Status and metadata never wait for a model run. `HandleReloadConfigRequest` only loads base
paths under the manager's allowed roots (PERMISSION_DENIED otherwise).
"""
from __future__ import annotations

import functools
import heapq
import itertools
import logging
import threading
import time

import grpc
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


class Alarms:
    """Calls each `action` `seconds` after `set` unless it is `clear`ed first: one daemon
    thread for them all (a timer thread per answer would cost a thread per RPC). An action
    that raises is logged; the thread goes on."""

    def __init__(self):
        self._due: list = []                        # [time, order, action or None] heap
        self._order = itertools.count()
        self._cleared = 0                           # entries of `_due` cleared, not yet popped
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def set(self, seconds: float, action) -> list:
        alarm = [time.monotonic() + seconds, next(self._order), action]
        with self._changed:
            heapq.heappush(self._due, alarm)
            if self._thread is None:
                self._thread = threading.Thread(target=self._ring, name="grpc-answer-alarms",
                                                daemon=True)
                self._thread.start()
            if self._due[0] is alarm:               # the next one due: the wait is too long
                self._changed.notify()
        return alarm

    def clear(self, alarm: list) -> None:
        """Drops `alarm` (nothing once it has rung); the heap sheds cleared alarms once they
        are most of it."""
        with self._changed:
            if alarm[2] is None:
                return
            alarm[2] = None
            self._cleared += 1
            if self._cleared > 1024 and 2 * self._cleared > len(self._due):
                self._due = [due for due in self._due if due[2] is not None]
                heapq.heapify(self._due)
                self._cleared = 0

    def _ring(self) -> None:
        while True:
            with self._changed:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._changed.wait(min(self._due[0][0] - time.monotonic(),
                                           threading.TIMEOUT_MAX) if self._due else None)
                alarm = heapq.heappop(self._due)
                action, alarm[2] = alarm[2], None   # held no longer than its call: a
                self._cleared -= action is None     # cancelled RPC's answer is then freed
            if action is not None:
                try:
                    action()
                except Exception:  # a failing action must not stop the others' alarms
                    log.exception("a gRPC answer's alarm failed")
                action = None


ALARMS = Alarms()        # the process's one alarm thread, shared by every server in it


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
        write_timeout_seconds: a Predict whose answer has not been sent within this long of
            being made is cancelled, its bytes released (REST's `write_timeout_seconds`).
    """

    def __init__(self, manager: ModelManager, scheduler, max_rows: int | None = None,
                 max_elements: int | None = None, in_flight: BytesInFlight | None = None,
                 write_timeout_seconds: float = 60.0):
        self.write_timeout_seconds = write_timeout_seconds
        self.alarms = ALARMS
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
        never read its answers pinned them all, uncounted). An answer not sent within
        `write_timeout_seconds` has its RPC cancelled, as REST aborts an unread answer's
        connection: a client reading nothing holds the others' budget that long at most."""
        answer = Reservation(self.in_flight)
        answer.cover(size, refuse=False)
        alarm = self.alarms.set(self.write_timeout_seconds, context.cancel)

        def ended() -> None:
            self.alarms.clear(alarm)
            answer.release()
        if not context.add_callback(ended):                           # it has ended already
            ended()

    @_aborts_on_error
    def GetModelMetadata(self, request: get_model_metadata_pb2.GetModelMetadataRequest,
                         context) -> get_model_metadata_pb2.GetModelMetadataResponse:
        spec = requested(request)                  # before the fields, as TF Serving checks
        fields = list(request.metadata_field)
        if not fields:
            raise ServingError("INVALID_ARGUMENT",
                               "GetModelMetadataRequest must specify at least one metadata_field")
        for field in fields:
            if field != "signature_def":
                raise ServingError("INVALID_ARGUMENT", f"Metadata field {field} is not supported")
        with self.manager.lease(*spec) as (number, model):
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
                 in_flight: BytesInFlight | None = None,
                 write_timeout_seconds: float = 60.0) -> None:
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionService(manager, scheduler, max_rows, max_elements, in_flight,
                          write_timeout_seconds), server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelService(manager), server)
