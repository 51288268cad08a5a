"""A bounded soak of the embedded server: concurrent clients mixing valid and malformed requests.

    python -m tworec.serving.soak [--seconds 30] [--clients 16]

Two tiny SavedModels are written to a temporary folder and served by a child process (batching
on, a 1000-row limit, 1 s header and body timeouts). For `seconds`, `clients` threads each send
at random a valid REST or gRPC predict, whose answer must equal an in-process run of the same
SavedModel, or one of the malformed requests of issue 11. The report counts both kinds, lists
every valid request that failed or got a wrong answer and every malformed one that got a 200 or
a 5xx, and gives the child's resident memory after warm-up and at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import grpc
import numpy as np
import requests
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2
from tensorflow_serving.apis import (model_management_pb2, model_service_pb2_grpc, predict_pb2,
                                     prediction_service_pb2_grpc)

from tworec.console import exit_without_finalizing, parser_for
from tworec.serving.layout import write_models_config, write_version
from tworec.serving.model import LoadedModel

MAX_ROWS = 1000
USERS = [f"u{i}".encode() for i in range(50)]
ITEMS = [f"i{i}".encode() for i in range(200)]


class Scores(tf.Module):
    """user_id [b] string, item_ids [b, n] string -> scores [b, n] float32, a fixed function
    of both ids, so that an answer computed on another request's rows shows."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id"),
                                  tf.TensorSpec([None, None], tf.string, name="item_ids")])
    def serve(self, user_id, item_ids):
        users = tf.cast(tf.strings.to_hash_bucket_fast(user_id, 1000), tf.float32)   # [b]
        items = tf.cast(tf.strings.to_hash_bucket_fast(item_ids, 1000), tf.float32)  # [b, n]
        return {"scores": users[:, None] * 1000.0 + items}


def build_models(root: str) -> str:
    """Writes `scores/1` and its `models.config` under `root`; returns the config's path."""
    module = Scores()
    write_version(os.path.join(root, "scores"), lambda path: tf.saved_model.save(
        module, path, signatures={"serving_default": module.serve}))
    return write_models_config(os.path.join(root, "models.config"),
                               {"scores": os.path.join(root, "scores")})


def serve(config_path: str) -> None:
    """The child: serves the config with the soak's limits, prints its ports, waits."""
    from tworec.serving.batching import Batcher
    from tworec.serving.manager import ModelManager, parse_config
    from tworec.serving.server import ModelServer

    with open(config_path) as f:
        manager = ModelManager(parse_config(f.read()), poll_seconds=0)
    server = ModelServer(manager, grpc_port=0, rest_port=0, max_rows=MAX_ROWS,
                         batcher=Batcher(max_batch_size=16, batch_timeout_micros=2000),
                         header_timeout_seconds=1.0, body_timeout_seconds=1.0).start()
    print(json.dumps({"rest": server.rest_port, "grpc": server.grpc_port}), flush=True)
    server.wait()


class Soak:
    """The parent: the clients, their requests and the tally.

    Args:
        ports: {"rest": port, "grpc": port} of the child.
        expected: the in-process model whose answers valid requests must match.
    """

    def __init__(self, ports: dict, expected: LoadedModel):
        self.rest = f"http://127.0.0.1:{ports['rest']}"
        self.rest_port = ports["rest"]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}")
        self.stub = prediction_service_pb2_grpc.PredictionServiceStub(self.channel)
        self.models = model_service_pb2_grpc.ModelServiceStub(self.channel)
        self.expected = expected
        self.counts: Counter = Counter()
        self.problems: list[str] = []
        self._lock = threading.Lock()
        self.malformed = [getattr(self, name) for name in dir(self) if name.startswith("bad_")]

    def run(self, clients: int, seconds: float, seed: int = 0) -> None:
        """`clients` threads, each sending valid (half) and malformed requests for `seconds`."""
        deadline = time.monotonic() + seconds
        threads = [threading.Thread(target=self._client, args=(deadline, seed + i))
                   for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _client(self, deadline: float, seed: int) -> None:
        rng = random.Random(seed)
        session = requests.Session()
        while time.monotonic() < deadline:
            if rng.random() < 0.5:
                self._valid(rng, session)
            else:
                self._malformed(rng.choice(self.malformed), session)
        session.close()

    def _valid(self, rng: random.Random, session: requests.Session) -> None:
        rows, width = rng.randint(1, 3), rng.randint(1, 4)
        inputs = {"user_id": np.array(rng.choices(USERS, k=rows), dtype=object),
                  "item_ids": np.array([rng.choices(ITEMS, k=width) for _ in range(rows)],
                                       dtype=object)}
        want = self.expected.run(inputs)["scores"]
        transport = rng.choice(["rest", "grpc"])
        try:
            got = (self._rest_valid(inputs, session) if transport == "rest"
                   else self._grpc_valid(inputs))
            ok = np.array_equal(got, want)
            problem = None if ok else f"valid {transport} request answered wrongly"
        except Exception as error:  # every failure of a valid request is a finding
            problem = f"valid {transport} request failed: {error!r}"[:300]
        self._tally(f"valid_{transport}", problem)

    def _rest_valid(self, inputs: dict, session: requests.Session) -> np.ndarray:
        body = {"inputs": {"user_id": [u.decode() for u in inputs["user_id"]],
                           "item_ids": [[i.decode() for i in row] for row in inputs["item_ids"]]}}
        answer = session.post(f"{self.rest}/v1/models/scores:predict", json=body, timeout=10)
        answer.raise_for_status()
        return np.asarray(answer.json()["outputs"], np.float32)

    def _grpc_valid(self, inputs: dict) -> np.ndarray:
        response = self.stub.Predict(_request("scores", {
            name: tf.make_tensor_proto(value) for name, value in inputs.items()}), timeout=10)
        return tf.make_ndarray(response.outputs["scores"])

    def _malformed(self, send, session: requests.Session) -> None:
        try:
            status = send(session)
        except grpc.RpcError as error:
            status = error.code().name
        except (requests.RequestException, OSError) as error:
            status = f"connection: {type(error).__name__}"
        bad = status in (200, "OK") or (isinstance(status, int) and status >= 500) or \
            status in ("INTERNAL", "UNKNOWN")
        self._tally(send.__name__, f"{send.__name__} answered {status}" if bad else None)

    def _tally(self, kind: str, problem: str | None) -> None:
        with self._lock:
            self.counts[kind] += 1
            if problem is not None:
                self.counts["problems"] += 1
                if len(self.problems) < 20:
                    self.problems.append(problem)

    # ---------------------------------------------- the malformed requests (issue 11)

    def bad_crossed_batch(self, session) -> str:
        """Inputs that disagree on the batch size (finding 1)."""
        self.stub.Predict(_request("scores", {
            "user_id": tf.make_tensor_proto(np.array([b"u1", b"u2"], dtype=object)),
            "item_ids": tf.make_tensor_proto(np.array([[b"i1", b"i2"]], dtype=object))}),
            timeout=10)
        return "OK"

    def bad_too_many_rows(self, session) -> int:
        """100,000 rows in one 0.7 MB body (finding 2)."""
        body = {"inputs": {"user_id": ["u1"] * 100_000, "item_ids": [["i1"]] * 100_000}}
        return session.post(f"{self.rest}/v1/models/scores:predict", json=body,
                            timeout=10).status_code

    def bad_amplified_tensor(self, session) -> str:
        """An 18-byte TensorProto declaring 2^28 strings (finding 3)."""
        proto = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[b"u1"],
                                       tensor_shape=_shape([1 << 28]))
        self.stub.Predict(_request("scores", {"user_id": proto, "item_ids": proto}), timeout=10)
        return "OK"

    def bad_negative_dimension(self, session) -> str:
        proto = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[b"u1"],
                                       tensor_shape=_shape([-5]))
        self.stub.Predict(_request("scores", {"user_id": proto, "item_ids": proto}), timeout=10)
        return "OK"

    def bad_reload_outside_roots(self, session) -> str:
        """A ReloadConfig naming a folder outside the allowed roots (finding 4)."""
        request = model_management_pb2.ReloadConfigRequest()
        request.config.model_config_list.config.add(name="evil", base_path="/etc",
                                                    model_platform="tensorflow")
        self.models.HandleReloadConfigRequest(request, timeout=10)
        return "OK"

    def bad_partial_body(self, session) -> str:
        """A body cut short by a client that leaves (finding 7)."""
        with socket.create_connection(("127.0.0.1", self.rest_port), timeout=5) as sock:
            sock.sendall(b"POST /v1/models/scores:predict HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 500\r\n\r\n{\"inputs\": {")
        return "closed"

    def bad_huge_declared_body(self, session) -> int:
        """A Content-Length of 1 GB (refused unread, 413)."""
        with socket.create_connection(("127.0.0.1", self.rest_port), timeout=5) as sock:
            sock.sendall(b"POST /v1/models/scores:predict HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 1000000000\r\n\r\n")
            return int(sock.recv(4096).split(b" ")[1])

    def bad_lone_surrogate(self, session) -> int:
        """A string that is not Unicode text (finding 9)."""
        body = b'{"inputs": {"user_id": ["\\ud800"], "item_ids": [["i1"]]}}'
        return session.post(f"{self.rest}/v1/models/scores:predict", data=body,
                            timeout=10).status_code

    def bad_deep_nesting(self, session) -> int:
        body = b'{"inputs": {"user_id": ' + b"[" * 70 + b'"u1"' + b"]" * 70 + \
            b', "item_ids": [["i1"]]}}'
        return session.post(f"{self.rest}/v1/models/scores:predict", data=body,
                            timeout=10).status_code

    def bad_init_op(self, session) -> int:
        body = {"signature_name": "__saved_model_init_op", "inputs": {}}
        return session.post(f"{self.rest}/v1/models/scores:predict", json=body,
                            timeout=10).status_code

    def bad_unknown_model(self, session) -> int:
        return session.post(f"{self.rest}/v1/models/nope:predict", json={"inputs": [1]},
                            timeout=10).status_code


def _shape(dims: list[int]) -> tensor_shape_pb2.TensorShapeProto:
    return tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in dims])


def _request(name: str, inputs: dict) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = name
    for key, proto in inputs.items():
        request.inputs[key].CopyFrom(proto)
    return request


def rss_bytes(pid: int) -> int:
    """Resident memory of a process."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no VmRSS for process {pid}")


def soak(seconds: float = 30.0, clients: int = 16, warmup_seconds: float = 5.0) -> dict:
    """Runs the soak (see the module docstring) and returns its report."""
    with tempfile.TemporaryDirectory(prefix="soak-") as root:   # exports, removed after
        config = build_models(root)
        child = subprocess.Popen([sys.executable, "-m", "tworec.serving.soak", "--serve", config],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            ports = json.loads(child.stdout.readline())
            expected = LoadedModel(os.path.join(root, "scores", "1"))
            Soak(ports, expected).run(clients, warmup_seconds, seed=10_000)
            start_rss = rss_bytes(child.pid)
            run = Soak(ports, expected)
            started = time.monotonic()
            run.run(clients, seconds)
            elapsed = time.monotonic() - started
            time.sleep(2.0)                 # the body and header timeouts close what is left
            end_rss = rss_bytes(child.pid)
            child.send_signal(signal.SIGTERM)
            exit_code = child.wait(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        valid = run.counts["valid_rest"] + run.counts["valid_grpc"]
        return {"seconds": round(elapsed, 1), "clients": clients, "valid_requests": valid,
                "malformed_requests": sum(run.counts.values()) - valid - run.counts["problems"],
                "requests_per_second": round(sum(run.counts.values()) / elapsed, 1),
                "problems": run.counts["problems"], "problem_examples": run.problems,
                "counts": dict(sorted(run.counts.items())),
                "rss_start_mib": round(start_rss / 2**20, 1),
                "rss_end_mib": round(end_rss / 2**20, 1),
                "rss_change": round(end_rss / start_rss - 1, 3), "server_exit_code": exit_code}


def main(argv=None) -> int:
    parser = parser_for(__doc__)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--serve", help=argparse.SUPPRESS)   # the child process
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve)
        exit_without_finalizing(0)      # finalizing would cancel the server's C++ threads
    report = soak(args.seconds, args.clients)
    print(json.dumps(report, indent=2))
    return 0 if (report["problems"] == 0 and abs(report["rss_change"]) <= 0.1
                 and report["server_exit_code"] == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
