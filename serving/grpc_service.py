"""TF Serving's gRPC `PredictionService` and `ModelService` on the `tensorflow-serving-api` protos.

Status codes are TF's codes unchanged; messages are cut to 1024 characters plus "...TRUNCATED".
"""
from __future__ import annotations

import functools
import logging

import grpc
import tensorflow as tf
from tensorflow_serving.apis import (get_model_metadata_pb2, model_management_pb2,
                                     model_service_pb2_grpc, predict_pb2,
                                     prediction_service_pb2_grpc)

from tworec.serving.batching import run_directly
from tworec.serving.errors import ServingError, truncate
from tworec.serving.manager import ModelManager, configs_of_proto
from tworec.serving.model import DEFAULT_SIGNATURE

log = logging.getLogger(__name__)


def _aborts_on_error(method):
    """Turns a `ServingError` (or any failure) into the gRPC status of its TF code."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except ServingError as error:
            context.abort(grpc.StatusCode[error.code], truncate(error.message))
        except Exception as error:  # no request may take the server down
            log.exception("gRPC %s failed", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, truncate(f"{type(error).__name__}: {error}"))
    return wrapper


def version_of(spec) -> tuple[str, int | None, str | None]:
    """(name, version or None, label or None) of a `ModelSpec`."""
    choice = spec.WhichOneof("version_choice")
    return (spec.name, spec.version.value if choice == "version" else None,
            spec.version_label if choice == "version_label" else None)


def _unimplemented(name: str):
    def method(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not supported by this server; "
                      "use Predict with a predict signature")
    return method


class PredictionService(prediction_service_pb2_grpc.PredictionServiceServicer):
    """Predict and GetModelMetadata; `run` is `run_directly` or a `Batcher`."""

    def __init__(self, manager: ModelManager, run=run_directly):
        self.manager = manager
        self.run = run

    @_aborts_on_error
    def Predict(self, request: predict_pb2.PredictRequest, context) -> predict_pb2.PredictResponse:
        signature = request.model_spec.signature_name
        with self.manager.lease(*version_of(request.model_spec)) as (number, model):
            outputs = self.run(model, {name: _to_array(name, proto)
                                       for name, proto in request.inputs.items()},
                               signature, list(request.output_filter))
        response = predict_pb2.PredictResponse()
        response.model_spec.name = request.model_spec.name
        response.model_spec.version.value = number
        response.model_spec.signature_name = signature or DEFAULT_SIGNATURE
        for name, value in outputs.items():
            response.outputs[name].CopyFrom(tf.make_tensor_proto(value))
        return response

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
        with self.manager.lease(*version_of(request.model_spec)) as (number, model):
            signatures = model.signature_def_map()
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        response.model_spec.name = request.model_spec.name
        response.model_spec.version.value = number
        response.metadata["signature_def"].Pack(signatures)
        return response

    Classify = _unimplemented("Classify")
    Regress = _unimplemented("Regress")
    MultiInference = _unimplemented("MultiInference")


class ModelService(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, manager: ModelManager):
        self.manager = manager

    @_aborts_on_error
    def GetModelStatus(self, request, context):
        return self.manager.status(*version_of(request.model_spec))

    @_aborts_on_error
    def HandleReloadConfigRequest(self, request: model_management_pb2.ReloadConfigRequest,
                                  context) -> model_management_pb2.ReloadConfigResponse:
        self.manager.reload(configs_of_proto(request.config))
        return model_management_pb2.ReloadConfigResponse()


def _to_array(name: str, proto):
    try:
        return tf.make_ndarray(proto)
    except Exception as error:
        raise ServingError("INVALID_ARGUMENT",
                           f'Input "{name}" is not a valid TensorProto: {error}') from error


def add_services(server: grpc.Server, manager: ModelManager, run=run_directly) -> None:
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionService(manager, run), server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelService(manager), server)
