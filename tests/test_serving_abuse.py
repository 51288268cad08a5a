"""The embedded server under concurrency and abuse (issue 11): each finding reproduced.

Loopback only, tiny SavedModels, small limits set by flags, every wait bounded: the whole file
runs in seconds.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import requests

import tworec.serving  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads)
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2
from tensorflow_serving.apis import (get_model_status_pb2, model_management_pb2,
                                     model_service_pb2_grpc, predict_pb2,
                                     prediction_service_pb2_grpc)
from tensorflow_serving.config import model_server_config_pb2

from test_serving import Scale, ToyRanking, _states, _wait_for, save
from tworec.serving.batching import Batcher
from tworec.serving.errors import ServingError
from tworec.serving import manager as manager_module
from tworec.serving.manager import ModelConfig, ModelManager
from tworec.serving.model import LoadedModel
from tworec.serving.server import ModelServer

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Spin(tf.Module):
    """x [b] float32 -> y [b]: `steps` dependent sin steps, ~2 µs each (a slow model)."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps = steps

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def serve(self, x):
        return {"y": tf.while_loop(lambda i, v: i < self.steps,
                                   lambda i, v: (i + 1, tf.sin(v)), (tf.constant(0), x))[1]}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> str:
    """ranking/1, scale/1, spin/1 (~3 s a run) and spin_short/1 (~0.5 s) under one folder."""
    root = str(tmp_path_factory.mktemp("abuse"))
    for name, module in {"ranking": ToyRanking(), "scale": Scale(3.0),
                         "spin": Spin(1_500_000), "spin_short": Spin(250_000)}.items():
        save(module, os.path.join(root, name))
    return root


def _serve(models: str, names=("ranking", "scale"), **options) -> ModelServer:
    manager = ModelManager([ModelConfig(n, os.path.join(models, n)) for n in names],
                           poll_seconds=0)
    return ModelServer(manager, grpc_port=0, rest_port=0, **options)


def _stub(server: ModelServer) -> prediction_service_pb2_grpc.PredictionServiceStub:
    return prediction_service_pb2_grpc.PredictionServiceStub(
        grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))


def _request(name: str, inputs: dict, signature: str = "") -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = name
    request.model_spec.signature_name = signature
    for key, value in inputs.items():
        request.inputs[key].CopyFrom(tf.make_tensor_proto(value))
    return request


def _grpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call(*args, timeout=10, **kwargs)
    return error.value


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _strings(*values) -> np.ndarray:
    return np.array(values, dtype=object)


# ------------------------------------------------------------------ 1. no crossed answers


def test_batching_never_mixes_clients(models):
    """X (2 users, 1 item list) and Z (1 user, 2 item lists) are invalid alone; batched with Y
    they must still fail, and Y must get its own answer."""
    local = LoadedModel(os.path.join(models, "ranking", "1"))
    x = {"user_id": _strings(b"u1", b"u2"), "item_ids": _strings([b"i9", b"i10", b"i11"])}
    y = {"user_id": _strings(b"u5"), "item_ids": _strings([b"i1", b"i2", b"i3"])}
    z = {"user_id": _strings(b"u3"), "item_ids": _strings([b"i4", b"i5", b"i6"],
                                                          [b"i7", b"i8", b"i0"])}
    expected = local.run(y)["scores"]
    with _serve(models, batcher=Batcher(max_batch_size=32,
                                        batch_timeout_micros=200_000)) as server:
        stub = _stub(server)

        def call(inputs):
            try:
                return tf.make_ndarray(stub.Predict(_request("ranking", inputs),
                                                    timeout=10).outputs["scores"])
            except grpc.RpcError as error:
                return error.code()
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(call, [x, y, z]))
    assert [a if isinstance(a, grpc.StatusCode) else "answered" for a in answers] == [
        grpc.StatusCode.INVALID_ARGUMENT, "answered", grpc.StatusCode.INVALID_ARGUMENT]
    np.testing.assert_allclose(answers[1], expected, rtol=1e-6)


# ------------------------------------------------------------------ 2. rows per request


def test_rows_per_request_are_limited(models):
    with _serve(models) as server:                # the default limit is at most 65536 rows
        refused = requests.post(f"http://127.0.0.1:{server.rest_port}/v1/models/scale:predict",
                                json={"inputs": [1.0] * 65537}, timeout=10)
        assert refused.status_code == 400, refused.status_code
    with _serve(models, max_rows=100) as server:
        rest = f"http://127.0.0.1:{server.rest_port}/v1/models/scale:predict"
        assert requests.post(rest, json={"inputs": [1.0] * 100}, timeout=10).status_code == 200
        refused = requests.post(rest, json={"inputs": [1.0] * 101}, timeout=10)
        assert refused.status_code == 400 and "--max_rows_per_request" in refused.json()["error"]
        error = _grpc_error(_stub(server).Predict,
                            _request("scale", {"x": np.ones(101, np.float32)}))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 100" in error.details()


def test_elements_per_request_are_limited(models):
    """One row may carry any number of items (`item_ids` is [None, None]): the inputs'
    elements together are bounded too, on REST and gRPC, before anything is converted."""
    items = [f"i{i}" for i in range(9)]
    with _serve(models, names=("ranking",), max_elements=10) as server:
        rest = f"http://127.0.0.1:{server.rest_port}/v1/models/ranking:predict"
        fits = requests.post(rest, json={"instances": [{"user_id": "u1", "item_ids": items}]},
                             timeout=10)
        assert fits.status_code == 200, fits.text
        refused = requests.post(rest, json={"instances": [
            {"user_id": "u1", "item_ids": items + ["i9"]}]}, timeout=10)
        assert refused.status_code == 400
        assert "--max_elements_per_request" in refused.json()["error"]
        error = _grpc_error(_stub(server).Predict, _request("ranking", {
            "user_id": _strings(b"u1"), "item_ids": np.full((1, 10), b"i1", dtype=object)}))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 10" in error.details()
        declared = _request("ranking", {"user_id": _strings(b"u1")})   # claims 2**40 items
        declared.inputs["item_ids"].CopyFrom(_proto(types_pb2.DT_STRING, [1, 1 << 40],
                                                    string_val=[b"i1"]))
        error = _grpc_error(_stub(server).Predict, declared)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max_elements_per_request" in error.details()


def test_a_shape_of_huge_rank_is_refused_before_its_size_is_counted(models):
    """100k dimensions of 2^62 (a 1.2 MB proto) froze the server: their product was counted
    (big ints, quadratic) before the rank was checked, then could not be formatted (an
    INTERNAL answer). Rank and signs come first, and a count stops once past the limit."""
    from tworec.serving.limits import check_elements
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "scale"
    request.inputs["x"].CopyFrom(_proto(types_pb2.DT_FLOAT, [1 << 62] * 5000))
    with _serve(models) as server:
        error = _grpc_error(_stub(server).Predict, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 'Input "x" has rank 5000; at most 32 dimensions' in error.details()
    with pytest.raises(ServingError, match="have more than 100 elements; .* at most 100 "):
        check_elements({"x": [2, 3], "y": [(1 << 63) - 1] * 32}, max_elements=100)
    with pytest.raises(ServingError, match='"y" has a negative dimension'):
        check_elements({"x": [2, 3], "y": [1 << 62] * 31 + [-1]}, max_elements=100)


def test_input_names_are_checked_before_any_input_is_converted(models, monkeypatch):
    """200k one-float inputs cost 4.4 s of CPU: each was converted before the names were
    compared with the signature. Now a request whose names do not match converts none."""
    from tworec.serving import grpc_service
    converted = []

    def counting_to_array(name, proto, max_rows):
        converted.append(name)
        return to_array(name, proto, max_rows)
    to_array = grpc_service.to_array
    monkeypatch.setattr(grpc_service, "to_array", counting_to_array)
    request = _request("scale", {str(i): np.ones(1, np.float32) for i in range(1000)})
    with _serve(models) as server:
        error = _grpc_error(_stub(server).Predict, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith("input size does not match signature: 1000!=1")
        assert converted == []
        _stub(server).Predict(_request("scale", {"x": np.ones(1, np.float32)}), timeout=10)
    assert converted == ["x"]


def test_default_row_limit_follows_memory():
    from tworec.serving.limits import default_max_rows
    assert default_max_rows(24 << 30) == 6144
    assert default_max_rows(1 << 30) == 256 and default_max_rows(1 << 50) == 65536
    from tworec.serving.limits import default_max_elements
    assert default_max_elements(24 << 30) == 25165824
    assert default_max_elements(1 << 30) == 1 << 20 and default_max_elements(1 << 50) == 1 << 26
    from tworec.serving.limits import default_max_request_bytes_in_flight
    assert default_max_request_bytes_in_flight(64 << 20, 24 << 30) == 384 << 20
    assert default_max_request_bytes_in_flight(64 << 20, 1 << 30) == 64 << 20


def test_a_reservation_of_request_bytes_grows_and_ends_with_its_block():
    from tworec.serving.errors import ServingError
    from tworec.serving.limits import BytesInFlight
    budget = BytesInFlight(100)
    with budget.reserve(30) as held:
        held.cover(60)
        held.cover(10)                                               # never shrinks
        assert budget.held == 60
        with pytest.raises(ServingError) as refused, budget.reserve(41):
            pass
        assert refused.value.code == "UNAVAILABLE" and budget.held == 60   # refused: none
        with pytest.raises(ZeroDivisionError), budget.reserve(40):
            1 / 0
        assert budget.held == 60
    assert budget.held == 0
    with budget.reserve(500):                                 # alone, it may pass the cap
        assert budget.held == 500
    assert budget.held == 0
    from concurrent.futures import Future
    run = Future()
    with budget.reserve(70) as held:                 # the request ends, its run goes on
        held.hold_until(run)
    assert budget.held == 70
    run.set_result(None)
    assert budget.held == 0


# ------------------------------------------------------------------ 3. shape amplification


def _proto(dtype, dims: list[int], **values) -> tensor_pb2.TensorProto:
    return tensor_pb2.TensorProto(dtype=dtype, tensor_shape=tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in dims]), **values)


@pytest.mark.parametrize("name, proto", [
    ("scale", _proto(types_pb2.DT_FLOAT, [1 << 24], float_val=[1.0])),
    ("scale", _proto(types_pb2.DT_FLOAT, [2], tensor_content=b"\0" * 12)),
    ("scale", _proto(types_pb2.DT_FLOAT, [-1], float_val=[1.0])),
    ("scale", _proto(types_pb2.DT_FLOAT, [1, 1 << 40], float_val=[1.0])),
    ("scale", _proto(types_pb2.DT_FLOAT, [0, 1 << 62])),              # no array has this shape
    ("ranking_user", _proto(types_pb2.DT_STRING, [0, (1 << 63) - 1])),
    ("scale", _proto(types_pb2.DT_VARIANT, [1])),
    ("ranking_user", _proto(types_pb2.DT_STRING, [50], string_val=[b"u1"])),
])
def test_declared_shapes_must_match_the_bytes_sent(models, name, proto):
    with _serve(models) as server:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = name.split("_")[0]
        request.inputs["x" if name == "scale" else "user_id"].CopyFrom(proto)
        if name == "ranking_user":
            request.inputs["item_ids"].CopyFrom(tf.make_tensor_proto(
                np.full((50, 2), b"i1", dtype=object)))
        before, start = _rss_bytes(), time.monotonic()
        error = _grpc_error(_stub(server).Predict, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert time.monotonic() - start < 5 and _rss_bytes() - before < 32 << 20


@pytest.mark.parametrize("proto, carried", [
    (_proto(types_pb2.DT_STRING, [3], string_val=[b"u1"]), "carries 1; send exactly the "),
    (_proto(types_pb2.DT_STRING, [1], string_val=[b"u1"] * 1_234_567), "carries 1234567; "),
    (_proto(types_pb2.DT_FLOAT, [2], tensor_content=b"\0" * 7),
     "carries 7 bytes of tensor_content, not 2 × 4; send exactly the values")])
def test_a_proto_short_of_its_shape_is_refused_saying_what_to_send(proto, carried):
    """`tf.make_tensor_proto(b"u1", shape=[3])` sends one value: TF Serving would repeat it."""
    from tworec.serving.errors import ServingError
    from tworec.serving.tensor_proto import to_array
    with pytest.raises(ServingError, match=carried):
        to_array("x", proto, max_rows=10)


@pytest.mark.parametrize("dtype, said", [(999, "dtype 999, not a DataType enum value"),
                                         (types_pb2.DT_VARIANT, "dtype DT_VARIANT, which")])
def test_a_dtype_requests_cannot_carry_is_named_in_an_invalid_argument(dtype, said):
    """A proto3 enum field keeps any number: 999 was answered INTERNAL (naming it raised)."""
    from tworec.serving.tensor_proto import to_array
    with pytest.raises(ServingError, match=said) as error:
        to_array("x", _proto(dtype, [1], float_val=[1.0]), max_rows=10)
    assert error.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("dtype", [types_pb2.DT_INT8, types_pb2.DT_UINT8, types_pb2.DT_INT16,
                                   types_pb2.DT_UINT16])
def test_narrow_ints_out_of_range_are_cast_as_tf_serving_casts_them(dtype):
    """int_val carries int32s; TF's Tensor::FromProto, which TF Serving runs, wraps those out of
    the dtype's range (tf.make_ndarray raised OverflowError: an INTERNAL answer)."""
    from tworec.serving.tensor_proto import to_array
    proto = _proto(dtype, [2, 3], int_val=[1000, -129, 127, -1, 70000, -70000])
    expected = tf.io.parse_tensor(proto.SerializeToString(), tf.as_dtype(dtype)).numpy()
    got = to_array("x", proto, max_rows=10)
    assert got.dtype == expected.dtype and got.tolist() == expected.tolist()


class Complex(tf.Module):
    """x [b] float32 -> c [b] complex64, y [b] float32: an output JSON cannot carry."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def serve(self, x):
        return {"c": tf.complex(x, x), "y": x}


def test_an_answer_json_cannot_carry_is_a_json_error(models, tmp_path):
    save(Complex(), str(tmp_path / "complex"))
    manager = ModelManager([ModelConfig("complex", str(tmp_path / "complex"))], poll_seconds=0)
    with ModelServer(manager, grpc_port=0, rest_port=0) as server:
        url = f"http://127.0.0.1:{server.rest_port}/v1/models/complex:predict"
        for body in ({"inputs": [1.0]}, {"instances": [1.0]}):
            answer = requests.post(url, json=body, timeout=10)
            assert answer.headers["content-type"] == "application/json"
            assert (answer.status_code, answer.json()) == (
                400, {"error": "Failed to write JSON value for tensor type: complex64"})
        grpc_answer = _stub(server).Predict(_request("complex", {"x": np.ones(1, np.float32)}),
                                            timeout=10)
        assert tf.make_ndarray(grpc_answer.outputs["c"]).tolist() == [1 + 1j]


# ------------------------------------------------------------------ 4. ReloadConfig


def _reload(server: ModelServer, entries: dict[str, str]):
    config = model_server_config_pb2.ModelServerConfig()
    for name, base_path in entries.items():
        config.model_config_list.config.add(name=name, base_path=base_path,
                                            model_platform="tensorflow")
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        return model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest(
            model_management_pb2.ReloadConfigRequest(config=config), timeout=30)


def test_reload_config_loads_only_under_allowed_roots(models, tmp_path):
    elsewhere = str(tmp_path / "elsewhere")
    save(Scale(5.0), elsewhere)
    escape = os.path.join(models, "scale", "..", "..", os.path.basename(str(tmp_path)),
                          "elsewhere")
    with _serve(models, names=("scale",)) as server:
        for base_path in (elsewhere, escape):
            with pytest.raises(grpc.RpcError) as error:
                _reload(server, {"scale": os.path.join(models, "scale"), "evil": base_path})
            assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert elsewhere not in error.value.details()
        assert requests.get(f"http://127.0.0.1:{server.rest_port}/v1/models/evil",
                            timeout=10).status_code == 404
    manager = ModelManager([ModelConfig("scale", os.path.join(models, "scale"))],
                           poll_seconds=0, allowed_roots=[str(tmp_path)])
    with ModelServer(manager, grpc_port=0, rest_port=None) as server:
        _reload(server, {"other": elsewhere})
        assert server.manager.status("other").model_version_status[0].state == \
            get_model_status_pb2.ModelVersionStatus.AVAILABLE


def test_a_reload_during_a_poll_is_followed_and_never_leaves_no_version(tmp_path):
    """The config changes from version 1 to version 2 while version 1 loads: the poll under
    way must not retire version 1 by the new config, and the reload must not be skipped (it
    was: version 1 retired, version 2 never loaded, nothing served)."""
    base = str(tmp_path / "a")
    for version in (1, 2):
        os.makedirs(os.path.join(base, str(version)))
    loading, release = threading.Event(), threading.Event()

    class Fake:
        def __init__(self, path):
            if path.endswith("1"):
                loading.set()
                assert release.wait(60)

        def close(self):
            pass
    manager = ModelManager([ModelConfig("a", base, policy="specific", versions=(1,))],
                           poll_seconds=0, load=Fake)
    manager.start(wait=False)
    try:
        assert loading.wait(30)
        manager.reload([ModelConfig("a", base, policy="specific", versions=(2,))],
                       wait_seconds=30)
        release.set()

        def states():
            return {s.version: get_model_status_pb2.ModelVersionStatus.State.Name(s.state)
                    for s in manager.status("a").model_version_status}
        _wait_for(lambda: states().get(2) == "AVAILABLE" and states().get(1) == "END",
                  seconds=30)
    finally:
        release.set()
        manager.stop()


# ------------------------------------------------------------------ 5. slow requests


def test_timed_out_runs_stop_and_status_never_waits(models):
    """Ten ~3 s runs with a 1 s REST timeout: each answers 504 in time, their runs stop, a
    small predict behind them is quick, and status answers while they run."""
    with _serve(models, names=("scale", "spin"), rest_timeout_seconds=1.0) as server:
        rest = f"http://127.0.0.1:{server.rest_port}/v1/models"

        def slow(_):
            start = time.monotonic()
            answer = requests.post(f"{rest}/spin:predict", json={"inputs": [1.0]}, timeout=30)
            return answer.status_code, time.monotonic() - start
        with ThreadPoolExecutor(10) as pool:
            pending = pool.map(slow, range(10))
            time.sleep(0.1)
            start = time.monotonic()
            assert requests.get(f"{rest}/scale", timeout=10).status_code == 200
            status_seconds = time.monotonic() - start
            answers = list(pending)
        start = time.monotonic()
        assert requests.post(f"{rest}/scale:predict", json={"inputs": [1.0]},
                             timeout=30).json() == {"outputs": [3.0]}
        assert time.monotonic() - start < 1.5
    assert status_seconds < 1.5
    assert all(code == 504 and seconds < 2.5 for code, seconds in answers), answers


# ------------------------------------------------------------------ 6. model isolation


def test_a_bad_version_delays_neither_other_models_nor_ports_nor_reloads(models, tmp_path):
    """The bad version retries for far longer than any bound below (1000 attempts, 1 s apart),
    so each bound fails if the bad version holds anything up, however slow the machine."""
    bad, good = str(tmp_path / "bad"), str(tmp_path / "good")
    os.makedirs(os.path.join(bad, "1"))                 # an empty version folder
    save(Scale(1.0), good)
    manager = ModelManager([ModelConfig("bad", bad), ModelConfig("good", good)],
                           poll_seconds=0.05, max_load_retries=1000, load_retry_seconds=1.0)
    server = ModelServer(manager, grpc_port=0, rest_port=0)
    started = threading.Thread(target=server.start, daemon=True)
    started.start()
    try:
        _wait_for(lambda: server.rest_port, seconds=30)   # bound before the models settle
        rest = f"http://127.0.0.1:{server.rest_port}/v1/models"
        _wait_for(lambda: _status_code(f"{rest}/good") == 200, seconds=30)
        save(Scale(2.0), good)
        _wait_for(lambda: _predict_scale(f"{rest}/good") == 2.0, seconds=30)
        loading = requests.get(f"{rest}/bad", timeout=5).json()["model_version_status"][0]
        assert loading["state"] == "LOADING"
        start = time.monotonic()
        _reload(server, {"bad": bad, "good": good, "again": good})
        assert time.monotonic() - start < 15
        assert _predict_scale(f"{rest}/again") == 2.0
    finally:
        manager.stop()
        started.join(timeout=10)
        server.stop()


def _status_code(url: str) -> int | None:
    try:
        return requests.get(url, timeout=1).status_code
    except requests.ConnectionError:
        return None


def _predict_scale(url: str) -> float | None:
    answer = requests.post(f"{url}:predict", json={"inputs": [1.0]}, timeout=5)
    return answer.json()["outputs"][0] if answer.status_code == 200 else None


@pytest.fixture
def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server_has_read(port: int, client: socket.socket) -> bool:
    """Whether the server at `port` has accepted `client`'s connection and read all it sent
    (its side of the connection is established with nothing left in its receive queue)."""
    client_port = client.getsockname()[1]
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            if (int(local.split(":")[1], 16) == port
                    and int(remote.split(":")[1], 16) == client_port):
                return state == "01" and int(fields[4].split(":")[1], 16) == 0
    return False


def test_a_port_that_cannot_be_opened_stops_what_was_started(models):
    """The REST port is taken: start raises, and the gRPC port it had opened is closed and the
    models unloaded (they kept serving, with no way to stop them)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = _serve(models, names=("scale",))
        server.rest_port = taken.getsockname()[1]
        with pytest.raises(OSError):
            server.start()
        grpc_port = server.grpc_port
    assert grpc_port
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", grpc_port)) != 0
    assert _states(server.manager, "scale") == {1: "END"}     # unloaded


@pytest.mark.parametrize("broken, labels, code, message", [
    (True, {}, "UNKNOWN", "1 servable(s) did not become available: {{{name: scale version: 2} "
     "due to error: Version 2 of model scale failed to load: "),
    (False, {"canary": 7}, "FAILED_PRECONDITION", "Request to assign label to version 7 of "
     "model scale, which is not currently available for inference")])
def test_a_start_tf_serving_would_refuse_fails_and_stops_what_was_started(
        models, tmp_path, broken, labels, code, message):
    """TF Serving exits when a model's latest version cannot load, or a start-up label points
    at a version that is not loaded; serving on without the model (or with a dead label)
    would hide that behind NOT_FOUND answers."""
    base = str(tmp_path / "scale")
    save(Scale(3.0), base, version=1)
    if broken:
        os.makedirs(os.path.join(base, "2"))
        with open(os.path.join(base, "2", "saved_model.pb"), "w") as f:
            f.write("not a SavedModel")
    manager = ModelManager([ModelConfig("scale", base, labels={"stable": 1, **labels})],
                           poll_seconds=0)
    server = ModelServer(manager, grpc_port=0, rest_port=0)
    with pytest.raises(ServingError) as error:
        server.start()
    assert (error.value.code, error.value.message[:len(message)]) == (code, message)
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", server.grpc_port)) != 0
    assert set(_states(manager, "scale").values()) == {"END"}  # unloaded


def test_a_second_server_on_the_same_grpc_port_is_refused(models):
    """gRPC shares a port between servers (SO_REUSEPORT) unless told not to: two servers would
    split one port's traffic."""
    with _serve(models, names=("scale",)) as first:
        second = _serve(models, names=("scale",))
        second.grpc_port = first.grpc_port
        with pytest.raises(RuntimeError, match="Failed to bind"):
            second.start()


# ------------------------------------------------------------------ 7. slow clients


class CountingLoadedModel(LoadedModel):
    """A `LoadedModel` that counts its session runs."""
    runs = 0

    def run(self, *args, **kwargs):
        type(self).runs += 1
        return super().run(*args, **kwargs)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes the connection (after any answer) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


_HEAD = "POST /v1/models/scale:predict HTTP/1.1\r\nHost: x\r\n"
_BODY = b'{"inputs": [1.0]}'


def test_a_partial_body_is_never_run(models):
    manager = ModelManager([ModelConfig("scale", os.path.join(models, "scale"))],
                           poll_seconds=0, load=CountingLoadedModel)
    with ModelServer(manager, grpc_port=None, rest_port=0) as server:
        runs = CountingLoadedModel.runs
        gone = _connect(server.rest_port)
        gone.sendall((_HEAD + "Content-Length: 100\r\n\r\n").encode() + _BODY)
        gone.close()                                            # leaves mid-body
        time.sleep(0.3)
        assert CountingLoadedModel.runs == runs


def test_work_for_a_gone_client_is_dropped(models):
    """A predict queued behind a slow run, whose client then leaves, never runs."""
    manager = ModelManager([ModelConfig(n, os.path.join(models, n)) for n in ("scale", "spin")],
                           poll_seconds=0, load=CountingLoadedModel)
    with ModelServer(manager, grpc_port=None, rest_port=0, predict_threads=1) as server:
        url = f"http://127.0.0.1:{server.rest_port}/v1/models/spin:predict"
        with ThreadPoolExecutor(1) as pool:
            before = CountingLoadedModel.runs
            slow = pool.submit(requests.post, url, json={"inputs": [1.0]}, timeout=60)
            _wait_for(lambda: CountingLoadedModel.runs > before, seconds=30)  # it runs
            runs = CountingLoadedModel.runs
            gone = _connect(server.rest_port)
            gone.sendall((_HEAD + f"Content-Length: {len(_BODY)}\r\n\r\n").encode() + _BODY)
            _wait_for(lambda: _server_has_read(server.rest_port, gone), seconds=30)
            gone.close()
            assert slow.result().status_code == 200
        time.sleep(0.2)
        assert CountingLoadedModel.runs == runs


def test_slow_clients_are_cut_off_and_requests_in_flight_capped(models):
    with _serve(models, names=("scale",), header_timeout_seconds=2.0,
                body_timeout_seconds=3.0, max_concurrent_requests=3) as server:
        port, head, body = server.rest_port, _HEAD, _BODY
        slow_head = _connect(port)
        slow_head.sendall(head.encode())                        # the head never ends
        assert _closed_within(slow_head, 10)
        slow_body = _connect(port)
        slow_body.sendall((head + "Content-Length: 1000\r\n\r\n{").encode())
        answer = slow_body.recv(65536)
        assert b" 408 " in answer.split(b"\r\n")[0] and _closed_within(slow_body, 10)
        pools = [requests.Session() for _ in range(4)]     # a kept-alive connection each,
        for pool in pools:                                 # idle once answered
            assert pool.get(f"http://127.0.0.1:{port}/v1/models/scale", timeout=5).ok
        idle = [_connect(port) for _ in range(4)]   # more idle connections than the limit:
        for sock in idle:                           # not requests, so none is refused
            sock.sendall(b"P")
            _wait_for(lambda: _server_has_read(port, sock), seconds=30)
        assert requests.post(f"http://127.0.0.1:{port}/v1/models/scale:predict", data=body,
                             timeout=5).json() == {"outputs": [3.0]}
        in_flight = [_connect(port) for _ in range(3)]         # heads read, bodies awaited
        for sock in in_flight:
            sock.sendall((head + "Content-Length: 1000\r\n\r\n{").encode())
            _wait_for(lambda: _server_has_read(port, sock), seconds=30)
        idle += in_flight
        refused = requests.post(f"http://127.0.0.1:{port}/v1/models/scale:predict",
                                data=body, timeout=5)
        assert refused.status_code == 503
        assert refused.headers["content-type"] == "application/json"
        assert "--max_concurrent_requests" in refused.json()["error"]
        assert refused.headers["connection"] == "close"         # its body was not read
        assert all(_closed_within(sock, 10) for sock in idle)
        assert requests.post(f"http://127.0.0.1:{port}/v1/models/scale:predict", data=body,
                             timeout=5).json() == {"outputs": [3.0]}
        for pool in pools:
            pool.close()


def test_request_bytes_in_flight_are_capped_over_both_apis(models):
    """A body of which 90 bytes have arrived holds 90 of the server's 100: another REST body
    (17) or gRPC message is refused UNAVAILABLE (503), status still answers, and once the
    first client leaves the bytes are free again. What is declared but not sent holds
    nothing, and a chunked body holds what has arrived. A lone request larger than the cap
    runs."""
    with _serve(models, names=("scale",), max_request_bytes_in_flight=100) as server:
        port = server.rest_port
        url = f"http://127.0.0.1:{port}/v1/models/scale:predict"
        large = {"inputs": [1.0] * 40}                                  # 206 bytes, alone
        assert requests.post(url, json=large, timeout=5).json() == {"outputs": [3.0] * 40}
        declared = _connect(port)                      # 1,000 bytes declared, 1 sent
        declared.sendall((_HEAD + "Content-Length: 1000\r\n\r\n{").encode())
        _wait_for(lambda: server._in_flight.held == 1, seconds=30)
        holding = _connect(port)
        holding.sendall((_HEAD + "Content-Length: 100\r\n\r\n" + " " * 89).encode())
        _wait_for(lambda: server._in_flight.held == 90, seconds=30)
        refused = requests.post(url, data=_BODY, timeout=5)        # read whole: kept open
        assert refused.status_code == 503 and refused.headers.get("connection") != "close"
        assert refused.json() == {"error": "The server holds 90 bytes of other requests and "
                                  "unread answers; with this one's 17 they would pass 100 "
                                  "(--max_request_bytes_in_flight); retry later"}
        unsent = _connect(port)                 # refused mid-body: the rest is never read,
        unsent.sendall((_HEAD + "Content-Length: 50\r\n\r\n" + " " * 20).encode())
        answer = unsent.recv(65536)                       # so the connection closes
        assert b" 503 " in answer.split(b"\r\n")[0] and b"connection: close" in answer.lower()
        assert _closed_within(unsent, 10)
        error = _grpc_error(_stub(server).Predict,
                            _request("scale", {"x": np.ones(1, np.float32)}))
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        assert "--max_request_bytes_in_flight" in error.details()
        assert requests.get(f"http://127.0.0.1:{port}/v1/models/scale", timeout=5).ok
        holding.close()                                          # leaves mid-body
        declared.close()
        _wait_for(lambda: server._in_flight.held == 0, seconds=30)
        assert requests.post(url, data=_BODY, timeout=5).json() == {"outputs": [3.0]}
        chunked = _connect(port)                            # no length: counted as it comes
        chunked.sendall((_HEAD + "Transfer-Encoding: chunked\r\n\r\n5f\r\n" + " " * 95
                         + "\r\n").encode())
        _wait_for(lambda: server._in_flight.held == 95, seconds=30)
        assert requests.post(url, data=_BODY, timeout=5).status_code == 503
        chunked.close()
        _wait_for(lambda: server._in_flight.held == 0, seconds=30)
        assert _stub(server).Predict(_request("scale", {"x": np.ones(1, np.float32)}),
                                     timeout=10).outputs["y"].float_val == [3.0]


def test_a_stalled_body_is_cut_off_and_its_bytes_freed(models):
    """Uploads stalled just short of their end held the bytes in flight for the whole body
    timeout, and every other predict was refused meanwhile. A body none of which arrives for
    `body_stall_seconds` is refused 408 and its bytes freed; one that trickles in runs."""
    with _serve(models, names=("scale",), max_request_bytes_in_flight=100,
                body_timeout_seconds=120, body_stall_seconds=1.5) as server:
        url = f"http://127.0.0.1:{server.rest_port}/v1/models/scale:predict"
        stalled = _connect(server.rest_port)
        stalled.sendall((_HEAD + "Content-Length: 100\r\n\r\n" + " " * 90).encode())
        _wait_for(lambda: server._in_flight.held == 90, seconds=30)
        assert requests.post(url, data=_BODY, timeout=5).status_code == 503
        stalled.settimeout(60)
        answer = b"".join(iter(lambda: stalled.recv(65536), b""))         # until it closes
        assert b" 408 " in answer.split(b"\r\n")[0]
        assert answer.endswith(b'{"error": "The request body stalled: none of it arrived for '
                               b'1.5 s"}')
        _wait_for(lambda: server._in_flight.held == 0, seconds=30)
        assert requests.post(url, data=_BODY, timeout=5).json() == {"outputs": [3.0]}
        trickle = _connect(server.rest_port)
        trickle.sendall((_HEAD + f"Content-Length: {len(_BODY)}\r\n\r\n").encode())
        for byte in _BODY:                         # 17 bytes over ~3.4 s, none late
            time.sleep(0.2)
            trickle.sendall(bytes([byte]))
        trickle.settimeout(60)
        assert b" 200 " in trickle.recv(65536).split(b"\r\n")[0]


class LongAnswer(tf.Module):
    """x [b] float32 -> y [b] string: 8 MiB of "a" a row, more than loopback's socket buffers
    hold."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def serve(self, x):
        row = tf.strings.reduce_join(tf.fill([2048], "a" * 4096))
        return {"y": tf.fill(tf.shape(x), row)}


def _ask_long_without_reading(port: int) -> socket.socket:
    """A connection that asks the `long` model and reads nothing yet, with a small receive
    buffer, so that its 8 MiB answer waits in the server."""
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", port))
    client.sendall((_HEAD.replace("scale", "long") + f"Content-Length: {len(_BODY)}\r\n\r\n"
                    ).encode() + _BODY)
    return client


def test_an_unread_answer_is_counted_until_read_and_its_stalled_connection_aborted(tmp_path):
    """A client that never read its answer pinned it in the server's write buffer for as long
    as it kept the connection open, uncounted (40 such clients took 0.9 GB). The answer's
    bytes now count in flight until it is read, and the connection is aborted once its client
    reads none of it for `write_stall_seconds`, which frees them; a reading client is served."""
    save(LongAnswer(), str(tmp_path / "long"))
    manager = ModelManager([ModelConfig("long", str(tmp_path / "long"))], poll_seconds=0)
    with ModelServer(manager, grpc_port=None, rest_port=0, write_stall_seconds=3.0) as server:
        url = f"http://127.0.0.1:{server.rest_port}/v1/models/long:predict"
        assert requests.post(url, data=_BODY, timeout=60).json() == {"outputs": ["a" * (8 << 20)]}
        _wait_for(lambda: server._in_flight.held == 0, seconds=30)
        unread = _ask_long_without_reading(server.rest_port)
        _wait_for(lambda: server._in_flight.held > 8 << 20, seconds=60)   # 3 s to see it
        _wait_for(lambda: server._in_flight.held == 0, seconds=60)
        assert _closed_within(unread, 10)


def test_a_grpc_predict_without_a_deadline_is_answered(models):
    """A client that sets no deadline (the stubs' default) gets ~2^63 ns from
    `time_remaining`, which overflowed the run's int64 timeout: every such Predict failed
    INTERNAL, and one waiting for a run thread overflowed that wait. It now has no deadline;
    a model run's timeout beyond int64 milliseconds is capped."""
    with _serve(models, names=("scale", "spin"), predict_threads=1) as server:
        busy = threading.Thread(target=requests.post, kwargs=dict(
            url=f"http://127.0.0.1:{server.rest_port}/v1/models/spin:predict", data=_BODY,
            timeout=60))
        busy.start()               # the one run thread taken: the Predict waits for it
        _wait_for(lambda: server._scheduler._slots._value == 0, seconds=30)
        answer = _stub(server).Predict(_request("scale", {"x": np.array([1.0], np.float32)}))
        assert tf.make_ndarray(answer.outputs["y"]).tolist() == [3.0]
        busy.join()
        with server.manager.lease("scale") as (_, model):
            ran = model.run({"x": np.array([2.0], np.float32)}, timeout_seconds=1e20)
        assert ran["y"].tolist() == [6.0]


def test_alarms_ring_once_unless_cleared_and_shed_the_cleared():
    """Each alarm rings once, a cleared one never; cleared ones do not pile up; one set past
    the longest wait threads allow, or one that raises, stops no other; a rung action is
    not kept (a cancelled gRPC answer stayed in memory until the next alarm)."""
    import gc
    import weakref
    from tworec.serving.grpc_service import Alarms

    class Action:
        def __init__(self, name):
            self.name = name

        def __call__(self):
            rung.append(self.name)
            if self.name == "raises":
                raise RuntimeError("an action that fails")
    alarms, rung = Alarms(), []
    alarms.set(1e10, Action("far"))
    time.sleep(0.2)                                  # the thread waits for the far one first
    alarms.set(0.1, Action("raises"))
    kept = Action("kept")
    alarms.set(0.2, kept)
    alarms.clear(alarms.set(0.1, Action("cleared")))
    for _ in range(3000):                               # answers sent well before their alarm
        alarms.clear(alarms.set(60.0, Action("late")))
    assert len(alarms._due) <= 1027
    _wait_for(lambda: rung == ["raises", "kept"], seconds=10)
    time.sleep(0.3)
    assert rung == ["raises", "kept"]
    kept = weakref.ref(kept)
    gc.collect()
    assert kept() is None


def _http2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") \
        + payload


def _grpc_predict_never_reading(port: int, request) -> socket.socket:
    """A gRPC Predict over a raw HTTP/2 connection whose streams' receive window is 0: the
    server can send the answer's headers but none of its data, as to a client that reads
    nothing (HPACK literals without indexing; the server's frames are left unread)."""
    headers = b"".join(b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value
                       for name, value in ((b":method", b"POST"), (b":scheme", b"http"),
                                           (b":path", b"/tensorflow.serving.PredictionService/"
                                                      b"Predict"),
                                           (b":authority", b"127.0.0.1"),
                                           (b"content-type", b"application/grpc"),
                                           (b"te", b"trailers")))
    message = request.SerializeToString()
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                   + _http2_frame(4, 0, 0, (4).to_bytes(2, "big") + (0).to_bytes(4, "big"))
                   + _http2_frame(4, 1, 0, b"")           # the server's settings, acknowledged
                   + _http2_frame(1, 4, 1, headers)
                   + _http2_frame(0, 1, 1, b"\x00" + len(message).to_bytes(4, "big") + message))
    return client


@pytest.mark.parametrize("leaves", [True, False], ids=["client_leaves", "write_timeout"])
def test_an_unread_grpc_answer_is_counted_until_its_rpc_ends(tmp_path, leaves):
    """gRPC sends an answer after its handler returns: a client reading none of it held it in
    the server uncounted, and a few such clients pinned any memory. Its bytes now count in
    flight until the RPC ends: its client leaves, or the answer is not sent within the write
    timeout (3 s here), which cancels it, so that it cannot hold the others' budget; then a
    reading client is served."""
    save(LongAnswer(), str(tmp_path / "long"))
    manager = ModelManager([ModelConfig("long", str(tmp_path / "long"))], poll_seconds=0)
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "long"
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([1.0], np.float32)))
    with ModelServer(manager, grpc_port=0, rest_port=None,
                     write_timeout_seconds=60.0 if leaves else 3.0) as server:
        unread = _grpc_predict_never_reading(server.grpc_port, request)
        _wait_for(lambda: server._in_flight.held > 8 << 20, seconds=60)
        time.sleep(1.0)
        assert server._in_flight.held > 8 << 20                  # held while it is not read
        if leaves:
            unread.close()
        _wait_for(lambda: server._in_flight.held == 0, seconds=30)
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=[
                ("grpc.max_receive_message_length", 64 << 20)]) as channel:
            answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
                request, timeout=60)
        assert len(tf.make_ndarray(answer.outputs["y"])[0]) == 8 << 20
        _wait_for(lambda: server._in_flight.held == 0, seconds=30)
        unread.close()


def test_a_slowly_read_answer_is_aborted_at_the_write_timeout(tmp_path):
    """A client reading a little of its answer now and then never stalled, so it held the
    answer's bytes in flight and a request slot for as long as it kept reading. Its
    connection is now reset once the answer is not read within `write_timeout_seconds`,
    which frees both: the next request is served though only one may run at a time."""
    save(LongAnswer(), str(tmp_path / "long"))
    manager = ModelManager([ModelConfig("long", str(tmp_path / "long"))], poll_seconds=0)
    with ModelServer(manager, grpc_port=None, rest_port=0, max_concurrent_requests=1,
                     write_stall_seconds=60.0, write_timeout_seconds=3.0) as server:
        slow = _ask_long_without_reading(server.rest_port)
        received = 0                       # the 8 MiB take 13 s at most 64 KiB a 0.1 s
        slow.settimeout(60)
        with pytest.raises(ConnectionResetError):       # a reset: nothing more is sent
            while chunk := slow.recv(65536):
                received += len(chunk)
                time.sleep(0.1)
        assert received < 8 << 20
        _wait_for(lambda: server._in_flight.held == 0, seconds=30)
        url = f"http://127.0.0.1:{server.rest_port}/v1/models/long:predict"
        assert requests.post(url, data=_BODY, timeout=60).json() == {"outputs": ["a" * (8 << 20)]}


def test_a_lone_request_is_refused_while_an_answer_is_unread(models, tmp_path):
    """The limits said a lone request always runs, and its 503 blamed "other requests", while
    an answer not yet read held the bytes in flight: the request is refused until that answer
    is read or given up (here its client leaves), and the 503 says what holds them."""
    save(LongAnswer(), str(tmp_path / "long"))
    manager = ModelManager([ModelConfig("long", str(tmp_path / "long")),
                            ModelConfig("scale", os.path.join(models, "scale"))], poll_seconds=0)
    with ModelServer(manager, grpc_port=None, rest_port=0, max_request_bytes_in_flight=1 << 20,
                     write_stall_seconds=60.0, write_timeout_seconds=60.0) as server:
        unread = _ask_long_without_reading(server.rest_port)
        _wait_for(lambda: server._in_flight.held > 8 << 20, seconds=60)
        url = f"http://127.0.0.1:{server.rest_port}/v1/models/scale:predict"
        refused = requests.post(url, data=_BODY, timeout=10)
        assert refused.status_code == 503
        assert "bytes of other requests and unread answers" in refused.json()["error"]
        unread.close()
        _wait_for(lambda: server._in_flight.held == 0, seconds=30)
        assert requests.post(url, data=_BODY, timeout=10).json() == {"outputs": [3.0]}


def test_a_run_its_client_left_holds_its_request_bytes_until_it_ends(models):
    """The ~3 s spin run goes on after its REST client leaves; its inputs stay in memory, so
    its bytes stay counted in flight until the run ends, then are free."""
    manager = ModelManager([ModelConfig("spin", os.path.join(models, "spin"))],
                           poll_seconds=0, load=CountingLoadedModel)
    with ModelServer(manager, grpc_port=None, rest_port=0) as server:
        before = CountingLoadedModel.runs
        gone = _connect(server.rest_port)
        gone.sendall((_HEAD.replace("scale", "spin") + f"Content-Length: {len(_BODY)}\r\n\r\n"
                      ).encode() + _BODY)
        _wait_for(lambda: CountingLoadedModel.runs > before, seconds=30)      # it runs
        gone.close()
        time.sleep(1.0)                                  # the server has seen the client go
        assert server._in_flight.held == len(_BODY)
        _wait_for(lambda: server._in_flight.held == 0, seconds=60)


# ------------------------------------------------------------------ 8. batches fill


def test_batches_fill_beyond_the_request_threads(models):
    """16 concurrent one-row requests fill a 16-row batch at once instead of each waiting the
    2 s batch timeout; a request over max_batch_size is refused, or split when allowed."""
    batcher = Batcher(max_batch_size=16, batch_timeout_micros=2_000_000)
    with _serve(models, batcher=batcher) as server:
        stub = _stub(server)

        def call(i):
            start = time.monotonic()
            answer = stub.Predict(_request("scale", {"x": np.array([i], np.float32)}),
                                  timeout=10)
            return tf.make_ndarray(answer.outputs["y"])[0], time.monotonic() - start
        with ThreadPoolExecutor(16) as pool:
            call(0)
            answers = list(pool.map(call, range(48)))
        error = _grpc_error(stub.Predict, _request("scale", {"x": np.ones(17, np.float32)}))
    assert [value for value, _ in answers] == [3.0 * i for i in range(48)]
    assert np.median([seconds for _, seconds in answers]) < 1.0
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Task size 17 is larger than maximum input batch size 16" in error.details()
    splitting = Batcher(max_batch_size=4, batch_timeout_micros=1000,
                        enable_large_batch_splitting=True)
    with _serve(models, batcher=splitting) as server:
        answer = _stub(server).Predict(_request("scale", {"x": np.arange(10, dtype=np.float32)}),
                                       timeout=10)
    np.testing.assert_array_equal(tf.make_ndarray(answer.outputs["y"]), 3.0 * np.arange(10))


def test_a_short_deadline_does_not_cut_the_batch_short(models):
    """Four requests without a deadline share a batch with one whose deadline passes during
    the run: the merged run goes on (one session run, not one cut short and five more alone,
    which multiplied the others' latency), the four get their answers and the fifth
    DEADLINE_EXCEEDED."""
    model = CountingLoadedModel(os.path.join(models, "spin_short", "1"))
    batcher = Batcher(max_batch_size=5, batch_timeout_micros=30_000_000, num_batch_threads=1)
    try:
        runs = CountingLoadedModel.runs
        innocent = [batcher.submit(model, {"x": np.ones(1, np.float32)}) for _ in range(4)]
        short = batcher.submit(model, {"x": np.ones(1, np.float32)},      # fills the batch
                               deadline=time.monotonic() + 0.3)
        answers = [future.result(timeout=120)["y"] for future in innocent]
        assert short.exception(timeout=120).code == "DEADLINE_EXCEEDED"
    finally:
        batcher.close()
        model.close()
    assert CountingLoadedModel.runs - runs == 1
    assert answers[0].shape == (1,)
    assert all(np.array_equal(answer, answers[0]) for answer in answers)


class _Blocking:
    """A stand-in model: `run` records its rows and waits until `release` is set."""

    def __init__(self):
        self.release, self.runs = threading.Event(), []

    def check_inputs(self, inputs, signature_name=""):
        return inputs

    def run(self, inputs, signature_name="", output_filter=(), timeout_seconds=None):
        self.runs.append(len(inputs["x"]))
        assert self.release.wait(60)
        return {"y": inputs["x"] * 3}


class _RefusesNegatives:
    """A stand-in model: y = 3x, INVALID_ARGUMENT when any row is negative; records its runs'
    rows, and calls `during_first_run` in the first."""

    def __init__(self, during_first_run=lambda: None):
        self.runs, self.during_first_run = [], during_first_run

    def check_inputs(self, inputs, signature_name=""):
        return inputs

    def run(self, inputs, signature_name="", output_filter=(), timeout_seconds=None):
        self.runs.append(inputs["x"].tolist())
        if len(self.runs) == 1:
            self.during_first_run()
        if (inputs["x"] < 0).any():
            raise ServingError("INVALID_ARGUMENT", "x must not be negative")
        return {"y": inputs["x"] * 3}


@pytest.mark.parametrize("size, bad", [(16, 5), (17, 16), (32, 0), (2, 1)])
def test_one_bad_request_reruns_halves_of_its_batch_not_each_request(size, bad):
    """A merged run failing on one request's data ran every request alone after it, serially:
    16 good clients batched with one bad one timed out. Halves run merged instead, and only
    a failing half is halved again: 1 + 2·ceil(log2 n) runs, each request its own answer."""
    model = _RefusesNegatives()
    batcher = Batcher(max_batch_size=size, batch_timeout_micros=60_000_000, num_batch_threads=1)
    values = [-1.0 if i == bad else float(i) for i in range(size)]
    try:
        futures = [batcher.submit(model, {"x": np.array([v])}) for v in values]  # fills it
        answers = [future.exception(timeout=60) or future.result()["y"].tolist()
                   for future in futures]
    finally:
        batcher.close()
    assert len(model.runs) <= 1 + 2 * int(np.ceil(np.log2(size)))
    assert [a for i, a in enumerate(answers) if i != bad] == [
        [3.0 * v] for i, v in enumerate(values) if i != bad]
    assert answers[bad].code == "INVALID_ARGUMENT" and "negative" in answers[bad].message


def test_a_request_whose_client_left_is_not_run_again():
    """A client that leaves while its batch runs and fails is answered CANCELLED, and its rows
    are in none of the halves run after."""
    gone = threading.Event()
    model = _RefusesNegatives(during_first_run=gone.set)
    batcher = Batcher(max_batch_size=4, batch_timeout_micros=60_000_000, num_batch_threads=1)
    try:
        futures = [batcher.submit(model, {"x": np.array([v])}, cancelled=cancelled)
                   for v, cancelled in [(1.0, lambda: False), (2.0, gone.is_set),
                                        (-1.0, lambda: False), (4.0, lambda: False)]]
        assert futures[1].exception(timeout=60).code == "CANCELLED"
        assert [f.result(timeout=60)["y"].tolist() for f in futures[::3]] == [[3.0], [12.0]]
    finally:
        batcher.close()
    assert model.runs[0] == [1.0, 2.0, -1.0, 4.0]
    assert all(2.0 not in rows for rows in model.runs[1:])


@pytest.mark.parametrize("abandon", ["cancelled", "refused"])
def test_a_split_request_cancelled_or_refused_leaves_no_part_running(abandon):
    """Cancelling a split request cancels its queued parts, and a part refused by a full queue
    cancels the parts queued before it: none of them runs (they all did)."""
    model = _Blocking()
    batcher = Batcher(max_batch_size=2, batch_timeout_micros=60_000_000, num_batch_threads=1,
                      max_enqueued_batches=2, enable_large_batch_splitting=True)
    try:
        busy = batcher.submit(model, {"x": np.zeros(2)})            # holds the batch thread
        _wait_for(lambda: model.runs == [2], seconds=30)
        if abandon == "cancelled":
            split = batcher.submit(model, {"x": np.arange(4.0)})   # two parts, queued
            assert split.cancel()
        else:
            with pytest.raises(ServingError) as error:             # 4 rows fit, 6 do not
                batcher.submit(model, {"x": np.arange(6.0)})
            assert error.value.code == "UNAVAILABLE"
        model.release.set()
        busy.result(timeout=60)
        _wait_for(lambda: not batcher._queues, seconds=30)         # the parts dropped
        after = batcher.submit(model, {"x": np.array([5.0, 6.0])})
        np.testing.assert_array_equal(after.result(timeout=60)["y"], [15.0, 18.0])
    finally:
        model.release.set()
        batcher.close()
    assert model.runs == [2, 2]


# ------------------------------------------------------------------ 9. client errors


_LEAKS = re.compile(r"/tmp/|/work/|\b\w+(Error|Exception)\b|Traceback")


@pytest.mark.parametrize("model, body, status", [
    ("ranking", b'{"instances": [{"user_id": "\\ud800", "item_ids": ["i1"]}]}', 400),
    ("scale", b'{"inputs": ' + b"[" * 70 + b"1.0" + b"]" * 70 + b"}", 400),
    ("scale", b'{"signature_name": "__saved_model_init_op", "inputs": {}}', 400),
    ("scale", b'{"instances": [{"x": 1.0, "y": 2.0}]}', 400),     # inputs may carry it
], ids=["lone-surrogate", "nested-70-deep", "init-op-signature", "unknown-input-in-an-instance"])
def test_rest_client_mistakes_are_client_errors(models, model, body, status):
    with _serve(models) as server:
        answer = requests.post(f"http://127.0.0.1:{server.rest_port}/v1/models/{model}:predict",
                               data=body, timeout=10)
    assert answer.status_code == status, answer.text
    assert not _LEAKS.search(answer.json()["error"]), answer.text


def test_rest_errors_repeat_at_most_100_characters_of_a_clients_value(models):
    """A 10 MB bad b64 value came back as a 10 MB error: values an error repeats are cut."""
    long = "@" * 1_000_000
    bodies = {"ranking": [{"inputs": {"user_id": [{"b64": long}], "item_ids": [["i1"]]}},
                          {"inputs": {"user_id": [{"id": long}], "item_ids": [["i1"]]}},
                          {"instances": [{"user_id": "u1", "item_ids": ["i1"], long: 1}]},
                          {"signature_name": long, "inputs": {}}],
              "scale": [{"inputs": [long]}]}
    with _serve(models) as server:
        for model, body in [(m, b) for m, some in bodies.items() for b in some]:
            answer = requests.post(f"http://127.0.0.1:{server.rest_port}/v1/models/{model}"
                                   ":predict", json=body, timeout=30)
            assert answer.status_code == 400
            error = answer.json()["error"]
            assert "@...TRUNCATED" in error and len(error) < 400, error[:400]


def test_errors_repeat_at_most_100_characters_of_a_path_name_label_or_version(models):
    """A 5,000-character model name came back whole in a 5 KB error, as did a URL path, a
    label and a version's digits: they are cut as the body's values are."""
    long = "@" * 5000
    model = "/v1/models/scale"
    asked = [("GET", f"/{long}"), ("GET", f"/v1/{long}"), ("GET", f"/v1/models/{long}"),
             ("GET", f"/v1/models/{long}/metadata"), ("POST", f"/v1/models/{long}:predict"),
             ("GET", f"{model}/versions/9{'0' * 5000}"),
             ("GET", f"{model}/labels/{long}/metadata"), ("POST", f"{model}/labels/{long}:predict")]
    with _serve(models) as server:
        for method, path in asked:
            answer = requests.request(method, f"http://127.0.0.1:{server.rest_port}{path}",
                                      json={"inputs": [1.0]}, timeout=10)
            error = answer.json()["error"]
            assert answer.status_code in (400, 404), (path[:30], error[:400])
            assert "...TRUNCATED" in error and len(error) < 400, (path[:30], error[:400])
        error = _grpc_error(_stub(server).Predict,
                            _request(long, {"x": np.ones(1, np.float32)})).details()
        assert "@...TRUNCATED" in error and len(error) < 400, error[:400]


def test_grpc_init_op_and_missing_saved_model_are_client_facing(models, tmp_path):
    base = str(tmp_path / "empty")
    manager = ModelManager([ModelConfig("scale", os.path.join(models, "scale")),
                            ModelConfig("empty", base)], poll_seconds=0)
    with ModelServer(manager, grpc_port=0, rest_port=0) as server:
        os.makedirs(os.path.join(base, "1"))     # after the start, which it would fail
        manager.poll()                   # settled already: wait for the poll's outcome
        _wait_for(lambda: _states(manager, "empty").get(1) == "END")
        error = _grpc_error(_stub(server).Predict,
                            _request("scale", {}, signature="__saved_model_init_op"))
        status = requests.get(f"http://127.0.0.1:{server.rest_port}/v1/models/empty",
                              timeout=10).json()["model_version_status"][0]
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert status["state"] == "END" and status["status"]["error_code"] == "NOT_FOUND"
    assert not _LEAKS.search(status["status"]["error_message"]), status
    assert "empty" in status["status"]["error_message"]


# ------------------------------------------------------------------ 10. graceful stop


def _start_serve(models: str) -> tuple[subprocess.Popen, int]:
    """scripts/serve.py serving spin_short, once it says it is ready (its signal handlers are
    installed by then). REST needs a fixed port there (0 turns it off): a port another process
    took between the pick and the bind makes the server exit, and it is tried again."""
    for _ in range(5):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        process = subprocess.Popen(
            [sys.executable, os.path.join(REPOSITORY, "scripts", "serve.py"),
             "--model_name=spin_short", f"--model_base_path={models}/spin_short",
             "--port=0", f"--rest_api_port={port}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in process.stdout:
            if "serving gRPC" in line:
                return process, port
        process.wait(timeout=30)                       # exited before it was ready
    raise AssertionError("the server did not start")


def _http_status(sock: socket.socket) -> int:
    """The status code of the answer on `sock` (read to the end)."""
    sock.settimeout(60)
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return int(answer.split(b" ", 2)[1])


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_sigterm_drains_requests_in_flight(models, sig):
    process, port = _start_serve(models)
    try:
        body = b'{"inputs": [1.0]}'
        in_flight = [socket.create_connection(("127.0.0.1", port), timeout=30)
                     for _ in range(2)]
        for sock in in_flight:
            sock.sendall((f"POST /v1/models/spin_short:predict HTTP/1.1\r\nHost: x\r\n"
                          f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                          ).encode() + body)
        for sock in in_flight:                         # both requests read by the server
            _wait_for(lambda: _server_has_read(port, sock), seconds=30)
        process.send_signal(sig)
        statuses = [_http_status(sock) for sock in in_flight]
        for sock in in_flight:
            sock.close()
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
        process.stdout.close()
    assert statuses == [200, 200]


def _main_thread_in(code) -> bool:
    """Whether the main thread is running `code` (any frame of its stack)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame is not None


def test_a_signal_another_thread_takes_still_stops_the_server(models):
    """The kernel may hand a process's SIGTERM to any thread (under load it sometimes does);
    `wait` still wakes and stops. Whatever goes wrong, the sender wakes the main thread
    itself and says what went wrong."""
    server = _serve(models, names=("scale",)).start()
    server.handle_signals()
    received, _ = server._signals
    problems = []

    def send_from_another_thread() -> None:
        try:
            _wait_for(lambda: _main_thread_in(ModelServer.wait.__code__), seconds=20)
            time.sleep(0.3)                           # blocked in its wait by now
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)   # to this thread
            if not received.wait(timeout=20):
                problems.append("the SIGTERM another thread took did not stop the server")
        except BaseException as error:
            problems.append(repr(error))
        finally:
            received.set()                            # never leaves the main thread waiting
    sender = threading.Thread(target=send_from_another_thread, daemon=True)
    sender.start()
    server.wait()
    sender.join(timeout=30)
    assert not problems, problems


def test_ctrl_c_a_loading_thread_takes_stops_the_start(models):
    """Ctrl-C while the first models load stops `start` at once, even when the kernel hands
    SIGINT to the loading thread (the main thread must not wait on loading untimed)."""
    release = threading.Event()

    def load_interrupted(path: str) -> LoadedModel:
        """On the model's loading thread: SIGINT to itself once the main thread waits."""
        _wait_for(lambda: _main_thread_in(ModelManager.wait_until_settled.__code__), seconds=20)
        time.sleep(0.3)                               # blocked in its wait by now
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        release.wait(timeout=15)                      # a load that takes its time
        raise OSError("a load stopped by the test")
    manager = ModelManager([ModelConfig("scale", os.path.join(models, "scale"))],
                           poll_seconds=0, load=load_interrupted)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)   # as a terminal's
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            ModelServer(manager, grpc_port=0, rest_port=0).start()
        stopped_after = time.monotonic() - started
    finally:
        release.set()
        signal.signal(signal.SIGINT, previous)
    assert stopped_after < 5, f"start waited {stopped_after:.1f} s for the loading to end"


def test_a_timed_wait_is_not_settled_before_the_models_are_listed(models, monkeypatch):
    """Before a model's first poll has listed its versions none is LOADING; a wait that timed
    out then must still say "not settled" (`start` would announce a server with no model)."""
    listing = threading.Event()
    list_versions = manager_module.list_versions
    monkeypatch.setattr(manager_module, "list_versions",
                        lambda path: listing.wait(timeout=15) and list_versions(path))
    manager = ModelManager([ModelConfig("scale", os.path.join(models, "scale"))], poll_seconds=0)
    manager.start(wait=False)
    try:
        assert not manager.wait_until_settled(timeout=0.2)
        listing.set()
        assert manager.wait_until_settled(timeout=30)
        assert [s.state for s in manager.status("scale").model_version_status] == [
            get_model_status_pb2.ModelVersionStatus.AVAILABLE]
    finally:
        listing.set()
        manager.stop()


def test_a_listing_that_fails_in_any_way_still_settles(models, monkeypatch):
    """A base path whose listing raises (not only OSError) counts as listed, serving nothing:
    `start` would otherwise wait for it forever."""
    def broken(path: str) -> list[int]:
        raise ValueError("invalid literal for int()")
    monkeypatch.setattr(manager_module, "list_versions", broken)
    manager = ModelManager([ModelConfig("scale", os.path.join(models, "scale"))], poll_seconds=0)
    manager.start(wait=False)
    try:
        assert manager.wait_until_settled(timeout=10)
    finally:
        manager.stop()


def test_polls_slower_than_their_interval_still_settle(models, monkeypatch):
    """Listing a base path slower than the poll interval (a network file system) always leaves
    a poll running; the models still settle once their versions are AVAILABLE."""
    list_versions = manager_module.list_versions
    monkeypatch.setattr(manager_module, "list_versions",
                        lambda path: time.sleep(0.3) or list_versions(path))
    manager = ModelManager([ModelConfig("scale", os.path.join(models, "scale"))],
                           poll_seconds=0.1)
    manager.start(wait=False)
    deadline = time.monotonic() + 10
    try:
        while not manager.wait_until_settled(timeout=0.1):        # in steps, as `start` waits
            assert time.monotonic() < deadline, "never settled"
    finally:
        manager.stop()


def test_a_rest_server_without_a_deadline_answers(models):
    """--rest_api_timeout_in_ms 0 (TF Serving: no deadline) gives rest_timeout_seconds None."""
    with _serve(models, names=("scale",), rest_timeout_seconds=None) as server:
        answer = requests.post(f"http://127.0.0.1:{server.rest_port}/v1/models/scale:predict",
                               data=_BODY, timeout=10)
    assert answer.json() == {"outputs": [3.0]}


def test_a_reload_after_stop_is_refused_not_left_waiting(models):
    manager = ModelManager([ModelConfig("scale", os.path.join(models, "scale"))],
                           poll_seconds=0)
    manager.start()
    manager.stop()
    with pytest.raises(ServingError) as error:
        manager.reload([ModelConfig("scale", os.path.join(models, "scale"))])
    assert error.value.code == "UNAVAILABLE"
