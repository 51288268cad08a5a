"""Tests of `serving`: layout, TF-Serving-style loading, the model server, clients, recommender.

The conformance tests run against the embedded server, and also against a real TF Serving when
these environment variables are set:
    TFSERVING_REST       e.g. http://127.0.0.1:8501
    TFSERVING_GRPC       e.g. 127.0.0.1:8500
    TFSERVING_MODEL_DIR  a folder the tests write their toy models into, which the server reads
    TFSERVING_SERVER_MODEL_DIR  the same folder as the server sees it (default: the same path;
                         e.g. /models for `docker run -v $TFSERVING_MODEL_DIR:/models`)
The tests then load their models into that server with `HandleReloadConfigRequest`.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
import types
import warnings
from fractions import Fraction

import grpc
import numpy as np
import pytest
import requests

import tworec.serving  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads)
import tensorflow as tf
from google.protobuf import text_format
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2,
                                     get_model_status_pb2, model_management_pb2,
                                     model_service_pb2_grpc, predict_pb2, prediction_log_pb2,
                                     prediction_service_pb2_grpc, regression_pb2)
from tensorflow_serving.config import model_server_config_pb2

from tworec.serving.client import Client
from tworec.serving.compose import compose_recommender
from tworec.serving.errors import ServingError, echo, truncate
from tworec.serving.layout import (drop_unservable_functions, list_versions, next_version,
                                  save_servable, write_models_config, write_version,
                                  write_warmup_requests)
from tworec.serving.manager import ModelConfig, ModelManager, parse_config
from tworec.serving.model import LoadedModel
from tworec.serving.recommender import PAD_ID, Recommender
from tworec.serving.server import ModelServer

USERS = np.array([f"u{i}" for i in range(6)], dtype=object)
ITEMS = np.array([f"i{i}" for i in range(12)], dtype=object)
MAX_REQUEST_BYTES = 1 << 20
MODELS = ("retrieval", "ranking", "scale")
PLATFORM = 'model_platform: "tensorflow"'             # what TF Serving needs of each config


# ------------------------------------------------------------------ toy SavedModels


def _table(keys: np.ndarray) -> tf.lookup.StaticHashTable:
    """String id -> int64 position; unknown ids map to 0."""
    return tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
        tf.constant(keys, tf.string), tf.range(len(keys), dtype=tf.int64)), default_value=0)


class ToyRetrieval(tf.Module):
    """user_id [b] string -> item_ids [b, k] string, scores [b, k] float32."""

    def __init__(self, k: int = 6, seed: int = 0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.users = _table(USERS)
        self.user_embeddings = tf.Variable(rng.normal(size=(len(USERS), 4)).astype(np.float32))
        self.item_embeddings = tf.Variable(rng.normal(size=(len(ITEMS), 4)).astype(np.float32))
        self.item_ids = tf.constant(ITEMS, tf.string)
        self.k = k

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id")])
    def serve(self, user_id):
        query = tf.gather(self.user_embeddings, self.users.lookup(user_id))        # [b, 4]
        scores = tf.matmul(query, self.item_embeddings, transpose_b=True)           # [b, I]
        best, index = tf.math.top_k(scores, self.k)                                 # [b, k]
        return {"item_ids": tf.gather(self.item_ids, index), "scores": best}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id")])
    def known_users(self, user_id):
        return {"known": tf.reduce_any(user_id[:, None] == tf.constant(USERS)[None, :], 1)}


class ToyRanking(tf.Module):
    """user_id [b] string, item_ids [b, n] string -> scores [b, n] float32."""

    def __init__(self, seed: int = 1):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.users, self.items = _table(USERS), _table(ITEMS)
        self.user_embeddings = tf.Variable(rng.normal(size=(len(USERS), 4)).astype(np.float32))
        self.item_embeddings = tf.Variable(rng.normal(size=(len(ITEMS), 4)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id"),
                                  tf.TensorSpec([None, None], tf.string, name="item_ids")])
    def serve(self, user_id, item_ids):
        users = tf.gather(self.user_embeddings, self.users.lookup(user_id))          # [b, 4]
        items = tf.gather(self.item_embeddings, self.items.lookup(item_ids))         # [b, n, 4]
        return {"scores": tf.reduce_sum(users[:, None, :] * items, axis=-1)}         # [b, n]


class Scale(tf.Module):
    """x [b] float32 -> y [b] float32 = x * factor; the factor tells versions apart."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = tf.constant(factor, tf.float32)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def serve(self, x):
        return {"y": x * self.factor}


def save(module: tf.Module, base_path: str, version: int | None = None) -> str:
    signatures = {"serving_default": module.serve}
    if hasattr(module, "known_users"):
        signatures["known_users"] = module.known_users
    return write_version(base_path, lambda path: tf.saved_model.save(
        module, path, signatures=signatures), version)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """retrieval/1, ranking/1, scale/1 and models.config, in TFSERVING_MODEL_DIR when set."""
    root = os.environ.get("TFSERVING_MODEL_DIR") or str(tmp_path_factory.mktemp("models"))
    for name, module in {"retrieval": ToyRetrieval(), "ranking": ToyRanking(),
                         "scale": Scale(3.0)}.items():
        if not list_versions(os.path.join(root, name)):
            save(module, os.path.join(root, name))
    write_models_config(os.path.join(root, "models.config"),
                        {name: os.path.join(root, name) for name in MODELS})
    return root


@pytest.fixture(scope="module")
def local(model_dir):
    """In-process sessions of the toy models: what every server must answer."""
    models = {name: LoadedModel(os.path.join(model_dir, name, "1")) for name in MODELS}
    yield models
    for model in models.values():
        model.close()


@pytest.fixture(scope="module")
def embedded(model_dir):
    with open(os.path.join(model_dir, "models.config")) as f:
        manager = ModelManager(parse_config(f.read()), poll_seconds=0.2)
    with ModelServer(manager, grpc_port=0, rest_port=0,
                     max_request_bytes=MAX_REQUEST_BYTES) as server:
        yield f"http://127.0.0.1:{server.rest_port}", f"127.0.0.1:{server.grpc_port}"


def _real_tf_serving(model_dir: str):
    rest, target = os.environ.get("TFSERVING_REST"), os.environ.get("TFSERVING_GRPC")
    if not (rest and target and os.environ.get("TFSERVING_MODEL_DIR")):
        pytest.skip("set TFSERVING_REST, TFSERVING_GRPC and TFSERVING_MODEL_DIR to test a "
                    "real TF Serving")
    server_dir = os.environ.get("TFSERVING_SERVER_MODEL_DIR", model_dir)
    config = model_server_config_pb2.ModelServerConfig()
    for name in MODELS:
        config.model_config_list.config.add(name=name, base_path=f"{server_dir}/{name}",
                                            model_platform="tensorflow")
    with grpc.insecure_channel(target) as channel:
        model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest(
            model_management_pb2.ReloadConfigRequest(config=config), timeout=60)
    client = Client(url=rest)
    deadline = time.time() + 60
    while not all(_available(client, name) for name in MODELS):
        assert time.time() < deadline, "the real TF Serving did not load the toy models"
        time.sleep(0.5)
    return rest.rstrip("/"), target


def _available(client: Client, name: str) -> bool:
    try:
        states = client.status(name).model_version_status
    except ServingError:
        return False
    return any(s.state == get_model_status_pb2.ModelVersionStatus.AVAILABLE for s in states)


@pytest.fixture(scope="module", params=["embedded", "tf_serving"])
def server(request, model_dir):
    """(kind, REST base URL, gRPC target) of each server under test."""
    if request.param == "embedded":
        rest, target = request.getfixturevalue("embedded")
    else:
        rest, target = _real_tf_serving(model_dir)
    return request.param, rest, target


@pytest.fixture(scope="module")
def stubs(server):
    channel = grpc.insecure_channel(server[2])
    yield (prediction_service_pb2_grpc.PredictionServiceStub(channel),
           model_service_pb2_grpc.ModelServiceStub(channel))
    channel.close()


def _assert_answers(rest: str) -> None:
    """The server still serves normally."""
    answer = requests.post(f"{rest}/v1/models/scale:predict", json={"inputs": [1.0]}, timeout=10)
    assert answer.status_code == 200 and answer.json() == {"outputs": [3.0]}


# ------------------------------------------------------------------ layout


def test_versions_are_integer_folders_written_atomically(tmp_path):
    base = str(tmp_path / "m")
    assert list_versions(base) == [] and next_version(base) == 1
    others = ["tmp", ".tmp-3-x", "2a", "\u00b2"]               # '²' is a digit, not an int
    for name in ("1", "10", *others):
        os.makedirs(os.path.join(base, name))
    assert list_versions(base) == [1, 10] and next_version(base) == 11

    def fail(path):
        open(os.path.join(path, "saved_model.pb"), "w").close()
        raise RuntimeError("export failed")
    with pytest.raises(RuntimeError):
        write_version(base, fail)
    assert sorted(os.listdir(base)) == sorted(["1", "10", *others])
    assert write_version(base, lambda path: None) == os.path.join(base, "11")
    with pytest.raises(FileExistsError):
        write_version(base, lambda path: None, version=11)


def test_versions_are_readable_by_a_server_running_as_another_user(tmp_path):
    def write(path):
        os.makedirs(os.path.join(path, "variables"))
        open(os.path.join(path, "variables", "variables.index"), "w").close()
    previous = os.umask(0o077)                    # a private umask must not hide the model
    try:
        version = write_version(str(tmp_path / "m"), write)
    finally:
        os.umask(previous)
    assert os.stat(version).st_mode & 0o777 == 0o755
    assert os.stat(os.path.join(version, "variables")).st_mode & 0o777 == 0o755
    assert os.stat(os.path.join(version, "variables", "variables.index")).st_mode & 0o777 == 0o644


def test_models_config_is_a_model_server_config(tmp_path):
    path = write_models_config(str(tmp_path / "models.config"),
                               {"a": str(tmp_path / "a"), "b": "rel/b"})
    proto = text_format.Parse(open(path).read(), model_server_config_pb2.ModelServerConfig())
    configs = proto.model_config_list.config
    assert [(c.name, c.model_platform) for c in configs] == [("a", "tensorflow"),
                                                              ("b", "tensorflow")]
    assert configs[1].base_path == os.path.abspath("rel/b")
    assert parse_config(open(path).read())[0] == ModelConfig("a", str(tmp_path / "a"))


def test_version_policies():
    text = """model_config_list {
      config { name: "a" base_path: "/a" model_platform: "tensorflow"
               model_version_policy { latest { num_versions: 2 } } }
      config { name: "b" base_path: "/b" model_platform: "tensorflow"
               model_version_policy { all {} } }
      config { name: "c" base_path: "/c" model_platform: "tensorflow"
               model_version_policy { specific { versions: 1 versions: 3 } }
               version_labels { key: "stable" value: 1 } }
      config { name: "d" base_path: "/d" model_type: TENSORFLOW } }"""
    a, b, c, d = parse_config(text)
    on_disk = [1, 2, 3, 4]
    assert (a.wanted(on_disk), b.wanted(on_disk), c.wanted(on_disk), d.wanted(on_disk)) == (
        {3, 4}, {1, 2, 3, 4}, {1, 3}, {4})
    assert c.labels == {"stable": 1}
    with pytest.raises(ServingError, match="Invalid model config"):
        parse_config("model_config_list { nonsense: 1 }")


# ------------------------------------------------------------------ loading like TF Serving


def test_loads_in_a_session_and_runs_by_tensor_names(local):
    model = local["retrieval"]
    assert isinstance(model.session, tf.compat.v1.Session)
    assert set(model.signature_defs) == {"serving_default", "known_users",
                                         "__saved_model_init_op"}
    outputs = model.run({"user_id": np.array(["u1", "nobody"])})
    toy = ToyRetrieval()                    # the same seed as the saved one
    eager = toy.serve(tf.constant(["u1", "nobody"]))
    assert np.array_equal(outputs["item_ids"], eager["item_ids"].numpy())
    np.testing.assert_allclose(outputs["scores"], eager["scores"].numpy(), rtol=1e-6)
    assert list(model.run({"user_id": np.array([b"u1"])}, output_filter=["scores"])) == ["scores"]


@pytest.mark.parametrize("inputs, signature, code, message", [
    ({"user_id": np.array([1.0])}, "", "INVALID_ARGUMENT", "expects dtype string"),
    ({}, "", "INVALID_ARGUMENT", "Missing but required: {user_id}"),
    ({"user_id": np.array(["u"]), "x": np.array(["u"])}, "", "INVALID_ARGUMENT",
     "Sent extra: {x}"),
    ({"user_id": np.array([["u"]])}, "", "INVALID_ARGUMENT", r"expects shape \[-1\]"),
    ({"user_id": np.array(["u"])}, "nope", "FAILED_PRECONDITION",
     'Serving signature key "nope" not found.'),
])
def test_inputs_are_checked_against_the_signature(local, inputs, signature, code, message):
    with pytest.raises(ServingError, match=message) as error:
        local["retrieval"].run(inputs, signature)
    assert error.value.code == code


def test_scann_models_load_because_the_server_imports_scann(tmp_path):
    import tensorflow_recommenders as tfrs

    items = np.random.default_rng(0).normal(size=(200, 8)).astype(np.float32)
    index = tfrs.layers.factorized_top_k.ScaNN(k=5, num_leaves=4, num_leaves_to_search=4,
                                               dimensions_per_block=2, training_iterations=2)
    index.index(tf.constant(items))
    module = tf.Module()
    module.index = index
    module.serve = tf.function(lambda query: dict(zip(("scores", "index"), index(query))),
                               input_signature=[tf.TensorSpec([None, 8], tf.float32)])
    path = str(tmp_path / "scann")
    tf.saved_model.save(module, path, signatures={"serving_default": module.serve},
                        options=tf.saved_model.SaveOptions(namespace_whitelist=["Scann"]))
    model = LoadedModel(path)
    ops = {node.op for function in model.graph.as_graph_def().library.function
           for node in function.node_def}
    assert any(op.startswith("Scann>") for op in ops)
    (query,) = model.signature_defs["serving_default"].inputs
    assert model.run({query: items[:3]})["index"].shape == (3, 5)
    model.close()


def test_warmup_runs_at_load_and_a_failing_one_fails_the_load(tmp_path):
    good = save(Scale(2.0), str(tmp_path / "good"))
    write_warmup_requests(good, "good", {"serving_default": {"x": np.arange(3, dtype=np.float32)}})
    LoadedModel(good).close()
    bad = save(Scale(2.0), str(tmp_path / "bad"))
    write_warmup_requests(bad, "bad", {"serving_default": {"z": np.arange(3, dtype=np.float32)}})
    with pytest.raises(ServingError, match="Sent extra: {z}"):
        LoadedModel(bad)


class Bounded(Scale):
    """`Scale`, and a "bounded" signature that fails on an x of 2 or more."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def bounded(self, x):
        with tf.control_dependencies([tf.debugging.assert_less(x, 2.0)]):
            return {"y": tf.identity(x)}


def test_warmup_requests_call_every_signature_given_within_the_record_limit(tmp_path):
    """Each signature is called with its own rows (the second one's failure fails the load),
    in turn, and rows are cut so that the records stay within TF Serving's 1000."""
    module = Bounded(2.0)
    path = write_version(str(tmp_path / "bounded"), lambda out: tf.saved_model.save(
        module, out, signatures={"serving_default": module.serve, "bounded": module.bounded}))

    def written(requests: dict) -> list[tuple[str, list[float]]]:
        logs = map(prediction_log_pb2.PredictionLog.FromString, tf.compat.v1.io.
                   tf_record_iterator(write_warmup_requests(path, "bounded", requests)))
        return [(log.predict_log.request.model_spec.signature_name,
                 tf.make_ndarray(log.predict_log.request.inputs["x"]).tolist()) for log in logs]
    assert written({"serving_default": {"x": np.arange(3, dtype=np.float32)},
                    "bounded": {"x": np.array([1], np.float32)}}) == [
        ("serving_default", [0.0]), ("bounded", [1.0]), ("serving_default", [1.0]),
        ("serving_default", [2.0])]
    LoadedModel(path).close()
    for wrong in ({}, [("serving_default", {"x": np.ones(1, np.float32)})],
                  {str(n): {"x": np.ones(1, np.float32)} for n in range(1001)}):
        with pytest.raises(ValueError, match="requests must map 1 to 1000 signature names"):
            write_warmup_requests(path, "bounded", wrong)
    for inputs, sizes in (({}, r"\[\]"), ({"x": np.ones(2), "y": np.ones(3)}, r"\[2, 3\]")):
        with pytest.raises(ValueError, match=f"of 'bounded' must be .* sizes {sizes}$"):
            write_warmup_requests(path, "bounded", {"bounded": inputs})
    written({"serving_default": {"x": np.arange(3, dtype=np.float32)},
             "bounded": {"x": np.arange(3, dtype=np.float32)}})
    with pytest.raises(ServingError, match="Condition x < y did not hold"):
        LoadedModel(path)
    many = written({"serving_default": {"x": np.zeros(600, np.float32)},
                    "bounded": {"x": np.zeros(700, np.float32)}})
    assert [name for name, _ in many] == ["serving_default", "bounded"] * 500
    LoadedModel(path).close()


@tf.custom_gradient
def clipped_gradient(x):
    """x, its gradient clipped to [-1, 1]: a custom gradient the SavedModel registers."""
    return tf.identity(x), lambda upstream: tf.clip_by_value(upstream, -1.0, 1.0)


class Recurrent(tf.Module):
    """x [b, 3] float32 -> y [b, 2] float32 through a Keras GRU, whose call registers its cuDNN
    alternative and that alternative's gradient functions in the signature's graph."""

    def __init__(self):
        super().__init__()
        self.gru = tf.keras.layers.GRU(2)
        self.gru(tf.zeros([1, 3, 1]))

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
    def serve(self, x):
        return {"y": self.gru(clipped_gradient(x)[..., None])}


def test_exports_keep_the_functions_a_session_can_run_and_a_matching_fingerprint(tmp_path):
    """`drop_unservable_functions` drops the GRU's gradient functions and what only they call,
    keeps its CPU and GPU variants (Grappler picks one by device) and the custom gradient,
    answers as the whole SavedModel, in a session and through `tf.saved_model.load`, and
    rewrites the fingerprint of the file it changed; `save_servable` saves so."""
    import shutil
    from tensorflow.core.protobuf import saved_model_pb2
    from tensorflow.core.protobuf.fingerprint_pb2 import FingerprintDef
    from tensorflow.python.saved_model.pywrap_saved_model import fingerprinting
    module, x = Recurrent(), np.arange(6, dtype=np.float32).reshape(2, 3) / 6
    whole, pruned, saved = (str(tmp_path / name) for name in ("whole", "pruned", "saved"))
    tf.saved_model.save(module, whole, signatures={"serving_default": module.serve})
    shutil.copytree(whole, pruned)

    def library(path: str):
        model = saved_model_pb2.SavedModel.FromString((tmp_path / path / "saved_model.pb")
                                                      .read_bytes())
        return model.meta_graphs[0].graph_def.library

    def functions(path: str) -> dict:
        return {f.signature.name: f for f in library(path).function}

    def calls(function) -> set[str]:
        return {node.op for node in function.node_def} | {
            name for node in function.node_def for value in node.attr.values()
            for name in [value.func.name, *(f.name for f in value.list.func)]}
    before = functions("whole")

    def closure(names: set[str]) -> set[str]:
        found, waiting = set(), set(names)
        while waiting:
            name = waiting.pop()
            if name in before and name not in found:
                found.add(name)
                waiting |= calls(before[name])
        return found
    gradients = {name for name, f in before.items()
                 if {"forward_function_name", "backward_function_name"} & set(f.attr)}
    assert gradients and library("whole").registered_gradients                # custom_gradient's
    assert drop_unservable_functions(pruned) == len(before) - len(functions("pruned"))
    assert gradients <= set(before) - set(functions("pruned")) <= closure(gradients)
    assert closure(set(functions("pruned"))) == set(functions("pruned"))   # none it calls missing
    files, again = sorted((tmp_path / "pruned").glob("*.pb")), tmp_path / "again"
    written = [path.read_bytes() for path in files]          # saved_model.pb, fingerprint.pb
    shutil.copytree(whole, again)
    drop_unservable_functions(str(again))
    assert (again / "saved_model.pb").read_bytes() == written[1]                   # deterministic
    assert drop_unservable_functions(pruned) == 0 and not list((tmp_path / "pruned").glob("*.tmp"))
    assert [path.read_bytes() for path in files] == written       # untouched (its uuid included)
    save_servable(module, saved, {"serving_default": module.serve})
    for path in ("pruned", "saved"):
        kept = functions(path)
        assert not any({"forward_function_name", "backward_function_name"} & set(f.attr)
                       for f in kept.values())
        devices = {f.attr["api_preferred_device"].s for f in kept.values()
                   if "api_preferred_device" in f.attr}
        assert devices == {b"CPU", b"GPU"}, devices
        registered = library(path).registered_gradients
        assert registered and all(g.gradient_func in kept for g in registered)
        written, recomputed = (FingerprintDef.FromString(proto) for proto in (
            (tmp_path / path / "fingerprint.pb").read_bytes(),
            fingerprinting.CreateFingerprintDef(str(tmp_path / path))))
        written.ClearField("uuid"), recomputed.ClearField("uuid")              # random each time
        assert written == recomputed
    answers = []
    for path in (whole, pruned, saved):
        model = LoadedModel(path, run_warmup=False)
        answers.append(model.run({"x": x})["y"])
        model.close()
        loaded = tf.saved_model.load(path)
        answers.append(loaded.signatures["serving_default"](x=x)["y"].numpy())
    assert all(np.array_equal(answers[0], answer) for answer in answers), answers


def test_the_functions_kept_are_those_called_named_or_swapped_in():
    """`servable_functions` on a hand-made MetaGraphDef: every way a function is reached (a
    node's op or attr, nested or in a list; the object graph's functions, bare and captured
    ones and its concrete functions; gradient lists; an implementation-selector alternative
    and what it calls), and nothing else (a forward/backward alternative, an unreached one)."""
    from tensorflow.core.protobuf import meta_graph_pb2
    from tworec.serving.layout import servable_functions
    meta = meta_graph_pb2.MetaGraphDef()
    library = meta.graph_def.library
    for name in ("op", "attr", "nested", "listed", "object", "bare", "captured", "concrete",
                 "gradient_of", "gradient", "registered", "cpu", "gpu", "gpu_body", "forward",
                 "backward", "unreached", "only_forward_calls"):
        library.function.add().signature.name = name
    functions = {f.signature.name: f for f in library.function}
    meta.graph_def.node.add(name="a", op="op")
    node = meta.graph_def.node.add(name="b", op="Identity")
    node.attr["f"].func.name = "attr"
    node.attr["f"].func.attr["inner"].func.name = "nested"
    node.attr["fs"].list.func.add(name="listed")
    functions["op"].node_def.add(name="c", op="cpu")
    for name, device in (("cpu", b"CPU"), ("gpu", b"GPU"), ("forward", b"GPU"),
                         ("backward", b"GPU")):
        functions[name].attr["api_implements"].s = b"gru_1"
        functions[name].attr["api_preferred_device"].s = device
    functions["forward"].attr["backward_function_name"].s = b"backward"
    functions["backward"].attr["forward_function_name"].s = b"forward"
    functions["gpu"].node_def.add(name="d", op="gpu_body")
    functions["forward"].node_def.add(name="e", op="only_forward_calls")
    objects = meta.object_graph_def
    objects.nodes.add().function.concrete_functions.append("object")
    objects.nodes.add().bare_concrete_function.concrete_function_name = "bare"
    objects.nodes.add().captured_tensor.concrete_function = "captured"
    objects.concrete_functions["concrete"].SetInParent()
    library.gradient.add(function_name="gradient_of", gradient_func="gradient")
    library.registered_gradients.add(gradient_func="registered", registered_op_type="Custom")
    assert servable_functions(meta) == {
        "op", "attr", "nested", "listed", "object", "bare", "captured", "concrete",
        "gradient_of", "gradient", "registered", "cpu", "gpu", "gpu_body"}


# ------------------------------------------------------------------ REST conformance


def test_rest_status(server):
    _, rest, _ = server
    answer = requests.get(f"{rest}/v1/models/retrieval", timeout=10)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.json() == {"model_version_status": [{
        "version": "1", "state": "AVAILABLE",
        "status": {"error_code": "OK", "error_message": ""}}]}
    assert requests.get(f"{rest}/v1/models/retrieval/versions/1", timeout=10).json() == \
        answer.json()


def test_rest_metadata(server):
    _, rest, _ = server
    answer = requests.get(f"{rest}/v1/models/ranking/metadata", timeout=10).json()
    assert answer["model_spec"] == {"name": "ranking", "signature_name": "", "version": "1"}
    signatures = answer["metadata"]["signature_def"]["signature_def"]
    assert {"serving_default", "__saved_model_init_op"} <= set(signatures)
    inputs = signatures["serving_default"]["inputs"]
    assert inputs["item_ids"]["dtype"] == "DT_STRING"
    assert [d["size"] for d in inputs["item_ids"]["tensor_shape"]["dim"]] == ["-1", "-1"]
    assert signatures["serving_default"]["method_name"] == "tensorflow/serving/predict"


def _predict(rest: str, model: str, body) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(f"{rest}/v1/models/{model}:predict", data=data, timeout=10)


def test_a_key_given_twice_keeps_its_first_value_as_in_tf_serving(server, local):
    _, rest, _ = server
    expected = local["retrieval"].run({"user_id": np.array(["u1"])})["item_ids"][0]
    answer = _predict(rest, "retrieval", b'{"instances": ["u1"], "instances": ["u2"]}')
    assert [item.encode() for item in answer.json()["predictions"][0]["item_ids"]] == \
        expected.tolist()
    named = _predict(rest, "retrieval", b'{"inputs": {"user_id": ["u1"], "user_id": ["u2"]}}')
    assert [item.encode() for item in named.json()["outputs"]["item_ids"][0]] == \
        expected.tolist()
    bom = _predict(rest, "retrieval", b'\xef\xbb\xbf{"instances": ["u1"]}')   # skipped, as
    assert bom.status_code == 200, bom.text                    # RapidJSON's stream skips it


def test_an_inputs_object_may_carry_keys_the_signature_does_not_read(server, local):
    """As TF Serving's `FillTensorMapFromInputsMap`, which looks up the signature's names
    alone (an instance's unknown key is refused: REST_ERRORS)."""
    _, rest, _ = server
    expected = local["retrieval"].run({"user_id": np.array(["u1"])})["item_ids"][0]
    answer = _predict(rest, "retrieval", {"inputs": {"user_id": ["u1"], "debug": [1, 2]}})
    assert answer.status_code == 200, answer.text
    assert [item.encode() for item in answer.json()["outputs"]["item_ids"][0]] == \
        expected.tolist()


def test_rest_predict_row_and_columnar_forms(server, local):
    _, rest, _ = server
    users = ["u0", "u3"]
    expected = local["retrieval"].run({"user_id": np.array(users)})
    ids = [[i.decode() for i in row] for row in expected["item_ids"]]
    rows = _predict(rest, "retrieval", {"instances": users}).json()["predictions"]
    assert [row["item_ids"] for row in rows] == ids
    np.testing.assert_allclose([row["scores"] for row in rows], expected["scores"], rtol=1e-6)
    b64 = [{"b64": base64.b64encode(u.encode()).decode()} for u in users]
    b64[0]["b64"] = b64[0]["b64"].rstrip("=")                 # read as absl reads base64:
    b64[1]["b64"] = b64[1]["b64"][:2] + "\r\n" + b64[1]["b64"][2:]   # padding optional, spaces
    columns = _predict(rest, "retrieval", {"signature_name": "serving_default",
                                           "inputs": {"user_id": b64}}).json()["outputs"]
    assert columns["item_ids"] == ids
    assert _predict(rest, "scale", {"instances": [1.0, 2]}).json() == {"predictions": [3.0, 6.0]}
    assert _predict(rest, "scale", {"inputs": {"x": [1.5]}}).json() == {"outputs": [4.5]}


def test_rest_predict_named_instances(server, local):
    _, rest, _ = server
    rows = [{"user_id": "u1", "item_ids": ["i1", "i2", "i3"]},
            {"user_id": "u2", "item_ids": ["i4", "i5", "i6"]}]
    expected = local["ranking"].run({"user_id": np.array(["u1", "u2"]), "item_ids": np.array(
        [r["item_ids"] for r in rows])})["scores"]
    answer = _predict(rest, "ranking", {"instances": rows}).json()["predictions"]
    np.testing.assert_allclose(answer, expected, rtol=1e-6)


def _formatted(outputs: dict, row_form: bool):
    from tworec.serving.json_tensor import format_predict
    return json.loads(format_predict(outputs, row_form))


def test_json_responses_are_shaped_as_tf_serving_shapes_them():
    outputs = {"ids": np.array([[b"a"], [b"b"]], object), "raw_bytes": np.array([b"\xff", b"x"]),
               "score": np.array([0.5, 1.0], np.float32)}
    assert _formatted(outputs, row_form=True)["predictions"] == [
        {"ids": ["a"], "raw_bytes": {"b64": "/w=="}, "score": 0.5},
        {"ids": ["b"], "raw_bytes": {"b64": "eA=="}, "score": 1.0}]
    assert _formatted({"score": outputs["score"]}, row_form=False) == {"outputs": [0.5, 1.0]}
    with pytest.raises(ServingError, match="inconsistent batch size"):
        _formatted({"a": np.zeros(2), "b": np.zeros(3)}, row_form=True)
    assert _formatted({"a": np.zeros(2), "b": np.zeros(3)}, row_form=False)["outputs"] == {
        "a": [0.0, 0.0], "b": [0.0, 0.0, 0.0]}



def _tf_serving_decimal(value: np.float32) -> float:
    """The number of TF Serving's text for a float32 (`WriteDecimal`): `%g` when its decimal,
    rounded once to the nearest float32 (ties to even, as absl::SimpleAtof), is `value`,
    else `%.9g`. Rounded here exactly, with fractions."""
    if not np.isfinite(value):
        return float(value)
    text, exact = f"{value:.6g}", Fraction(f"{value:.6g}")
    neighbours = [np.nextafter(value, np.float32(side)) for side in (-np.inf, np.inf)]
    nearest = min([value] + [n for n in neighbours if np.isfinite(n)], key=lambda candidate: (
        abs(Fraction(float(candidate)) - exact), int(candidate.view(np.uint32)) & 1))
    return float(text) if nearest == value else float(f"{value:.9g}")


def test_float32_answers_are_the_numbers_tf_serving_writes():
    """TF Serving writes 0.1f as 0.1, which a client reads as the double 0.1; the float32's own
    double is 0.10000000149011612. Values by hand, then random bit patterns against an exact
    rounding. (That absl::StrCat's six digits are Python's `.6g`, and that reading them
    through a double rounds as absl::SimpleAtof does, was checked once for every float32
    against TF's own absl, in C++: see the closing note of session 18.)"""
    values = np.float32([0.1, 1 / 3, 1e6, 16777216, 3.4028235e38, 1e-45, -0.0, np.inf])
    answer = _formatted({"s": values}, row_form=False)["outputs"]
    assert answer == [0.1, 0.333333343, 1e6, 16777216.0, 3.40282347e38, 1.4013e-45, -0.0, np.inf]
    assert str(answer[-2]) == "-0.0" and np.isnan(_formatted(
        {"s": np.float32([np.nan])}, row_form=True)["predictions"][0])
    bits = np.random.default_rng(0).integers(0, 2**32, 4000, dtype=np.uint64)
    values = bits.astype(np.uint32).view(np.float32)
    values = values[np.isfinite(values)]
    answer = _formatted({"s": values.reshape(-1, 2)}, row_form=True)["predictions"]
    assert np.ravel(answer).tolist() == [_tf_serving_decimal(v) for v in values]


@pytest.mark.parametrize("piece", [1, 5, 1 << 16])
def test_json_responses_written_in_pieces_are_the_same(monkeypatch, piece):
    """Large answers are encoded a slice of rows at a time (the GIL is free in between)."""
    from tworec.serving import json_tensor
    monkeypatch.setattr(json_tensor, "_PIECE_ELEMENTS", piece)
    rng = np.random.default_rng(0)
    outputs = {"a": rng.normal(size=(7, 3, 2)), "n": np.arange(7),
               "s_bytes": np.array([b"\xff"] * 7, object), "t": np.array([[b"x", b"y"]] * 7)}
    columns = {name: value.tolist() if value.dtype != object else value
               for name, value in outputs.items()}
    columns["s_bytes"] = [{"b64": "/w=="}] * 7
    columns["t"] = [["x", "y"]] * 7
    assert _formatted(outputs, row_form=False) == {"outputs": columns}
    assert _formatted(outputs, row_form=True) == {"predictions": [
        {name: column[row] for name, column in columns.items()} for row in range(7)]}
    assert _formatted({"a": outputs["a"]}, row_form=True) == {"predictions": columns["a"]}
    assert _formatted({"a": np.array([np.nan, np.inf])}, row_form=False)["outputs"][1] == np.inf


def test_a_large_answer_is_written_a_piece_at_a_time(monkeypatch):
    """Encoding a piece holds the GIL; an answer of 2.4 million values is encoded at most
    `_PIECE_ELEMENTS` of them at a time, so the event loop runs in between, and reads back
    whole."""
    from tworec.serving import json_tensor
    encoded, dumps = [], json.dumps
    monkeypatch.setattr(json_tensor.json, "dumps", lambda value, *args, **kwargs: (
        encoded.append(np.size(value)) or dumps(value, *args, **kwargs)))
    outputs = {"y": np.random.default_rng(0).normal(size=(8, 300_000)),
               "n": np.arange(8 * 300_000).reshape(300_000, 8)}
    for row_form in (False, True):
        encoded.clear()
        data = json_tensor.format_predict(outputs if not row_form else
                                          {k: v.reshape(300_000, -1) for k, v in outputs.items()},
                                          row_form)
        assert 2 < len(encoded) and max(encoded) <= json_tensor._PIECE_ELEMENTS
        answer = json.loads(data)
        values = answer["outputs"]["n"] if not row_form else [row["n"] for row in
                                                               answer["predictions"]]
        assert np.array_equal(np.array(values).ravel(), outputs["n"].ravel())


@pytest.mark.parametrize("dtype, name", [(np.complex64, "complex64"), (np.float16, "half"),
                                         (np.uint16, "uint16")])
def test_outputs_json_cannot_carry_are_refused_as_tf_serving_refuses_them(dtype, name):
    for row_form in (False, True):
        with pytest.raises(ServingError) as error:
            _formatted({"c": np.ones(2, dtype), "y": np.ones(2)}, row_form)
        assert (error.value.code, error.value.message) == (
            "INVALID_ARGUMENT", f"Failed to write JSON value for tensor type: {name}")


# (model, body, HTTP status, message fragment) of each error class.
REST_ERRORS = {
    "malformed JSON": ("retrieval", b'{"instances": [', 400, None),
    "not an object": ("retrieval", b"[1, 2]", 400, None),
    "neither instances nor inputs": ("retrieval", {"signature_name": ""}, 400,
                                     "Missing 'inputs' or 'instances' key"),
    "wrong dtype": ("retrieval", {"inputs": {"user_id": [1, 2]}}, 400, None),
    "integer for a bool": ("scale", {"inputs": [True]}, 400, None),
    "ragged": ("ranking", {"inputs": {"user_id": ["u1", "u2"],
                                      "item_ids": [["i1", "i2"], ["i3"]]}}, 400, None),
    "missing input": ("ranking", {"inputs": {"user_id": ["u1"]}}, 400, None),
    "missing named input in a row": ("ranking", {"instances": [{"user_id": "u1"}]}, 400, None),
    "extra input": ("ranking", {"instances": [{"user_id": "u1", "item_ids": ["i1"],
                                               "more": 1}]}, 400, None),
    "unknown signature": ("retrieval", {"signature_name": "nope", "instances": ["u1"]}, 400,
                          'Serving signature name: "nope" not found in signature def'),
    "invalid UTF-8": ("retrieval", b'{"instances": ["\xff"]}', 400, None),
    "UTF-16": ("retrieval", '{"instances": ["u1"]}'.encode("utf-16"), 400, None),
    "an instance naming an input twice": (
        "ranking", b'{"instances": [{"user_id": "u1", "item_ids": ["i1"], "user_id": "u2"}]}',
        400, "An instance gives a key more than once"),
    "a b64 value with two keys": ("retrieval", b'{"instances": [{"b64": "dTE=", "b64": "dTI="}]}',
                                  400, None),
    "deeply nested": ("scale", b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
                      None),
    "empty instances": ("scale", {"instances": []}, 400, None),
    "bad base64": ("retrieval", {"instances": [{"b64": "%%%"}]}, 400, None),
    "number too large": ("scale", {"instances": [10**400]}, 400, None),
    "unknown model": ("nope", {"instances": ["u1"]}, 404,
                      "Servable not found for request: Latest(nope)"),
    "unknown version": ("retrieval/versions/99", {"instances": ["u1"]}, 404,
                        "Servable not found for request: Specific(retrieval, 99)"),
    "version beyond int64": ("retrieval/versions/9223372036854775808", {"instances": ["u1"]},
                             400, "Failed to convert version: 9223372036854775808 to numeric."),
    "version of 5000 digits": (f"retrieval/versions/{'9' * 5000}", {"instances": ["u1"]}, 400,
                               f"Failed to convert version: {'9' * 100}"),   # we cut the rest
    "number beyond a double": ("scale", b'{"inputs": [1e400]}', 400,
                               "Number too big to be stored in double"),
}


@pytest.mark.parametrize("case", sorted(REST_ERRORS))
def test_rest_errors_answer_with_tf_serving_codes(server, case):
    kind, rest, _ = server
    model, body, status, message = REST_ERRORS[case]
    answer = _predict(rest, model, body)
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    error = answer.json()["error"]
    assert message is None or message in error
    if kind == "embedded" and case == "wrong dtype":
        assert 'Input "user_id"' in error and "string" in error
    _assert_answers(rest)


def test_rest_status_errors(server):
    kind, rest, _ = server
    unknown = requests.get(f"{rest}/v1/models/nope", timeout=10)
    assert unknown.status_code == 404
    assert "Could not find any versions of model nope" in unknown.json()["error"]
    assert requests.get(f"{rest}/v1/models/scale/versions/7", timeout=10).status_code == 404
    for version in ("9223372036854775808", "1" * 5000):
        answer = requests.get(f"{rest}/v1/models/scale/versions/{version}", timeout=10)
        echoed = echo(version) if kind == "embedded" else version      # TF Serving: whole
        assert (answer.status_code, answer.json()) == (
            400, {"error": f"Failed to convert version: {echoed} to numeric."})
    largest = requests.get(f"{rest}/v1/models/scale/versions/9223372036854775807", timeout=10)
    assert largest.status_code == 404
    _assert_answers(rest)


def test_rest_floats_take_any_json_number_within_a_double(server):
    """As TF Serving's parser since 2.5 (its commit 57dac6cd): any number within a double is
    taken and rounded to float32, an integer of more than 24 bits (1435774380, the commit's
    own example) losing its last digits, 3.5e38 becoming infinite; NaN and Infinity parse;
    1e400 does not (REST_ERRORS)."""
    _, rest, _ = server
    answer = _predict(rest, "scale", b'{"inputs": [0.1, 1e-400, 123456789012345678901234, '
                                     b'NaN, -Infinity, 16777215, 1435774380, 16777217, '
                                     b'3.5e38, 9007199791611905]}')
    values = answer.json()["outputs"]
    assert values[:3] == pytest.approx(
        (np.array([0.1, 0.0, 123456789012345678901234], np.float32) * 3).tolist())
    assert np.isnan(values[3]) and values[4] == -np.inf
    three = np.float32(3)
    assert values[5:8] == [float(np.float32(n) * three) for n in (16777215, 1435774336, 16777216)]
    assert values[8] == np.inf
    # through a double, as RapidJSON's GetFloat: 2**53 + 2**29 + 1 is 2**53 + 2**29 as a
    # double, halfway between two float32s, so 2**53 (straight to float32: 2**53 + 2**30)
    assert np.float32(values[9]) == np.float32(2.0 ** 53) * three


def test_rest_paths_are_case_insensitive_and_malformed_paths_refused(server):
    """TF Serving matches a path in any case, then compares the verb and "metadata" as
    written (`http_rest_api_handler.cc`): ":PREDICT" is malformed, "/METADATA" is the status;
    a query string is part of the path it matches."""
    kind, rest, _ = server
    answer = requests.post(f"{rest}/V1/MODELS/scale:predict", json={"inputs": [1.0]}, timeout=10)
    assert answer.json() == {"outputs": [3.0]}
    shouted = requests.post(f"{rest}/v1/models/scale:PREDICT", json={"inputs": [1.0]},
                            timeout=10)
    assert shouted.status_code == 400
    assert shouted.json()["error"].startswith("Malformed request: POST /v1/models/scale:PREDICT")
    status = requests.get(f"{rest}/v1/models/scale", timeout=10).json()
    assert requests.get(f"{rest}/v1/models/scale/METADATA", timeout=10).json() == status
    queried = requests.post(f"{rest}/v1/models/scale:predict?x=1", json={"inputs": [1.0]},
                            timeout=10)
    assert queried.status_code == 400 and "Malformed request" in queried.json()["error"]
    unknown = requests.get(f"{rest}/v1/models/scale?x=1", timeout=10)
    assert unknown.status_code == 404 and "scale?x=1" in unknown.json()["error"]
    if kind == "embedded":
        bad = requests.get(f"{rest}/v1/models/scale:predict", timeout=10)
        assert bad.status_code == 400 and "Malformed request: GET" in bad.json()["error"]
        missing = requests.get(f"{rest}/v1/models", timeout=10)
        assert missing.json() == {"error": "Missing model name in request."}
    _assert_answers(rest)


def test_rest_timeout_answers_deadline_exceeded(model_dir):
    manager = ModelManager([ModelConfig("scale", os.path.join(model_dir, "scale"))],
                           poll_seconds=0)
    with ModelServer(manager, grpc_port=None, rest_port=0, rest_timeout_seconds=1e-9) as server:
        answer = _predict(f"http://127.0.0.1:{server.rest_port}", "scale", {"inputs": [1.0]})
    assert answer.status_code == 504 and "--rest_api_timeout_in_ms" in answer.json()["error"]


def test_rest_oversized_body_is_refused(server):
    kind, rest, _ = server
    if kind != "embedded":
        pytest.skip("the request size limit is the embedded server's flag")
    body = json.dumps({"inputs": [1.0] * (MAX_REQUEST_BYTES // 4)})
    answer = _predict(rest, "scale", body)
    assert answer.status_code == 413 and "--max_request_bytes" in answer.json()["error"]

    def chunks():                         # no Content-Length: the streamed read is capped
        for _ in range(MAX_REQUEST_BYTES // 1024 + 2):
            yield b" " * 1024
    streamed = requests.post(f"{rest}/v1/models/scale:predict", data=chunks(), timeout=10)
    assert streamed.status_code == 413
    _assert_answers(rest)


# ------------------------------------------------------------------ gRPC conformance


def _spec(message, name: str, version: int | None = None, signature: str = ""):
    message.model_spec.name = name
    message.model_spec.signature_name = signature
    if version is not None:
        message.model_spec.version.value = version
    return message


def _predict_request(name: str, inputs: dict, version: int | None = None, signature: str = "",
                     output_filter=()) -> predict_pb2.PredictRequest:
    request = _spec(predict_pb2.PredictRequest(output_filter=list(output_filter)), name,
                    version, signature)
    for key, value in inputs.items():
        request.inputs[key].CopyFrom(tf.make_tensor_proto(value))
    return request


def test_grpc_status_and_metadata(stubs):
    prediction, models = stubs
    status = models.GetModelStatus(_spec(get_model_status_pb2.GetModelStatusRequest(),
                                         "retrieval"), timeout=10)
    (version,) = status.model_version_status
    assert version.version == 1 and version.state == version.AVAILABLE
    assert version.status.error_code == 0
    labelled = get_model_status_pb2.GetModelStatusRequest()
    labelled.model_spec.name, labelled.model_spec.version_label = "retrieval", "no-such-label"
    assert models.GetModelStatus(labelled, timeout=10) == status   # TF Serving reads no label
    with pytest.raises(grpc.RpcError) as error:
        models.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(), timeout=10)
    assert (error.value.code(), error.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                           "Missing ModelSpec")
    metadata = prediction.GetModelMetadata(_spec(get_model_metadata_pb2.GetModelMetadataRequest(
        metadata_field=["signature_def"]), "ranking"), timeout=10)
    assert metadata.model_spec.name == "ranking" and metadata.model_spec.version.value == 1
    signatures = get_model_metadata_pb2.SignatureDefMap()
    assert metadata.metadata["signature_def"].Unpack(signatures)
    assert set(signatures.signature_def["serving_default"].inputs) == {"user_id", "item_ids"}


def test_grpc_predict_and_output_filter(stubs, local):
    prediction, _ = stubs
    users = np.array([b"u2", b"u5"], dtype=object)
    response = prediction.Predict(_predict_request("retrieval", {"user_id": users}), timeout=10)
    assert response.model_spec.version.value == 1
    expected = local["retrieval"].run({"user_id": users})
    assert np.array_equal(tf.make_ndarray(response.outputs["item_ids"]), expected["item_ids"])
    filtered = prediction.Predict(_predict_request("retrieval", {"user_id": users},
                                                   output_filter=["scores"]), timeout=10)
    assert list(filtered.outputs) == ["scores"]


def test_grpc_answers_carry_their_values_in_the_typed_fields(stubs):
    """TF Serving writes an answer with `Tensor::AsProtoField`: a client reading
    `outputs["y"].float_val`, as the tutorials do, found nothing for two rows or more when
    the values came in `tensor_content`."""
    prediction, _ = stubs
    response = prediction.Predict(_predict_request(
        "scale", {"x": np.array([1.0, 2.0], np.float32)}), timeout=10)
    assert list(response.outputs["y"].float_val) == [3.0, 6.0]
    assert not response.outputs["y"].tensor_content
    users = np.array([b"u2", b"u5"], dtype=object)
    answer = prediction.Predict(_predict_request("retrieval", {"user_id": users}), timeout=10)
    scores = answer.outputs["scores"]
    assert len(scores.float_val) == 2 * scores.tensor_shape.dim[1].size > 2
    assert len(answer.outputs["item_ids"].string_val) == len(scores.float_val)


def test_to_proto_fills_the_field_of_every_dtype_and_reads_back():
    from tworec.serving.tensor_proto import to_proto
    for value in (np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1.5, -2.0]),
                  np.array([1, -2], np.int8), np.array([7, 2**40], np.int64),
                  np.array([True, False]), np.array([1.5, 2.25], np.float16),
                  np.array([1 + 2j, 3 - 4j], np.complex64), np.array([3, 2**32 - 1], np.uint32),
                  np.array([b"a", b"bc"], dtype=object)):
        proto = to_proto(value)
        assert not proto.tensor_content, value.dtype
        np.testing.assert_array_equal(tf.make_ndarray(proto), value)


def test_grpc_requests_without_a_model_spec_are_invalid(stubs):
    prediction, _ = stubs
    for call, request in ((prediction.Predict, predict_pb2.PredictRequest()),
                          (prediction.GetModelMetadata,
                           get_model_metadata_pb2.GetModelMetadataRequest(
                               metadata_field=["signature_def"])),
                          (prediction.GetModelMetadata,           # checked before the fields
                           get_model_metadata_pb2.GetModelMetadataRequest())):
        with pytest.raises(grpc.RpcError) as error:
            call(request, timeout=10)
        assert (error.value.code(), error.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT, "Missing ModelSpec")


GRPC_ERRORS = {
    "wrong dtype": (_predict_request, ("retrieval", {"user_id": np.array([1.0], np.float32)}),
                    grpc.StatusCode.INVALID_ARGUMENT, None),
    "missing input": (_predict_request, ("ranking", {"user_id": np.array([b"u1"])}),
                      grpc.StatusCode.INVALID_ARGUMENT, None),
    "extra input": (_predict_request, ("scale", {"x": np.array([1.0], np.float32),
                                                 "z": np.array([1.0], np.float32)}),
                    grpc.StatusCode.INVALID_ARGUMENT, None),
    "unknown output in the filter": (
        lambda *a: _predict_request(*a, output_filter=["nope"]),
        ("scale", {"x": np.array([1.0], np.float32)}), grpc.StatusCode.INVALID_ARGUMENT, None),
    "repeated output in the filter": (
        lambda *a: _predict_request(*a, output_filter=["y", "y"]),
        ("scale", {"x": np.array([1.0], np.float32)}), grpc.StatusCode.INVALID_ARGUMENT, None),
    "unknown signature": (lambda *a: _predict_request(*a, signature="nope"),
                          ("scale", {"x": np.array([1.0], np.float32)}),
                          grpc.StatusCode.FAILED_PRECONDITION,
                          'Serving signature key "nope" not found.'),
    "unknown model": (_predict_request, ("nope", {"x": np.array([1.0], np.float32)}),
                      grpc.StatusCode.NOT_FOUND, "Servable not found for request: Latest(nope)"),
    "unknown version": (_predict_request, ("scale", {"x": np.array([1.0], np.float32)}, 9),
                        grpc.StatusCode.NOT_FOUND,
                        "Servable not found for request: Specific(scale, 9)"),
}


@pytest.mark.parametrize("case", sorted(GRPC_ERRORS))
def test_grpc_errors_have_tf_codes(server, stubs, case):
    prediction, _ = stubs
    build, args, code, message = GRPC_ERRORS[case]
    with pytest.raises(grpc.RpcError) as error:
        prediction.Predict(build(*args), timeout=10)
    assert error.value.code() == code, error.value.details()
    assert message is None or message in error.value.details()
    _assert_answers(server[1])


def test_grpc_long_messages_are_truncated(server, stubs):
    prediction, _ = stubs
    request = _predict_request("scale", {"x": np.array([1.0], np.float32),
                                         "z" * 2000: np.array([1.0], np.float32)})
    with pytest.raises(grpc.RpcError) as error:
        prediction.Predict(request, timeout=10)
    assert len(error.value.details()) == 1024 + len("...TRUNCATED")
    assert error.value.details().endswith("...TRUNCATED")
    assert truncate("short") == "short"


def test_grpc_unimplemented_and_oversized(server, stubs):
    kind, rest, _ = server
    if kind != "embedded":
        pytest.skip("the embedded server's own limits")
    prediction, _ = stubs
    with pytest.raises(grpc.RpcError) as error:
        prediction.Classify(_spec(classification_pb2.ClassificationRequest(), "scale"),
                            timeout=10)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as error:             # the model is looked up first
        prediction.Regress(_spec(regression_pb2.RegressionRequest(), "nope"), timeout=10)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    examples = {"examples": [{"x": [1.0]}]}
    assert requests.post(f"{rest}/v1/models/nope:classify", json=examples,
                         timeout=10).status_code == 404
    assert requests.post(f"{rest}/v1/models/scale:classify", json=examples,
                         timeout=10).status_code == 501
    assert requests.post(f"{rest}/v1/models/nope:classify", data=b"{",
                         timeout=10).status_code == 400
    big = np.zeros(MAX_REQUEST_BYTES // 4 + 10, np.float32)
    with pytest.raises(grpc.RpcError) as error:
        prediction.Predict(_predict_request("scale", {"x": big}), timeout=10)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _assert_answers(rest)


# ------------------------------------------------------------------ client and recommender


@pytest.fixture(scope="module", params=["rest", "grpc"])
def client(request, server):
    _, rest, target = server
    with (Client(url=rest) if request.param == "rest" else Client(grpc_target=target)) as client:
        yield client


def test_client_predict_status_metadata(client, local):
    users = np.array([b"u1", b"u4"], dtype=object)
    outputs = client.predict("retrieval", {"user_id": users})
    expected = local["retrieval"].run({"user_id": users})
    assert np.array_equal(outputs["item_ids"], expected["item_ids"])
    assert outputs["scores"].dtype == np.float32
    np.testing.assert_allclose(outputs["scores"], expected["scores"], rtol=1e-6)
    assert client.predict("scale", {"x": np.array([2.0], np.float32)}, version=1)["y"] == [6.0]
    for version in (1, None):         # the one asked for, or the latest (REST looks it up,
        assert client.predict_version("scale", {"x": np.array([2.0], np.float32)},  # gRPC's
                                      version=version)[1] == 1                  # answer says)
    assert client.status("scale").model_version_status[0].version == 1
    assert "serving_default" in client.metadata("scale", version=1).signature_def
    with pytest.raises(ServingError) as error:
        client.predict("nope", {"x": np.array([1.0], np.float32)})
    assert error.value.code == "NOT_FOUND"


def test_an_empty_batch_is_answered_in_the_signatures_rank(client, local):
    """JSON's `[]` keeps no inner sizes: the REST client restores the signature's rank, so both
    transports (and the Recommender over them) answer an empty batch alike."""
    users = np.array([], dtype=object)
    expected = local["retrieval"].run({"user_id": users})
    outputs = client.predict("retrieval", {"user_id": users})
    assert {name: value.shape for name, value in outputs.items()} == \
        {name: value.shape for name, value in expected.items()}
    assert outputs["scores"].dtype == np.float32 and expected["scores"].shape[0] == 0
    answer = Recommender(client).recommend([], n=3)
    assert answer["item_ids"].shape == answer["scores"].shape == (0, 3)


def test_client_splits_requests_over_its_row_limit(server, local):
    users = np.array([f"u{i % 6}".encode() for i in range(7)], dtype=object)
    expected = local["retrieval"].run({"user_id": users})
    for transport in ({"url": server[1]}, {"grpc_target": server[2]}):
        with Client(**transport, max_rows_per_request=3) as client:
            outputs = client.predict("retrieval", {"user_id": users})
        assert np.array_equal(outputs["item_ids"], expected["item_ids"])


def test_client_retries_unavailable_then_fails(unused_port):
    rest = (f"GET http://127.0.0.1:{unused_port}/v1/models/scale: cannot connect ([Errno 111] "
            "Connection refused)")                    # urllib3's nested exception text, read
    for client, message in ((Client(url=f"http://127.0.0.1:{unused_port}", retries=2,
                                    backoff=0.01), rest),
                            (Client(grpc_target=f"127.0.0.1:{unused_port}", retries=2,
                                    backoff=0.01, timeout=2), None)):
        with client, pytest.raises(ServingError) as error:
            client.status("scale")
        assert error.value.code == "UNAVAILABLE"
        assert message is None or error.value.message == message


def test_recommend_says_how_to_start_a_server_when_none_answers(unused_port, capsys):
    recommend = _script("recommend")
    assert recommend.main(["--user", "u1", "--grpc", f"127.0.0.1:{unused_port}"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: UNAVAILABLE: ") and len(error.splitlines()) == 1
    assert error.rstrip().endswith("; is a server running there? start one with python "
                                   "scripts/serve.py --model_config_file "
                                   "RUN/export/models_scann.config"), error


def test_recommend_says_what_would_serve_a_ranking_model_the_server_lacks(embedded, capsys):
    """A run of retrieval alone serves no ranking model: the NOT_FOUND line says how to train
    one, or to write retrieval's lists instead."""
    recommend = _script("recommend")
    assert recommend.main(["--user", "u1", "--url", embedded[0], "--ranking_model",
                           "reranker"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: NOT_FOUND: ") and len(error.splitlines()) == 1, error
    assert error.rstrip().endswith(
        "; the server serves no 'reranker' model (a run of retrieval alone?): train its ranking "
        "with python scripts/train_ranking.py --retrieval-run RUN, or write retrieval's lists "
        "with --all --export RUN/export/retrieval --out recs.parquet"), error


@pytest.fixture
def unused_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_retrieval_model_named_as_the_ranking_model_is_refused(client):
    """Over REST the retrieval model leaves item_ids unread and answers its own list; over
    gRPC the server refuses the input. Neither passes for a ranked list."""
    with pytest.raises((ValueError, ServingError)) as refused:
        Recommender(client, ranking_model="retrieval").recommend(["u1"], n=3)
    if isinstance(refused.value, ValueError):
        assert str(refused.value) == (
            "model 'retrieval' answers item_ids and takes none, as a retrieval model does: it "
            "scored no candidate (REST leaves an input a signature lacks unread); name the "
            "ranking model")
    else:
        assert refused.value.code == "INVALID_ARGUMENT"


def test_client_inputs_are_read_alike_over_both_transports(client, local):
    """Text as str, bytes, a unicode array or a list gives one answer; ints among ids and a
    lone surrogate are refused in the client, the same on REST and gRPC."""
    expected = local["retrieval"].run({"user_id": np.array([b"u1", b"u4"], object)})
    for users in (["u1", "u4"], np.array(["u1", "u4"]), np.array([b"u1", "u4"], object),
                  [b"u1", "u4"], ("u1", b"u4"), [np.array("u1"), np.array("u4")]):
        answer = client.predict("retrieval", {"user_id": users})
        assert answer["item_ids"].tolist() == expected["item_ids"].tolist(), users
    for users, message in ((np.array(["u1", 4], object), "a int (4) among text"),
                           (["u1", 4], "a int (4) among text"),
                           (["u1", "\ud800"], "'\\ud800' is not valid Unicode text")):
        with pytest.raises(ValueError, match=re.escape(f"input 'user_id': {message}")):
            client.predict("retrieval", {"user_id": users})


def test_recommender_drops_seen_items(client, local):
    recommender = Recommender(client)
    candidates = local["retrieval"].run({"user_id": np.array(["u1"])})["item_ids"][0]
    seen = [list(candidates[:2]) + [b"not-a-candidate"]]
    result = recommender.recommend(["u1"], n=3, seen=seen)
    assert result["item_ids"].shape == (1, 3)
    assert not set(result["item_ids"][0]) & set(seen[0])
    everything = recommender.recommend(["u1"], n=3, seen=[list(candidates)])
    assert list(everything["item_ids"][0]) == [PAD_ID] * 3
    for n in (0, -1, 2.5):
        with pytest.raises(ValueError, match=f"n must be a whole number of at least 1, got "
                                             f"{re.escape(repr(n))}"):
            recommender.recommend(["u1"], n=n)
    with pytest.raises(ValueError, match=r"seen holds one list of item ids per user"):
        recommender.recommend(["u1"], n=3, seen=["i1"])           # ids alone: one per user?


def test_recommender_says_which_users_the_retrieval_model_knows(client):
    recommender = Recommender(client)
    assert recommender.known_users(["u1", "stranger", "u5"]).tolist() == [True, False, True]
    assert Recommender(client, retrieval_model="scale").known_users(["u1"]) is None  # no such
    with pytest.raises(ServingError, match="Servable not found"):           # signature there
        Recommender(client, retrieval_model="missing").known_users(["u1"])


def test_recommend_prints_the_list_when_asking_which_users_are_known_fails(embedded, capsys,
                                                                         monkeypatch):
    """Whether the models know the user is for a note: a failure there leaves the list."""
    recommend = _script("recommend")

    def unavailable(self, user_ids):
        raise ServingError("UNAVAILABLE", "the server went away")
    monkeypatch.setattr(Recommender, "known_users", unavailable)
    assert recommend.main(["--user", "stranger", "--url", embedded[0], "--n", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_composed_recommender_equals_recommender(client, model_dir, tmp_path):
    base = str(tmp_path / "recommender")
    path = write_version(base, lambda out: compose_recommender(
        os.path.join(model_dir, "retrieval", "1"), os.path.join(model_dir, "ranking", "1"), out,
        top_n=4, warmup_user_ids=["u0"]))
    composed = LoadedModel(path)           # in a session, as TF Serving loads it
    users = np.array(list(USERS) + ["stranger"], dtype=object)
    served = composed.run({"user_id": users})
    expected = Recommender(client).recommend(users, n=4)
    assert np.array_equal(served["item_ids"], expected["item_ids"])
    np.testing.assert_allclose(served["scores"], expected["scores"], rtol=1e-6)
    assert composed.run({"user_id": users}, signature_name="known_users")["known"].tolist() \
        == Recommender(client).known_users(users).tolist() == [True] * len(USERS) + [False]
    composed.close()


class ToyRankingWithCandidates(ToyRanking):
    """A ToyRanking whose `candidates` signature appends, to each user's list, the two items
    after the last one given ("" past the catalogue), as tworec's title candidates come after
    retrieval's."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id"),
                                  tf.TensorSpec([None, None], tf.string, name="item_ids")])
    def candidates(self, user_id, item_ids):
        last = self.items.lookup(item_ids[:, -1:])                                   # [b, 1]
        added = tf.gather(tf.constant(list(ITEMS) + ["", ""]), last + [[1, 2]])      # [b, 2]
        return {"item_ids": tf.concat([item_ids, added], axis=1)}


class InProcess:
    """A `Client` stand-in over in-process sessions (`LoadedModel`s by served name)."""

    def __init__(self, models: dict):
        self.models = models

    def predict(self, model, inputs, signature_name="", version=None):
        return self.models[model].run(inputs, signature_name=signature_name)

    def predict_version(self, model, inputs, signature_name="", version=None):
        return self.predict(model, inputs, signature_name), None


class SwappedAfterCandidates:
    """A `Client` stand-in whose ranking model's version 2 arrives right after version 1 has
    answered a `candidates` request (retiring version 1 when `retire`). Version v adds the
    item f"v{v}" and scores a list's slots v, 2v, 3v, ... from the last."""

    def __init__(self, retire: bool):
        self.retire, self.latest, self.asked = retire, 1, []

    def predict(self, model, inputs, signature_name="serving_default", version=None):
        return self.predict_version(model, inputs, signature_name, version)[0]

    def predict_version(self, model, inputs, signature_name="serving_default", version=None):
        self.asked.append((model, signature_name, version))
        users = np.asarray(inputs["user_id"])
        if model == "retrieval":
            return {"item_ids": np.array([[b"a", b"b"]] * len(users), dtype=object)}, 7
        number = self.latest if version is None else version
        if number == 1 and self.latest == 2 and self.retire:
            raise ServingError("NOT_FOUND", "Servable not found for request: Specific(ranking, 1)")
        items = np.asarray(inputs["item_ids"])
        if signature_name == "candidates":
            self.latest = 2
            added = np.full((len(users), 1), f"v{number}".encode(), dtype=object)
            return {"item_ids": np.concatenate([items, added], axis=1)}, number
        width = items.shape[1]
        return {"scores": np.tile(number * np.arange(width, 0, -1, dtype=np.float32),
                                  (len(users), 1))}, number


@pytest.mark.parametrize("retire", [False, True])
def test_recommender_scores_with_the_version_that_added_the_candidates(retire):
    """A hot swap between the `candidates` and the scoring request never joins two versions'
    answers: the scores come from the version that added the candidates, and when that version
    is retired meanwhile the pair starts over on the new one."""
    client = SwappedAfterCandidates(retire)
    answer = Recommender(client).recommend(["u1", "u2"], n=3)
    version = 2 if retire else 1
    assert answer["item_ids"].tolist() == [[b"a", b"b", f"v{version}".encode()]] * 2
    assert answer["scores"].tolist() == [[3.0 * version, 2.0 * version, version]] * 2
    assert client.asked[-2:] == [("ranking", "candidates", None),
                                 ("ranking", "serving_default", version)]
    # Over a real Client whose requests go a row at a time: the swap now comes between the
    # parts of the candidates request (its second part asks version 1 again).
    transport = SwappedAfterCandidates(retire)
    client = Client(url="http://127.0.0.1:1", max_rows_per_request=1)
    client.transport = types.SimpleNamespace(predict=transport.predict_version)
    assert {name: value.tolist() for name, value in Recommender(client).recommend(
        ["u1", "u2"], n=3).items()} == {name: value.tolist() for name, value in answer.items()}
    candidates = [asked for asked in transport.asked if asked[1] == "candidates"]
    assert candidates == [("ranking", "candidates", None), ("ranking", "candidates", 1)] + \
        ([("ranking", "candidates", None), ("ranking", "candidates", 2)] if retire else [])


def test_recommender_and_composed_model_rank_the_ranking_models_added_candidates(model_dir,
                                                                             local, tmp_path):
    """With a ranking model that has a `candidates` signature, both the Recommender and the
    composed SavedModel rank retrieval's list plus the items it adds (by loop here); without
    one (the toy ranking) retrieval's list alone."""
    module = ToyRankingWithCandidates()
    ranking_dir = write_version(str(tmp_path / "ranking"), lambda path: tf.saved_model.save(
        module, path, signatures={"serving_default": module.serve,
                                  "candidates": module.candidates}))
    ranking = LoadedModel(ranking_dir)
    users = np.array(list(USERS) + ["stranger"], dtype=object)
    retrieved = local["retrieval"].run({"user_id": users})["item_ids"]               # [b, 6]
    position = {item.encode(): i for i, item in enumerate(ITEMS)}
    added = [[ITEMS[position[row[-1]] + step].encode() if position[row[-1]] + step < len(ITEMS)
              else b"" for step in (1, 2)] for row in retrieved]
    candidates = np.concatenate([retrieved, np.array(added, dtype=object)], axis=1)  # [b, 8]
    scores = ranking.run({"user_id": users, "item_ids": candidates})["scores"]
    order = np.argsort(-scores, axis=1, kind="stable")[:, :4]
    expected = np.take_along_axis(candidates, order, 1)
    assert (np.isin(expected, candidates[:, 6:]) & (expected != b"")).any()   # added ones rank
    answer = Recommender(InProcess({"retrieval": local["retrieval"], "ranking": ranking})
                         ).recommend(users, n=4)
    assert np.array_equal(answer["item_ids"], expected)
    composed = LoadedModel(write_version(str(tmp_path / "recommender"), lambda out:
                                         compose_recommender(os.path.join(model_dir, "retrieval",
                                                                          "1"), ranking_dir,
                                                             out, top_n=4)))
    assert np.array_equal(composed.run({"user_id": users})["item_ids"], expected)
    plain = Recommender(InProcess(local)).recommend(users, n=4)["item_ids"]
    assert np.isin(plain, retrieved).all()
    for model in (ranking, composed):
        model.close()


# ------------------------------------------------------------------ hot swap


def test_a_base_path_not_there_is_logged_once_not_at_every_poll(tmp_path, caplog):
    """A mistyped base path: one error line, then quiet while it stays so; logged again once
    it fails after a listing that worked. Polled by hand: no timing."""
    base = str(tmp_path / "scael")
    manager = ModelManager([ModelConfig("scale", base)], poll_seconds=0)

    def poll_once():
        manager.poll()
        manager._models["scale"].poll.result(timeout=30)
    with caplog.at_level(logging.ERROR, logger="tworec.serving.manager"):
        manager.start()
        for _ in range(5):
            poll_once()
        os.makedirs(base)
        poll_once()
        os.rmdir(base)
        for _ in range(3):
            poll_once()
        manager.stop()
    failures = [r.getMessage() for r in caplog.records if "listing the versions" in r.message]
    assert failures == [f"listing the versions of model scale failed: the base path {base} "
                        "is not there"] * 2


@pytest.fixture
def swap_server(tmp_path):
    base = str(tmp_path / "scale")
    save(Scale(1.0), base)
    manager = ModelManager([ModelConfig("scale", base)], poll_seconds=0.05)
    with ModelServer(manager, grpc_port=0, rest_port=0) as server:
        yield base, server


def _hammer(client: Client, stop: threading.Event, factors: list, failures: list) -> None:
    """Predicts in a loop, recording the factor each answer shows and every failure."""
    while not stop.is_set():
        try:
            factors.append(float(client.predict("scale", {"x": np.ones(1, np.float32)})["y"][0]))
        except Exception as error:  # every failure counts
            failures.append(repr(error))


@contextlib.contextmanager
def hammering(server):
    """A REST and a gRPC client predicting in a loop until the block ends; yields the clients,
    the factor lists their answers show and the list of failures."""
    clients = [Client(url=f"http://127.0.0.1:{server.rest_port}", retries=0),
               Client(grpc_target=f"127.0.0.1:{server.grpc_port}", retries=0)]
    stop, failures = threading.Event(), []
    factors = [[] for _ in clients]
    threads = [threading.Thread(target=_hammer, args=(c, stop, f, failures))
               for c, f in zip(clients, factors)]
    for thread in threads:
        thread.start()
    try:
        yield clients, factors, failures
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        for client in clients:
            client.close()


def _wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def test_hot_swap_drops_no_request_and_a_corrupt_version_keeps_the_last_good(swap_server):
    base, server = swap_server
    with hammering(server) as (clients, factors, failures):
        _wait_for(lambda: all(factors))
        save(Scale(2.0), base)
        _wait_for(lambda: all(f[-1] == 2.0 for f in factors))
        status = {s.version: s for s in server.manager.status("scale").model_version_status}
        assert status[2].state == status[2].AVAILABLE
        _wait_for(lambda: server.manager.status("scale", 1).model_version_status[0].state
                  == get_model_status_pb2.ModelVersionStatus.END)

        write_version(base, lambda path: open(os.path.join(path, "saved_model.pb"), "w").write(
            "not a SavedModel"))
        _wait_for(lambda: 3 in {s.version for s in
                                server.manager.status("scale").model_version_status})
        count = sum(map(len, factors))
        _wait_for(lambda: sum(map(len, factors)) > count + 20)
        broken = clients[0].status("scale", version=3).model_version_status[0]
    assert failures == []
    assert all(f[-1] == 2.0 and set(f) <= {1.0, 2.0} for f in factors)
    assert broken.state == broken.END and broken.status.error_code != 0
    assert "3" in broken.status.error_message


@pytest.mark.parametrize("failures, retries, state", [(2, 2, "AVAILABLE"), (2, 1, "END")])
def test_a_failed_load_is_retried_before_the_version_is_given_up(tmp_path, failures, retries,
                                                                 state):
    """A version folder still being copied fails its first loads, as with TF Serving's
    --max_num_load_retries; the version stays LOADING until it loads or runs out of retries."""
    base = str(tmp_path / "scale")
    save(Scale(3.0), base)
    attempts, states_while_retrying = [], []

    def flaky_load(path: str) -> LoadedModel:
        attempts.append(time.monotonic())
        if len(attempts) > 1:
            states_while_retrying.append(manager.status("scale", 1).model_version_status[0].state)
        if len(attempts) <= failures:
            raise OSError(f"{path}: saved_model.pb is still being written")
        return LoadedModel(path)

    manager = ModelManager([ModelConfig("scale", base)], poll_seconds=0, load=flaky_load,
                           max_load_retries=retries, load_retry_seconds=0.05)
    manager.start()
    try:
        status = manager.status("scale", 1).model_version_status[0]
        assert len(attempts) == min(failures, retries) + 1
        assert all(b - a >= 0.05 for a, b in zip(attempts, attempts[1:]))
        assert states_while_retrying == [get_model_status_pb2.ModelVersionStatus.LOADING] * retries
        assert get_model_status_pb2.ModelVersionStatus.State.Name(status.state) == state
        if state == "END":
            assert "still being written" in status.status.error_message
        else:
            with manager.lease("scale") as (version, model):
                assert version == 1
    finally:
        manager.stop()


def test_a_broken_version_no_longer_wanted_stops_retrying_and_the_next_one_loads(tmp_path):
    """A corrupt version 2 is retried (60 s apart, as TF Serving's default) until its folder is
    removed and a version 3 written: its retries stop, as TF Serving cancels those of a version
    that leaves its aspired set, and version 3 loads within a poll or two (not minutes later)."""
    base = str(tmp_path / "scale")
    save(Scale(3.0), base)
    manager = ModelManager([ModelConfig("scale", base)], poll_seconds=0.2, max_load_retries=5,
                           load_retry_seconds=60)
    manager.start()
    try:
        os.makedirs(os.path.join(base, "2"))
        with open(os.path.join(base, "2", "saved_model.pb"), "w") as f:
            f.write("garbage")
        _wait_for(lambda: _states(manager, "scale") == {2: "LOADING", 1: "AVAILABLE"})
        time.sleep(0.5)                                                # retrying, 60 s apart
        shutil.rmtree(os.path.join(base, "2"))
        staging = str(tmp_path / "staging")           # written whole, then renamed into place
        shutil.copytree(os.path.join(base, "1"), staging)  # (as exports are): a poll never
        os.rename(staging, os.path.join(base, "3"))        # sees a half-copied version 3
        start = time.monotonic()
        _wait_for(lambda: _states(manager, "scale").get(3) == "AVAILABLE", seconds=20)
        assert time.monotonic() - start < 10
        with manager.lease("scale") as (version, _):
            assert version == 3
    finally:
        manager.stop()


class _Loaded:
    """What a fake loader returns: a servable nothing is asked of."""

    def close(self) -> None:
        pass


def _fake_manager(base: str, broken, retries: int, retry_seconds: float,
                  attempts: dict | None = None) -> ModelManager:
    """A manager of model "m" at `base` whose version folders load unless `broken(version,
    attempt)`, counting each version's attempts in `attempts`; no TensorFlow runs."""
    attempts = {} if attempts is None else attempts

    def load(path: str) -> _Loaded:
        version = int(os.path.basename(path))
        attempts[version] = attempts.get(version, 0) + 1
        if broken(version, attempts[version]):
            raise OSError(f"version {version} is broken")
        return _Loaded()
    return ModelManager([ModelConfig("m", base)], poll_seconds=0.1, load=load,
                        max_load_retries=retries, load_retry_seconds=retry_seconds)


def _states(manager: ModelManager, name: str = "m") -> dict[int, str]:
    try:
        versions = manager.status(name).model_version_status
    except ServingError:                                        # none listed yet
        return {}
    return {s.version: get_model_status_pb2.ModelVersionStatus.State.Name(s.state)
            for s in versions}


def test_the_version_a_failed_one_falls_back_to_keeps_its_own_retries(tmp_path):
    """Versions 1 to 3; 3 and 2 never load. 2, the poll's choice once 3 has failed, gets its
    retries and fails in turn (not cancelled as unwanted because 3 is still on disk, which
    would retry it at every poll, never giving it up), then 1 serves."""
    for version in (1, 2, 3):
        os.makedirs(tmp_path / str(version))
    attempts: dict[int, int] = {}
    manager = _fake_manager(str(tmp_path), lambda v, attempt: v > 1, retries=1,
                            retry_seconds=0.3, attempts=attempts)
    manager.start(wait=False)
    try:
        _wait_for(lambda: _states(manager).get(1) == "AVAILABLE", seconds=20)
        assert _states(manager) == {1: "AVAILABLE", 2: "END", 3: "END"}
        assert attempts == {3: 2, 2: 2, 1: 1}
    finally:
        manager.stop()


def test_a_version_whose_retries_were_cancelled_loads_once_it_is_wanted_again(tmp_path):
    """Broken version 2 is removed while it waits to retry (cancelled), then written again, good:
    it loads, as TF Serving loads a version that is aspired again."""
    os.makedirs(tmp_path / "1")
    good = {1}
    manager = _fake_manager(str(tmp_path), lambda v, attempt: v not in good, retries=3,
                            retry_seconds=30)
    manager.start(wait=False)
    try:
        _wait_for(lambda: _states(manager).get(1) == "AVAILABLE")
        os.makedirs(tmp_path / "2")
        _wait_for(lambda: _states(manager).get(2) == "LOADING")
        os.rmdir(tmp_path / "2")
        _wait_for(lambda: _states(manager).get(2) == "END")        # cancelled at once,
        (status,) = [s for s in manager.status("m").model_version_status if s.version == 2]
        assert "version 2 is broken" in status.status.error_message     # with its error
        good.add(2)
        os.makedirs(tmp_path / "2")
        _wait_for(lambda: _states(manager).get(2) == "AVAILABLE", seconds=10)
    finally:
        manager.stop()


def test_a_base_path_missing_for_a_moment_changes_nothing(tmp_path):
    """A remount or a symlink swap: TF Serving does not read a missing base path as "no
    versions" (which would retire the serving one) but as a failed poll."""
    base = tmp_path / "m"
    os.makedirs(base / "1")
    manager = _fake_manager(str(base), lambda v, attempt: False, retries=0, retry_seconds=0)
    manager.start()
    try:
        assert _states(manager) == {1: "AVAILABLE"}
        os.rename(base, tmp_path / "away")
        time.sleep(0.5)                                             # five polls
        assert _states(manager) == {1: "AVAILABLE"}
        with manager.lease("m") as (version, _):
            assert version == 1
        os.rename(tmp_path / "away", base)
    finally:
        manager.stop()


# ------------------------------------------------------------------ batching


class CountingModel:
    """A model that counts its session runs."""

    def __init__(self, model: LoadedModel):
        self.model, self.runs = model, []

    def check_inputs(self, inputs, signature_name=""):
        return self.model.check_inputs(inputs, signature_name)

    def run(self, inputs, signature_name="", output_filter=(), timeout_seconds=None):
        self.runs.append(len(next(iter(inputs.values()))))
        return self.model.run(inputs, signature_name, output_filter, timeout_seconds)


def test_batcher_merges_concurrent_requests_and_a_bad_one_fails_alone(local):
    from concurrent.futures import ThreadPoolExecutor

    from tworec.serving.batching import Batcher
    model = CountingModel(local["scale"])
    batcher = Batcher(max_batch_size=64, batch_timeout_micros=200_000)
    requests_ = [{"x": np.full(i % 3 + 1, i, np.float32)} for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda inputs: batcher.submit(model, inputs).result(),
                                requests_))
    for inputs, answer in zip(requests_, answers):
        np.testing.assert_array_equal(answer["y"], inputs["x"] * 3)
    assert len(model.runs) < len(requests_) and sum(model.runs) == sum(
        len(r["x"]) for r in requests_)
    with pytest.raises(ServingError, match="expects dtype float"):
        batcher.submit(model, {"x": np.array([1], np.int64)})
    batcher.close()


def test_server_with_batching_answers_concurrent_clients(model_dir):
    from concurrent.futures import ThreadPoolExecutor

    from tworec.serving.batching import Batcher
    manager = ModelManager([ModelConfig("scale", os.path.join(model_dir, "scale"))],
                           poll_seconds=0)
    with ModelServer(manager, grpc_port=0, rest_port=0,
                     batcher=Batcher(batch_timeout_micros=20_000)) as server:
        with Client(url=f"http://127.0.0.1:{server.rest_port}") as client:
            with ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(lambda i: client.predict(
                    "scale", {"x": np.array([i], np.float32)})["y"][0], range(12)))
    assert answers == [3.0 * i for i in range(12)]


# ------------------------------------------------------------------ scripts


def _script(name: str):
    import importlib.util
    import sys
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "scripts")
    sys.path.insert(0, scripts)
    spec = importlib.util.spec_from_file_location(f"script_{name}",
                                                  os.path.join(scripts, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_flags_follow_tf_serving(model_dir):
    serve = _script("serve")
    args = serve.parse_args([f"--model_config_file={model_dir}/models.config",
                             "--enable_batching", "--rest_api_port=0"])
    assert (args.port, args.rest_api_port, args.host, args.enable_batching) == (
        8500, 0, "127.0.0.1", True)
    assert [c.name for c in serve.model_configs(args)] == list(MODELS)
    single = serve.parse_args(["--model_name=m", "--model_base_path=/m",
                               "--enable_batching=false"])
    assert serve.model_configs(single) == [ModelConfig("m", "/m")] and not single.enable_batching
    assert serve.model_configs(serve.parse_args(["--model_base_path=/m"])) == [
        ModelConfig("default", "/m")]                                   # TF Serving's name


@pytest.mark.parametrize("flags, message", [
    ([], "give --model_config_file, or --model_name with --model_base_path"),
    (["--model_config_file=m.config", "--model_name=m"],
     "--model_config_file names every model itself; leave out --model_name and "
     "--model_base_path, or serve one model with those two alone"),
    (["--model_config_file=m.config", "--model_base_path=/m"], "--model_config_file names")])
def test_serve_says_which_models_to_serve_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit):
        _script("serve").parse_args(flags)
    assert message in capsys.readouterr().err


def test_serve_names_the_config_file_it_cannot_read_or_parse(tmp_path, capsys):
    serve = _script("serve")
    missing = tmp_path / "nope" / "models.config"
    with pytest.raises(SystemExit):
        serve.parse_args([f"--model_config_file={missing}"])
    assert f"--model_config_file {missing}: no such file (see" in capsys.readouterr().err
    no_run = tmp_path / "runs" / "demo" / "export" / "models_scann.config"     # make serve's
    with pytest.raises(SystemExit):
        serve.parse_args([f"--model_config_file={no_run}"])
    assert f"--model_config_file {no_run}: no such file{serve.RUN_ADVICE}" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.parse_args([f"--model_config_file={tmp_path}"])
    assert f"--model_config_file {tmp_path}: a folder, not a file" in capsys.readouterr().err
    readme = tmp_path / "README.md"
    readme.write_text("# tworec\nA recommender.\n")
    assert serve.main([f"--model_config_file={readme}"]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: --model_config_file {readme}: INVALID_ARGUMENT: ")
    binary = tmp_path / "saved_model.pb"
    binary.write_bytes(b"\x08\xff\xfe\x00")
    assert serve.main([f"--model_config_file={binary}"]) == 2
    assert capsys.readouterr().err == (f"error: --model_config_file {binary}: not text; give a "
                                       "text ModelServerConfig\n")


def test_serve_refuses_a_run_config_whose_models_are_another_folders(tmp_path, capsys):
    """A run folder moved or copied keeps absolute base paths naming the old place: served,
    its models.config would serve the old place's models (another run's, once one is made
    there). Refused, with the one line that points it at its own exports; a run's config in
    place, or one whose old place is gone, as the same."""
    serve = _script("serve")
    for run in ("demo", "v1"):
        os.makedirs(tmp_path / run / "export" / "retrieval" / "1")
    config = tmp_path / "v1" / "export" / "models.config"
    config.write_text(f"model_config_list {{ config {{ name: 'retrieval' base_path: "
                      f"'{tmp_path}/demo/export/retrieval' model_platform: 'tensorflow' }} }}")
    fix = serve.sed_line(f"{tmp_path}/demo/export", f"{tmp_path}/v1/export", str(config))
    message = (f"error: --model_config_file {config}: model retrieval is served from "
               f"{tmp_path}/demo/export/retrieval, not from {tmp_path}/v1/export/retrieval "
               f"beside the file: the run folder was moved or copied; name its own exports "
               f"with {fix}\n")
    for old_place_gone in (False, True):
        if old_place_gone:
            shutil.rmtree(tmp_path / "demo")
        assert serve.main([f"--model_config_file={config}"]) == 2
        assert capsys.readouterr().err == message
    subprocess.run(["sed", "-i", f"s#{tmp_path}/demo/export/#{tmp_path}/v1/export/#",
                    str(config)], check=True)
    configs = serve.model_configs(serve.parse_args([f"--model_config_file={config}"]))
    assert serve.moved_run(str(config), configs) is None
    os.makedirs(tmp_path / "other run" / "export" / "ranking" / "1")      # on purpose: served
    os.makedirs(tmp_path / "v1" / "export" / "ranking" / "1")
    mixed = configs + [ModelConfig("ranking", f"{tmp_path}/other run/export/ranking")]
    assert serve.moved_run(str(config), mixed) is None
    assert not serve.is_run_config(str(tmp_path / "v1" / "export" / "models.docker.config"))
    moved = tmp_path / "a run & co's #2" / "export"      # sed's, the shell's, text_format's
    shutil.copytree(tmp_path / "v1" / "export", moved)
    command = serve.moved_run(str(moved / "models.config"), configs).split(" with ")[-1]
    subprocess.run(command, shell=True, check=True)
    assert serve.moved_run(str(moved / "models.config"), serve.model_configs(serve.parse_args(
        [f"--model_config_file={moved / 'models.config'}"]))) is None


@pytest.mark.parametrize("flags, message", [
    (["--enable_batching", "--max_batch_size=0"], "--max_batch_size must be at least 1, got 0"),
    (["--max_concurrent_requests=0"], "--max_concurrent_requests must be at least 1, got 0"),
    (["--enable_batching", "--num_batch_threads=-1"],
     "--num_batch_threads must be at least 0, got -1"),
    (["--enable_batching", "--max_enqueued_batches=0"],
     "--max_enqueued_batches must be at least 1, got 0"),
    (["--max_num_load_retries=-1"], "--max_num_load_retries must be at least 0, got -1"),
    (["--max_request_bytes=0"], "--max_request_bytes must be at least 1, got 0"),
    (["--port=99999"], "--port must be a port from 0 to 65535 (0: a free one), got 99999"),
    (["--rest_api_port=-1"], "--rest_api_port must be a port from 0 to 65535 (0: REST off)"),
    (["--port=8600", "--rest_api_port=8600"], "--port and --rest_api_port are both 8600; "
     "give gRPC and REST a port each"),
])
def test_serve_refuses_flags_that_cannot_serve_in_one_line(flags, message, capsys):
    serve = _script("serve")
    with pytest.raises(SystemExit) as exit_:
        serve.parse_args(["--model_name=m", "--model_base_path=/m", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert serve.parse_args(["--model_name=m", "--model_base_path=/m",
                             "--max_batch_size=0"]).max_batch_size == 0   # batching off
    assert serve.parse_args(["--model_name=m", "--model_base_path=/m",      # no deadline
                             "--rest_api_timeout_in_ms=0"]).rest_api_timeout_in_ms == 0


def test_recommend_prints_titles(embedded, tmp_path, capsys):
    recommend = _script("recommend")
    movies = tmp_path / "movies.csv"
    movies.write_text("item_id,title\n" + "".join(f"{i},Film {i}\n" for i in ITEMS))
    assert recommend.main(["--user", "u2", "--url", embedded[0], "--n", "3",
                           "--movies", str(movies), "--seen", "i0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "recommendations for user u2:" and len(lines) == 4
    assert all("Film i" in line for line in lines[1:])
    assert recommend.main(["--user", "u2", "--grpc", embedded[1], "--movies",
                           str(tmp_path / "missing.csv")]) == 2
    others = tmp_path / "others.csv"                     # another catalogue's ids, more asked
    others.write_text("item_id,title\nx1,Other film\n")
    assert recommend.main(["--user", "u2", "--url", embedded[0], "--n", "500",
                           "--movies", str(others)]) == 0
    *listed, fewer, untitled = capsys.readouterr().out.splitlines()
    assert fewer == (f"note: the served models returned {len(listed) - 1} items, fewer than "
                     "the 500 asked for")
    assert untitled == (f"note: no item here has a title in --movies {others} (another "
                        "catalogue's ids?)")
    assert recommend.main(["--user", "stranger", "--url", embedded[0], "--n", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[3:] == [
        "note: the models were fit on no rows of user stranger: this is the list every user "
        "they do not know gets"]
    assert recommend.main(["--user", "stranger", "--url", embedded[0], "--n", "2",
                           "--seen", "i0"]) == 0
    assert capsys.readouterr().out.splitlines()[3:] == [
        "note: the models were fit on no rows of user stranger: this is the list every user "
        "they do not know gets, less the --seen items"]


def test_reload_config_replaces_the_models_and_labels_resolve(swap_server):
    base, server = swap_server
    config = model_server_config_pb2.ModelServerConfig()
    entry = config.model_config_list.config.add(name="other", base_path=base,
                                                model_platform="tensorflow")
    entry.version_labels["stable"] = 1
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        response = model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest(
            model_management_pb2.ReloadConfigRequest(config=config), timeout=30)
    assert response.HasField("status") and response.status.error_code == 0   # as TF Serving
    rest = f"http://127.0.0.1:{server.rest_port}"
    removed = requests.get(f"{rest}/v1/models/scale", timeout=10)   # TF Serving's monitor
    assert [(v["version"], v["state"]) for v in removed.json()["model_version_status"]] == [
        ("1", "END")]                                          # keeps a removed model's END
    assert requests.post(f"{rest}/v1/models/scale:predict", json={"instances": [2.0]},
                         timeout=10).status_code == 404
    labelled = requests.post(f"{rest}/v1/models/other/labels/stable:predict",
                             json={"instances": [2.0]}, timeout=10)
    assert labelled.json() == {"predictions": [2.0]}
    unknown = requests.post(f"{rest}/v1/models/other/labels/beta:predict",
                            json={"instances": [2.0]}, timeout=10)
    assert unknown.status_code == 400 and "beta" in unknown.json()["error"]
    status = requests.get(f"{rest}/v1/models/other/labels/beta", timeout=10)  # reads no label,
    assert status.json() == requests.get(f"{rest}/v1/models/other", timeout=10).json()  # as TF
    _reload_config(server, f'config {{ name: "scale" base_path: "{base}" {PLATFORM} }}')
    assert _states(server.manager, "scale") == {1: "AVAILABLE"}   # added again: its new state


def _reload_config(server: ModelServer, text: str) -> None:
    """Reloads the server's config to the model list `text` over gRPC (`text` empty: a config
    that sets no model list)."""
    config = text_format.Parse(f"model_config_list {{ {text} }}" if text else "",
                               model_server_config_pb2.ModelServerConfig())
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest(
            model_management_pb2.ReloadConfigRequest(config=config), timeout=30)


@pytest.mark.parametrize("text, code, message", [
    ("", grpc.StatusCode.INVALID_ARGUMENT, "ServerModelConfig type not supported by "
     "HandleReloadConfigRequest. Only ModelConfigList is currently supported"),
    ('config { name: "other" base_path: "/other" }', grpc.StatusCode.INVALID_ARGUMENT,
     "Illegal setting neither ModelServerConfig::model_type (deprecated) nor ModelServerConfig::"
     'model_platform, model name is other; set model_platform: "tensorflow"'),
    ('config { name: "other" base_path: "/other" model_platform: "pytorch" }',
     grpc.StatusCode.INVALID_ARGUMENT, "Model other requests unsupported platform pytorch; this "
     'server serves model_platform "tensorflow"'),
    ('config { name: "other" base_path: "/other" model_platform: "tensorflow" '
     'model_type: TENSORFLOW }', grpc.StatusCode.INVALID_ARGUMENT, "Illegal setting both "
     "ModelServerConfig::model_type (deprecated) and ModelServerConfig::model_platform, model "
     "name is other"),
    ('config { name: "other" base_path: "/other" model_type: OTHER }',
     grpc.StatusCode.INVALID_ARGUMENT, "ModelServerConfig::model_type choice 2 not supported.")])
def test_a_reload_to_no_model_list_or_platform_is_refused_as_tf_serving_does(
        swap_server, text, code, message):
    """An empty reload request would otherwise unload every model; a config naming no platform,
    or another one, the real binary refuses."""
    base, server = swap_server
    with pytest.raises(grpc.RpcError) as error:
        _reload_config(server, text)
    assert (error.value.code(), error.value.details()) == (code, message)
    assert _states(server.manager, "scale") == {1: "AVAILABLE"}
    with Client(url=f"http://127.0.0.1:{server.rest_port}") as client:
        assert client.predict("scale", {"x": np.ones(1, np.float32)})["y"].tolist() == [1.0]


def test_a_model_listed_twice_is_refused(swap_server, tmp_path):
    base, server = swap_server
    message = "Illegal to list model scale multiple times in config list"
    twice = f'config {{ name: "scale" base_path: "{base}" {PLATFORM} }} ' \
            f'config {{ name: "scale" base_path: "{tmp_path}" {PLATFORM} }}'
    with pytest.raises(ServingError) as error:
        parse_config(f"model_config_list {{ {twice} }}")
    assert (error.value.code, error.value.message) == ("INVALID_ARGUMENT", message)
    with pytest.raises(ServingError, match=message):
        ModelManager([ModelConfig("scale", base), ModelConfig("scale", str(tmp_path))])
    with pytest.raises(grpc.RpcError) as error:
        _reload_config(server, twice)
    assert (error.value.code(), error.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                            message)
    with Client(url=f"http://127.0.0.1:{server.rest_port}") as client:
        assert client.predict("scale", {"x": np.ones(1, np.float32)})["y"].tolist() == [1.0]


def test_a_move_to_another_base_path_drops_no_request(swap_server, tmp_path):
    """Moves keep the old versions serving until the new path's load: to a path with another
    version (5.0), to one with the same version number (its new copy, 7.0, is swapped in), and
    to one whose version fails to load (the last good version keeps serving)."""
    base, server = swap_server
    moved = {"b": (Scale(5.0), 2), "c": (Scale(7.0), 2)}
    for folder, (module, version) in moved.items():
        save(module, str(tmp_path / folder), version)
    write_version(str(tmp_path / "d"), lambda path: open(
        os.path.join(path, "saved_model.pb"), "w").write("not a SavedModel"), 3)
    with hammering(server) as (_, factors, failures):
        for folder, factor in (("b", 5.0), ("c", 7.0), ("d", 7.0)):
            _wait_for(lambda: all(factors))
            server.manager.reload([ModelConfig("scale", str(tmp_path / folder))])
            count = [len(f) for f in factors]
            _wait_for(lambda: failures or all(len(f) > n + 5 for f, n in zip(factors, count)))
            assert failures == [] and all(f[-1] == factor for f in factors), folder
    assert failures == []
    assert all(f == sorted(f, key=[1.0, 5.0, 7.0].index) for f in factors)
    states = {s.version: (s.state, s.status.error_code)
              for s in server.manager.status("scale").model_version_status}
    assert states[2] == (get_model_status_pb2.ModelVersionStatus.AVAILABLE, 0)
    assert states[3][0] == get_model_status_pb2.ModelVersionStatus.END and states[3][1] != 0


def test_labels_may_only_point_at_available_versions(swap_server):
    base, server = swap_server
    rest = f"http://127.0.0.1:{server.rest_port}"

    def labelled(labels: dict[str, int]) -> str:
        return f'config {{ name: "scale" base_path: "{base}" {PLATFORM} ' + "".join(
            f'version_labels {{ key: "{k}" value: {v} }} ' for k, v in labels.items()) + "}"
    _reload_config(server, labelled({"stable": 1}))
    with pytest.raises(grpc.RpcError) as error:
        _reload_config(server, labelled({"stable": 1, "canary": 7}))
    assert (error.value.code(), error.value.details()) == (
        grpc.StatusCode.FAILED_PRECONDITION, "Request to assign label to version 7 of model "
        "scale, which is not currently available for inference")
    stable = requests.post(f"{rest}/v1/models/scale/labels/stable:predict",
                           json={"inputs": [2.0]}, timeout=10)
    assert stable.json() == {"outputs": [2.0]}                   # the old labels are kept
    canary = requests.post(f"{rest}/v1/models/scale/labels/canary:predict",
                           json={"inputs": [2.0]}, timeout=10)
    assert (canary.status_code, canary.json()) == (
        400, {"error": "Unrecognized servable version label: canary"})


class Renamed(tf.Module):
    """x [b] float32 -> z [b] float32 = 10 x (Scale's signature with its output renamed)."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def serve(self, x):
        return {"z": x * 10.0}


class TwoOutputs(tf.Module):
    """x [b] float32 -> y [b] float32 = 10 x, n [b] int64 = 100 x (another signature)."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def serve(self, x):
        return {"y": x * 10.0, "n": tf.cast(x * 100.0, tf.int64)}


def _lists(outputs: dict[str, np.ndarray]) -> dict[str, list]:
    return {name: value.tolist() for name, value in outputs.items()}


def test_rest_client_decodes_each_answer_with_its_versions_signature(swap_server):
    base, server = swap_server
    x = {"x": np.array([2.0], np.float32)}
    with Client(url=f"http://127.0.0.1:{server.rest_port}", retries=0) as client:
        assert _lists(client.predict("scale", x)) == {"y": [2.0]}
        for version, module in ((2, Renamed()), (3, TwoOutputs())):
            save(module, base)
            _wait_for(lambda: server.manager.status("scale", version - 1)
                      .model_version_status[0].state == get_model_status_pb2.ModelVersionStatus.END)
            answer = client.predict("scale", x)
            if version == 2:                 # a single output's answer does not name it
                assert _lists(answer) == {"z": [20.0]}
        assert answer["y"].tolist() == [20.0] and answer["y"].dtype == np.float32
        assert answer["n"].tolist() == [200] and answer["n"].dtype == np.int64
        # A version's signature cached stale (its folder replaced) is fetched again once.
        signature = client.metadata("scale", 3).signature_def["serving_default"]
        signature.outputs["n"].dtype = tf.float32.as_datatype_enum
        client.transport._signatures["scale", 3, "serving_default"] = signature
        assert client.predict("scale", x, version=3)["n"].dtype == np.int64
        signature = client.transport._signatures["scale", 3, "serving_default"]
    from tworec.serving.client import _outputs_of_json
    for wrong in ({"outputs": {"y": [1.0]}}, {"outputs": {"y": [1.0], "n": [1.5]}},
                  {"outputs": {"y": [[1.0], 2.0], "n": [1]}}, {"outputs": [1.0]}, {}):
        with pytest.raises(ServingError) as error:
            _outputs_of_json(wrong, signature)
        assert error.value.code == "INTERNAL"


def test_rest_client_looks_the_latest_version_up_at_most_once_a_second(embedded):
    with Client(url=embedded[0]) as client:
        transport, looked_up = client.transport, []
        transport.LATEST_SECONDS = 60.0                         # no timing in the test
        status = transport.status
        transport.status = lambda *args: looked_up.append(args) or status(*args)
        for _ in range(3):
            assert client.predict("scale", {"x": np.ones(1, np.float32)})["y"].tolist() == [3.0]
        assert len(looked_up) == 1
        transport._latest_seen["scale"] = (1, time.monotonic() - transport.LATEST_SECONDS)
        client.predict("scale", {"x": np.ones(1, np.float32)})
        assert len(looked_up) == 2


class Typed(tf.Module):
    """x [b] float32, n [b] int32, small [b] int8, id [b] string -> y [b] float32 = x * n,
    small [b] int8, id [b] string (as given)."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x"),
                                  tf.TensorSpec([None], tf.int32, name="n"),
                                  tf.TensorSpec([None], tf.int8, name="small"),
                                  tf.TensorSpec([None], tf.string, name="id")])
    def serve(self, x, n, small, id):
        return {"y": x * tf.cast(n, tf.float32), "small": small, "id": id}


def test_both_transports_send_numbers_as_the_signature_reads_them(tmp_path, monkeypatch):
    """NumPy's default float64 and int64 arrays reach float32 and int32 inputs over gRPC as over
    REST (gRPC sent them as DT_DOUBLE and DT_INT64, which servers refuse); an int8 input reads
    an int32 and wraps it, as REST; empty arrays (NumPy's float64 `[]`) fit any input; an
    integer outside what the input reads, or a float for an integer, is INVALID_ARGUMENT on
    both. A gRPC server without GetModelStatus gets the inputs as given; a signature cached
    stale is read again once."""
    save(Typed(), str(tmp_path / "typed"))
    manager = ModelManager([ModelConfig("typed", str(tmp_path / "typed"))], poll_seconds=0)

    def inputs(x, n, small=(1, 1), ids=(b"a", b"b")):
        return {"x": np.array(x), "n": np.array(n), "small": np.array(small),
                "id": np.array(ids, dtype=object)}
    with ModelServer(manager, grpc_port=0, rest_port=0) as server:
        for where in (dict(url=f"http://127.0.0.1:{server.rest_port}"),
                      dict(grpc_target=f"127.0.0.1:{server.grpc_port}")):
            with Client(**where, retries=0) as client:
                answer = client.predict("typed", inputs([1.5, 2.0], [2, 3], [200, -1]))
                assert answer["y"].dtype == np.float32 and answer["y"].tolist() == [3.0, 6.0]
                assert answer["small"].tolist() == [-56, -1], where
                answer = client.predict("typed", inputs([1, 2], np.array([2, 3], np.uint8)),
                                        version=1)
                assert answer["y"].tolist() == [2.0, 6.0], where
                empty = client.predict("typed", dict.fromkeys(["x", "n", "small", "id"],
                                                              np.array([])))     # float64
                assert [len(value) for value in empty.values()] == [0, 0, 0], where
                with warnings.catch_warnings():
                    warnings.simplefilter("error")            # no overflow warning of a cast
                    assert client.predict("typed", inputs([1e39], [1], [1], [b"a"]))["y"] == \
                        np.float32(np.inf)
                for refused in ([2 ** 31], [-2 ** 31 - 1], [2.0]):
                    with pytest.raises(ServingError) as error:
                        client.predict("typed", inputs([1.0], refused, [1], [b"a"]))
                    assert error.value.code == "INVALID_ARGUMENT", (where, refused)
                with pytest.raises(ServingError) as error:
                    client.predict("typed", inputs([1.0], [1], [2 ** 31], [b"a"]))
                assert error.value.code == "INVALID_ARGUMENT", where
        with Client(grpc_target=f"127.0.0.1:{server.grpc_port}", retries=0) as client:
            signature = client.metadata("typed", 1).signature_def["serving_default"]
            signature.inputs["x"].dtype = tf.int32.as_datatype_enum       # a stale signature
            client.transport._signatures["typed", 1, "serving_default"] = signature
            answer = client.predict("typed", inputs([1.5], [2], [1], [b"a"]), version=1)
            assert answer["y"].tolist() == [3.0]

            def no_model_service(*args):
                raise ServingError("UNIMPLEMENTED", "Method not found: GetModelStatus")
            monkeypatch.setattr(client.transport, "status", no_model_service)
            answer = client.predict("typed", {"x": np.array([1.5], np.float32),
                                              "n": np.array([2], np.int32),
                                              "small": np.array([1], np.int8),
                                              "id": np.array([b"a"], dtype=object)})
            assert answer["y"].tolist() == [3.0]


class Double(tf.Module):
    """x [b] float64 -> y [b] float64 = 2 x (a version whose input is another dtype)."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float64, name="x")])
    def serve(self, x):
        return {"y": x * 2.0}


def test_grpc_client_types_numbers_by_the_signature_of_the_version_it_sends_to(tmp_path):
    """A latest version looked up before a hot swap is asked for by number, so an input typed by
    its signature never reaches its successor (whose input is float64, here); retired, it is
    looked up again once."""
    base = str(tmp_path / "scale")
    save(Scale(1.0), base)
    manager = ModelManager([ModelConfig("scale", base, num_versions=2)], poll_seconds=0.05)
    state = get_model_status_pb2.ModelVersionStatus

    def asked(client, x):
        answer, version = client.predict_version("scale", {"x": x})
        return answer["y"].tolist(), answer["y"].dtype, version

    def in_state(version, wanted):
        try:
            return server.manager.status("scale", version).model_version_status[0].state == wanted
        except ServingError:                                      # not found yet
            return False
    with ModelServer(manager, grpc_port=0, rest_port=0) as server, \
            Client(grpc_target=f"127.0.0.1:{server.grpc_port}", retries=0) as client:
        client.transport.LATEST_SECONDS = 600.0                  # the looked-up version is kept
        assert asked(client, np.array([2.0])) == ([2.0], np.float32, 1)
        save(Double(), base)                                      # version 2, beside 1
        _wait_for(lambda: in_state(2, state.AVAILABLE))
        assert asked(client, np.array([2.0], np.float32)) == ([2.0], np.float32, 1)
        save(Double(), base)                                      # version 3 retires 1
        _wait_for(lambda: in_state(1, state.END))
        assert asked(client, np.array([2.0], np.float32)) == ([4.0], np.float64, 3)


def test_rest_client_sends_nan_and_infinity(embedded):
    with Client(url=embedded[0]) as client:
        answer = client.predict("scale", {"x": np.array([np.nan, np.inf, -1.0], np.float32)})
    assert np.isnan(answer["y"][0]) and answer["y"][1:].tolist() == [np.inf, -3.0]


def test_latency_measure_counts_requests_and_errors(embedded):
    from tworec.serving.latency import measure
    with Client(grpc_target=embedded[1]) as client:
        result = measure(lambda: client.predict("scale", {"x": np.ones(1, np.float32)}),
                         clients=2, seconds=0.3)
    assert result["requests"] > 0 and result["errors"] == 0
    assert 0 < result["p50_ms"] <= result["p99_ms"] and result["rps"] > 0
    calls = iter(range(10**6))
    failing = measure(lambda: 1 / (next(calls) % 2), clients=1, seconds=0.05, warmup=0)
    assert failing["errors"] > 0 and failing["requests"] > 0


def test_config_file_changes_are_picked_up(swap_server, tmp_path, caplog):
    """A refused file is read again at every poll (a write may end within one mtime tick) and
    logged once, until its error changes."""
    caplog.set_level(logging.ERROR, logger="tworec.serving.manager")
    base, server = swap_server
    path = write_models_config(str(tmp_path / "models.config"), {"scale": base})
    server.manager.watch_config_file(path, poll_seconds=0.05)
    write_models_config(path, {"scale": base, "again": base})
    os.utime(path, (time.time() + 5, time.time() + 5))
    with Client(url=f"http://127.0.0.1:{server.rest_port}") as client:
        _wait_for(lambda: _available(client, "again"))
        for later, broken in [(10, "not a config"), (15, b"\xff\xfe\x00"), (20, "")]:  # broken,
            with open(path, "wb" if isinstance(broken, bytes) else "w") as f:   # not text or
                f.write(broken)                       # emptied: logged; the models stay
            os.utime(path, (time.time() + later, time.time() + later))
            time.sleep(0.3)
            assert _available(client, "again") and _available(client, "scale"), repr(broken)
        stamp = os.stat(path).st_mtime                 # the whole config, written within the
        write_models_config(path, {"scale": base, "third": base})    # emptied one's tick
        os.utime(path, (stamp, stamp))
        _wait_for(lambda: _available(client, "third"))
    refusals = [r for r in caplog.records if "reloading the model config" in r.getMessage()]
    assert len(refusals) == 3, [r.getMessage() for r in refusals]       # one a broken file


def test_json_inputs_are_read_as_tf_serving_reads_them():
    """`AddValueToTensor`: int8/int16/uint8 take int32s and wrap them (as gRPC's int_val),
    float takes any double, beyond its range infinite (`GetFloat`'s cast), and half, bfloat16
    and uint16 are not read at all."""
    from tensorflow.core.protobuf import meta_graph_pb2
    from tworec.serving.json_tensor import parse_json, parse_predict

    def read(body: bytes, dtype: tf.DType) -> np.ndarray:
        signature = meta_graph_pb2.SignatureDef()
        signature.inputs["x"].dtype = dtype.as_datatype_enum
        return parse_predict(parse_json(body), signature, 100)[0]["x"]
    wrapped = read(b'{"inputs": [1000, -1, 127]}', tf.int8)
    assert wrapped.tolist() == [-24, -1, 127] and wrapped.dtype == np.int8
    for body, dtype, code in ((b'{"inputs": [2147483648]}', tf.int8, "INVALID_ARGUMENT"),
                              (b'{"inputs": [1]}', tf.float16, "UNIMPLEMENTED"),
                              (b'{"inputs": [1]}', tf.bfloat16, "UNIMPLEMENTED"),
                              (b'{"inputs": [1]}', tf.uint16, "UNIMPLEMENTED")):
        with pytest.raises(ServingError) as error:
            read(body, dtype)
        assert error.value.code == code, (body, dtype)
    assert read(b'{"inputs": [3.4028234e38, 3.5e38]}', tf.float32).tolist() == [
        np.float32(3.4028234e38), np.inf]


BASE64_READINGS = [
    ("dTQwOQ==", b"u409"), ("dTQwOQ", b"u409"), ("dTQwOQ..", b"u409"), ("dTQwOQ=.", b"u409"),
    ("dTQw\r\nOQ==\n", b"u409"), (" d T Q w O Q = = ", b"u409"), ("", b""), ("dTQw", b"u40"),
    ("dTQwOQ=", None), ("dTQwOQ===", None), ("dTQw=", None), ("dTQwO", None), ("dTQ=wOQ", None),
    ("dTQwOQ-_", None), ("%%%", None), ("dTQwé", None)]


@pytest.mark.parametrize("text, value", BASE64_READINGS,
                         ids=[repr(text) for text, _ in BASE64_READINGS])
def test_base64_strings_are_read_as_abseil_reads_them(text, value):
    """TF Serving's `absl::Base64Unescape`: whitespace skipped, padding optional, but correct
    when given; nothing outside the standard alphabet."""
    from tworec.serving.json_tensor import b64_unescape
    if value is None:
        with pytest.raises(binascii.Error):
            b64_unescape(text)
    else:
        assert b64_unescape(text) == value


class SwappingTransport:
    """Versions 1 and 2 answer x * version; the latest becomes 2 after the first answer, and
    version 1 is retired then too when `retire`."""

    def __init__(self, retire: bool):
        self.retire, self.latest, self.asked = retire, 1, []

    def predict(self, model, inputs, signature_name, version):
        self.asked.append(version)
        number = self.latest if version is None else version
        if number == 1 and self.latest == 2 and self.retire:
            raise ServingError("NOT_FOUND", f"Servable not found for request: Specific({model}, 1)")
        self.latest = 2
        return {"y": inputs["x"] * number}, number


@pytest.mark.parametrize("retire, asked, factor", [(False, [None, 1, 1], 1),
                                                    (True, [None, 1, None, 2, 2], 2)])
def test_a_split_request_is_answered_by_one_version(retire, asked, factor):
    client = Client(url="http://127.0.0.1:1", max_rows_per_request=2)
    client.transport = SwappingTransport(retire)
    answer, version = client.predict_version("m", {"x": np.arange(5.0)})
    assert answer["y"].tolist() == (np.arange(5.0) * factor).tolist() and version == factor
    assert client.transport.asked == asked


def test_a_split_request_to_a_version_retired_meanwhile_fails():
    """A request for one version is not sent to another: its retirement between the parts is
    NOT_FOUND (so a dependent request, as the Recommender's scoring, can start over)."""
    client = Client(url="http://127.0.0.1:1", max_rows_per_request=2)
    client.transport = SwappingTransport(retire=True)
    with pytest.raises(ServingError) as error:
        client.predict("m", {"x": np.arange(5.0)}, version=1)
    assert error.value.code == "NOT_FOUND" and client.transport.asked == [1, 1]
