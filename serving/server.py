"""The embedded model server: one `ModelManager` behind TF Serving's gRPC and REST APIs.

Ports open before the models finish loading (their status says LOADING meanwhile); `start`
returns once the initial versions are AVAILABLE or given up, as TF Serving's start does. Both
APIs hand predictions to one scheduler (`batching.Direct`, or a `batching.Batcher`), so
their threads only wait for answers: status and metadata are never queued behind a model run.
At most `max_concurrent_requests` requests are served at a time on each API (REST answers 503
beyond, gRPC RESOURCE_EXHAUSTED); a REST connection must send its request head within
`header_timeout_seconds` and its body within `body_timeout_seconds`, never pausing longer than
`body_stall_seconds`; a REST client that reads none of its answer for `write_stall_seconds`, or
not all but its last 64 KiB within `write_timeout_seconds`, has its connection aborted. `stop`
(and SIGTERM or SIGINT during `wait`) stops accepting, lets requests in flight finish for
`grace_seconds`, then closes everything.
"""
from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from concurrent import futures

import grpc
import uvicorn

from tworec.serving.batching import Batcher, Direct
from tworec.serving.grpc_service import add_services
from tworec.serving.limits import BytesInFlight, default_max_request_bytes_in_flight
from tworec.serving.manager import ModelManager
from tworec.serving.protocol import INT32_MAX
from tworec.serving.rest import HeaderTimeoutProtocol, RestApp

log = logging.getLogger(__name__)


class ModelServer:
    """Serves `manager` over gRPC and REST; ports 0 pick free ones (see `grpc_port`, `rest_port`).

    Args:
        manager: the models to serve (started by `start`).
        host: the address to bind.
        grpc_port: the gRPC port, None for no gRPC.
        rest_port: the REST port, None for no REST.
        rest_timeout_seconds: a REST predict's deadline (`--rest_api_timeout_in_ms`).
        max_request_bytes: the largest REST body or gRPC message accepted.
        batcher: merges concurrent predicts (`--enable_batching`); None runs each alone on
            `predict_threads` threads. The server closes it when it stops.
        max_rows: the most rows an input of one request may have (None: from memory, see
            `limits.default_max_rows`).
        predict_threads: model runs at a time without batching.
        max_concurrent_requests: requests served at a time on each API.
        header_timeout_seconds: a REST request head must arrive within this long.
        body_timeout_seconds: a REST request body must arrive within this long.
        grace_seconds: how long `stop` lets requests in flight finish.
        max_elements: the most elements the inputs of one request may have together (None:
            from memory, see `limits.default_max_elements`).
        max_request_bytes_in_flight: the request bytes held at once over both APIs, beyond
            which a request is refused UNAVAILABLE unless nothing else, not even an unread
            answer, is held (None: from memory, see `limits.BytesInFlight`).
        body_stall_seconds: a REST request body that makes no progress for this long is
            refused, its bytes released.
        write_stall_seconds: a REST connection whose client reads none of its answer for this
            long is aborted, its unsent bytes dropped.
        write_timeout_seconds: a REST connection whose client has not taken all but the last
            64 KiB of its answer out of the server within this long is aborted, its unsent
            bytes dropped; a gRPC Predict whose answer is not sent by then is cancelled.
    """

    def __init__(self, manager: ModelManager, host: str = "127.0.0.1",
                 grpc_port: int | None = 8500, rest_port: int | None = 8501,
                 rest_timeout_seconds: float = 30.0, max_request_bytes: int = 64 << 20,
                 batcher: Batcher | None = None, max_rows: int | None = None,
                 predict_threads: int = 8, max_concurrent_requests: int = 256,
                 header_timeout_seconds: float = 10.0, body_timeout_seconds: float = 30.0,
                 grace_seconds: float = 10.0, max_elements: int | None = None,
                 max_request_bytes_in_flight: int | None = None,
                 body_stall_seconds: float = 5.0, write_stall_seconds: float = 5.0,
                 write_timeout_seconds: float = 60.0):
        self.manager = manager
        self.host = host
        self.grpc_port, self.rest_port = grpc_port, rest_port
        self._grpc = self._rest = self._rest_thread = None
        self._scheduler = batcher or Direct(predict_threads)
        self._in_flight = BytesInFlight(max_request_bytes_in_flight or
                                        default_max_request_bytes_in_flight(max_request_bytes))
        self._rest_app = RestApp(manager, self._scheduler, rest_timeout_seconds,
                                 max_request_bytes, max_rows, body_timeout_seconds,
                                 max_elements, self._in_flight, body_stall_seconds)
        self._max_request_bytes = max_request_bytes
        self._max_rows = max_rows
        self._max_elements = max_elements
        self._max_concurrent = max_concurrent_requests
        self._header_timeout_seconds = header_timeout_seconds
        self._write_stall_seconds = write_stall_seconds
        self._write_timeout_seconds = write_timeout_seconds
        self.grace_seconds = grace_seconds
        self._signals = None

    def start(self) -> "ModelServer":
        """Starts loading the models, opens the ports, and returns self once the initial
        versions are AVAILABLE. When a port cannot be opened, a model's latest version fails
        to load or a label points at a version that is not AVAILABLE (`ModelManager.
        check_started`, as TF Serving refuses to start), what was started (the ports, the
        scheduler, the model workers) is stopped and the error raised."""
        self.manager.start(wait=False)
        try:
            if self.grpc_port is not None:
                self._start_grpc()
            if self.rest_port is not None:
                self._start_rest()
            # In steps: Ctrl-C's handler runs only when the main thread runs Python, and the
            # kernel may hand SIGINT to a loading thread (an untimed wait would outlast loading).
            while not self.manager.wait_until_settled(timeout=0.1):
                pass
            self.manager.check_started()
        except BaseException:
            self._stop_after_failed_start()
            raise
        return self

    def _stop_after_failed_start(self) -> None:
        try:
            if self._grpc is not None:
                self._grpc.stop(0).wait()
            if self._rest is not None:
                self._rest.should_exit = True
                self._rest_thread.join()
        finally:
            self._grpc = self._rest = self._rest_thread = None
            self._scheduler.close()
            self.manager.stop()

    def stop(self, grace_seconds: float | None = None) -> None:
        """Stops accepting requests, lets those in flight finish within the grace period,
        then closes the scheduler and the models."""
        grace = self.grace_seconds if grace_seconds is None else grace_seconds
        stopped = self._grpc.stop(grace) if self._grpc is not None else None
        if self._rest is not None:
            self._rest.config.timeout_graceful_shutdown = grace
            self._rest.should_exit = True
            self._rest_thread.join()
        if stopped is not None:
            stopped.wait()
        self._scheduler.close()
        self.manager.stop()

    def handle_signals(self) -> None:
        """Catches SIGTERM and SIGINT from now on, for `wait` (main thread only). Call it
        before announcing the server is ready, so that a signal sent on that news is not lost
        (`wait` calls it if it was not called)."""
        if self._signals is None:
            received = threading.Event()
            previous = {sig: signal.signal(sig, lambda number, frame: received.set())
                        for sig in (signal.SIGTERM, signal.SIGINT)}
            self._signals = received, previous

    def wait(self) -> None:
        """Blocks until SIGTERM or SIGINT (Ctrl-C), then stops gracefully (see `stop`)."""
        self.handle_signals()
        received, previous = self._signals
        try:
            # A signal the kernel hands to another thread runs its Python handler only when the
            # main thread next runs Python, which an untimed wait never does. Sleep, not a timed
            # wait: the handler runs on the main thread, and its `set` would wait forever for
            # the event's lock if it came while the main thread's own `wait` held it.
            while not received.is_set():
                time.sleep(0.1)
            log.info("stopping: requests in flight get %g s to finish", self.grace_seconds)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._signals = None
            self.stop()

    def __enter__(self) -> "ModelServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start_grpc(self) -> None:
        options = [("grpc.max_receive_message_length", self._max_request_bytes),
                   ("grpc.max_send_message_length", INT32_MAX),
                   ("grpc.so_reuseport", 0)]   # a port another server holds is an error, not shared
        # One thread per call in flight: handlers only wait for the scheduler, and a status
        # call always finds a thread.
        self._grpc = grpc.server(futures.ThreadPoolExecutor(self._max_concurrent),
                                 options=options, maximum_concurrent_rpcs=self._max_concurrent)
        add_services(self._grpc, self.manager, self._scheduler, self._max_rows,
                     self._max_elements, self._in_flight, self._write_timeout_seconds)
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
        try:
            sock.bind((self.host, self.rest_port))
        except OSError:
            sock.close()
            raise
        self.rest_port = sock.getsockname()[1]
        config = uvicorn.Config(self._rest_app, log_level="warning", lifespan="off",
                                access_log=False, http=HeaderTimeoutProtocol,
                                timeout_graceful_shutdown=self.grace_seconds)
        config.header_timeout_seconds = self._header_timeout_seconds
        config.write_stall_seconds = self._write_stall_seconds
        config.write_timeout_seconds = self._write_timeout_seconds
        config.max_concurrent_requests = self._max_concurrent   # answered in JSON by RestApp
        self._rest = uvicorn.Server(config)
        self._rest_thread = threading.Thread(target=self._rest.run, kwargs={"sockets": [sock]},
                                             name="rest-server", daemon=True)
        self._rest_thread.start()
        while not self._rest.started:
            if not self._rest_thread.is_alive():
                raise OSError(f"the REST server did not start on {self.host}:{self.rest_port}")
            time.sleep(0.01)
