"""The embedded model server: one `ModelManager` behind TF Serving's gRPC and REST APIs."""
from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
import uvicorn

from tworec.serving.batching import Batcher, run_directly
from tworec.serving.grpc_service import add_services
from tworec.serving.manager import ModelManager
from tworec.serving.rest import RestApp

INT32_MAX = 2**31 - 1


class ModelServer:
    """Serves `manager` over gRPC and REST; ports 0 pick free ones (see `grpc_port`, `rest_port`).

    Args:
        manager: the models to serve (started by `start`).
        host: the address to bind.
        grpc_port: the gRPC port, None for no gRPC.
        rest_port: the REST port, None for no REST.
        rest_timeout_seconds: REST requests running longer answer DEADLINE_EXCEEDED.
        max_request_bytes: the largest REST body or gRPC message accepted.
        grpc_threads: worker threads of the gRPC server.
        batcher: merges concurrent predicts (`--enable_batching`); None runs each alone.
    """

    def __init__(self, manager: ModelManager, host: str = "127.0.0.1",
                 grpc_port: int | None = 8500, rest_port: int | None = 8501,
                 rest_timeout_seconds: float = 30.0, max_request_bytes: int = INT32_MAX,
                 grpc_threads: int = 8, batcher: Batcher | None = None):
        self.manager = manager
        self.host = host
        self.grpc_port, self.rest_port = grpc_port, rest_port
        self._grpc = self._rest = self._rest_thread = None
        self._rest_timeout_seconds = rest_timeout_seconds
        self._max_request_bytes = max_request_bytes
        self._grpc_threads = grpc_threads
        self._run = batcher or run_directly

    def start(self) -> "ModelServer":
        """Loads the models, then opens the ports; returns self once both answer."""
        self.manager.start()
        if self.grpc_port is not None:
            self._start_grpc()
        if self.rest_port is not None:
            self._start_rest()
        return self

    def stop(self) -> None:
        if self._rest is not None:
            self._rest.should_exit = True
            self._rest_thread.join()
        if self._grpc is not None:
            self._grpc.stop(grace=1).wait()
        self.manager.stop()

    def wait(self) -> None:
        """Blocks until interrupted (Ctrl-C), then stops."""
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def __enter__(self) -> "ModelServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start_grpc(self) -> None:
        options = [("grpc.max_receive_message_length", self._max_request_bytes),
                   ("grpc.max_send_message_length", INT32_MAX)]
        self._grpc = grpc.server(futures.ThreadPoolExecutor(self._grpc_threads),
                                 options=options)
        add_services(self._grpc, self.manager, self._run)
        self.grpc_port = self._grpc.add_insecure_port(f"{self.host}:{self.grpc_port}")
        if not self.grpc_port:
            raise OSError(f"cannot bind the gRPC port on {self.host}")
        self._grpc.start()

    def _start_rest(self) -> None:
        # proto IPPROTO_TCP makes asyncio set TCP_NODELAY on every accepted connection; with
        # proto 0 it does not, and each response waits ~40 ms for the client's delayed ACK.
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET,
                             socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((self.host, self.rest_port))
        self.rest_port = sock.getsockname()[1]
        app = RestApp(self.manager, self._rest_timeout_seconds, self._max_request_bytes,
                      self._run)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._rest = uvicorn.Server(config)
        self._rest_thread = threading.Thread(target=self._rest.run, kwargs={"sockets": [sock]},
                                             name="rest-server", daemon=True)
        self._rest_thread.start()
        while not self._rest.started:
            if not self._rest_thread.is_alive():
                raise OSError(f"the REST server did not start on {self.host}:{self.rest_port}")
            time.sleep(0.01)
