"""TF Serving's export layout: `BASE/VERSION/` SavedModels, `models.config`, warmup records.

A new version is written into a temporary folder inside BASE (a name that is not an integer,
so TF Serving and our server skip it) and renamed into place: a poller never sees half a model.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable


def list_versions(base_path: str) -> list[int]:
    """Integer versions under `base_path`, increasing; other folder names are skipped."""
    if not os.path.isdir(base_path):
        return []
    return sorted(int(name) for name in os.listdir(base_path)
                  if name.isascii() and name.isdigit()                 # not '²': int refuses it
                  and os.path.isdir(os.path.join(base_path, name)))


def next_version(base_path: str) -> int:
    versions = list_versions(base_path)
    return versions[-1] + 1 if versions else 1


def write_version(base_path: str, write: Callable[[str], None], version: int | None = None) -> str:
    """Writes a version atomically.

    Args:
        base_path: the model's folder.
        write: called with a temporary folder to fill (e.g. `tf.saved_model.save`).
        version: the version number, or the next free one.

    Returns:
        The folder of the new version.
    """
    os.makedirs(base_path, exist_ok=True)
    version = next_version(base_path) if version is None else int(version)
    final = os.path.join(base_path, str(version))
    if os.path.exists(final):
        raise FileExistsError(f"{final} exists; versions are never overwritten")
    staging = tempfile.mkdtemp(prefix=f".tmp-{version}-", dir=base_path)
    try:
        write(staging)
        make_readable(staging)        # mkdtemp's 0o700 would hide it from a server's user
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def make_readable(folder: str) -> None:
    """Makes a folder and everything in it readable by every user (folders 755, files 644),
    so that a server running as another user (a container's) can load it, whatever the umask."""
    os.chmod(folder, 0o755)
    for directory, folders, files in os.walk(folder):
        for name in folders:
            os.chmod(os.path.join(directory, name), 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)


def write_models_config(path: str, base_paths: dict[str, str]) -> str:
    """Writes a TF Serving `ModelServerConfig` text proto, one `config` per model.

    Args:
        path: the file to write, e.g. `export/models.config`.
        base_paths: model name -> its base path (made absolute, as TF Serving needs).

    Returns:
        `path`.
    """
    from google.protobuf import text_format
    from tensorflow_serving.config import model_server_config_pb2

    config = model_server_config_pb2.ModelServerConfig()
    for name, base_path in base_paths.items():
        config.model_config_list.config.add(
            name=name, base_path=os.path.abspath(base_path), model_platform="tensorflow")
    with open(path, "w") as f:
        f.write(text_format.MessageToString(config))
    return path


MAX_WARMUP_RECORDS = 1000
WARMUP_FILE = os.path.join("assets.extra", "tf_serving_warmup_requests")


def write_warmup_requests(saved_model_dir: str, model_name: str,
                          requests: dict[str, dict]) -> str:
    """Writes `assets.extra/tf_serving_warmup_requests`: one `PredictionLog` per row of each
    signature's inputs. A session prepares a signature's graph on its first call (seconds for
    a retrieval export): the records have TF Serving do it at load, not on a client's request.

    Args:
        saved_model_dir: a SavedModel folder (a version folder, or its staging folder).
        model_name: the name the model is served under.
        requests: signature name -> its input name -> array [batch, ...]; each row becomes
            one request of batch 1, the signatures' rows in turn, at most 1000 requests in all
            (TF Serving's limit: each signature keeps an equal share of them).

    Returns:
        The path of the warmup file.
    """
    if not isinstance(requests, dict) or not 0 < len(requests) <= MAX_WARMUP_RECORDS:
        raise ValueError(f"requests must map 1 to {MAX_WARMUP_RECORDS} signature names to "
                         f"their inputs, got {type(requests).__name__} of "
                         f"{len(requests) if isinstance(requests, dict) else '?'}")
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_log_pb2

    path = os.path.join(saved_model_dir, WARMUP_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    share, rows = MAX_WARMUP_RECORDS // len(requests), {}
    for name, inputs in requests.items():
        lengths = {len(values) for values in inputs.values()}
        if len(lengths) != 1:
            raise ValueError(f"the warmup inputs of {name!r} must be one or more arrays of "
                             f"one batch size, got sizes {sorted(lengths)}")
        rows[name] = min(lengths.pop(), share)
    with tf.io.TFRecordWriter(path) as writer:
        for row in range(max(rows.values())):
            for signature_name, inputs in requests.items():
                if row >= rows[signature_name]:
                    continue
                request = predict_pb2.PredictRequest()
                request.model_spec.name = model_name
                request.model_spec.signature_name = signature_name
                for name, values in inputs.items():
                    request.inputs[name].CopyFrom(tf.make_tensor_proto(values[row:row + 1]))
                log = prediction_log_pb2.PredictionLog(
                    predict_log=prediction_log_pb2.PredictLog(request=request))
                writer.write(log.SerializeToString())
    return path


def save_servable(module, path: str, signatures: dict, options=None) -> None:
    """`tf.saved_model.save(module, path, signatures=..., options=...)` without the functions
    neither a session nor `tf.saved_model.load` can run (`drop_unservable_functions`)."""
    import tensorflow as tf
    tf.saved_model.save(module, path, signatures=signatures, options=options)
    drop_unservable_functions(path)


def drop_unservable_functions(saved_model_dir: str) -> int:
    """Rewrites the SavedModel's function library to what a session or `tf.saved_model.load`
    can run, and its fingerprint to match; returns how many functions it dropped (0: the files
    are untouched).

    Kept: the functions the graph's nodes call, those the object graph names (what
    `tf.saved_model.load` restores, custom gradients included), those the library's gradient
    lists name, the alternatives Grappler's implementation selector may swap in for them (the
    same `api_implements`: a Keras GRU's cuDNN variant, for a GPU), and all they call. Dropped:
    the rest, which is what Keras registers for an alternative's gradient (`__forward_*` and
    `__inference___backward_*` pairs and their loops' gradients) in every graph that calls a
    GRU or LSTM: on a two-member GRU model 60 of 136 functions, 1.5 of 2.5 MB, and about 2 s of
    graph preparation on each signature's first call."""
    from tensorflow.core.protobuf import saved_model_pb2
    from tensorflow.python.saved_model import fingerprinting_utils

    pb_path = os.path.join(saved_model_dir, "saved_model.pb")
    saved_model = saved_model_pb2.SavedModel()
    with open(pb_path, "rb") as f:
        saved_model.ParseFromString(f.read())
    dropped = 0
    for meta_graph in saved_model.meta_graphs:
        library = meta_graph.graph_def.library
        kept = servable_functions(meta_graph)
        functions = [function for function in library.function if function.signature.name in kept]
        dropped += len(library.function) - len(functions)
        del library.function[:]
        library.function.extend(functions)
    if not dropped:
        return 0
    with open(pb_path + ".tmp", "wb") as f:                      # as TF writes it, then in place
        f.write(saved_model.SerializeToString(deterministic=True))
    os.replace(pb_path + ".tmp", pb_path)
    fingerprinting_utils.write_fingerprint(saved_model_dir)
    return dropped


def servable_functions(meta_graph) -> set[str]:
    """The names of the library functions of a `MetaGraphDef` that a session or
    `tf.saved_model.load` can run (`drop_unservable_functions`)."""
    library = meta_graph.graph_def.library
    functions = {function.signature.name: function for function in library.function}

    def named(value) -> set[str]:
        """The functions an `AttrValue` names, nested ones included."""
        funcs = ([value.func] if value.HasField("func") else []) + list(value.list.func)
        names = set()
        for func in funcs:
            names.add(func.name)
            for inner in func.attr.values():
                names |= named(inner)
        return names

    def called(nodes) -> set[str]:
        names = set()
        for node in nodes:
            names.update([node.op] if node.op in functions else [])
            for value in node.attr.values():
                names |= named(value)
        return names

    def alternatives(name: str) -> set[str]:
        implements = functions[name].attr.get("api_implements")
        if implements is None:
            return set()
        return {other for other, function in functions.items()
                if function.attr.get("api_implements") == implements
                and not {"forward_function_name", "backward_function_name"} & set(function.attr)}

    objects = meta_graph.object_graph_def
    waiting = called(meta_graph.graph_def.node) | set(objects.concrete_functions) | {
        name for g in library.gradient for name in (g.function_name, g.gradient_func)} | {
        g.gradient_func for g in library.registered_gradients}
    for node in objects.nodes:
        kind = node.WhichOneof("kind")
        if kind == "function":
            waiting.update(node.function.concrete_functions)
        elif kind == "bare_concrete_function":
            waiting.add(node.bare_concrete_function.concrete_function_name)
        elif kind == "captured_tensor":
            waiting.add(node.captured_tensor.concrete_function)
    kept = set()
    while waiting:
        name = waiting.pop()
        if name in kept or name not in functions:
            continue
        kept.add(name)
        waiting |= called(functions[name].node_def) | alternatives(name)
    return kept
