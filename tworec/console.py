"""What a command-line run shows: native library log lines (absl and glog style, as ScaNN's
partitioner and TensorFlow's graph passes write them straight to file descriptor 2) are
dropped unless verbose, and Keras progress is one line per epoch when output is not a terminal.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import re
import sys
import threading
from typing import NoReturn

# `I1202 18:28:05.56 123 file.cc:42] ...` (absl/glog INFO or WARNING), and absl's banner.
NATIVE_NOISE = re.compile(rb"^([IW]\d{4} [\d:.]+ +\d+ [\w./-]+:\d+\]|"
                          rb"WARNING: All log messages before absl::InitializeLog\(\))")


class NativeLogFilter:
    """Routes file descriptor 2 through a pipe and a thread that drops native INFO and WARNING
    log lines and passes everything else (Python's stderr, errors, crashes' messages) on as it
    arrives. `stop` puts file descriptor 2 back and ends the thread."""

    def __init__(self):
        self.original = os.dup(2)
        self.stopped = False
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)                  # file descriptor 2 is now the pipe's only writer
        self.thread = threading.Thread(target=self._forward, args=(read_end,),
                                       name="native-log-filter", daemon=True)
        self.thread.start()

    def _forward(self, read_end: int) -> None:
        try:
            with os.fdopen(read_end, "rb", buffering=0) as pipe:
                for line in iter(pipe.readline, b""):
                    if not NATIVE_NOISE.match(line):
                        os.write(self.original, line)
        finally:                             # only once nothing can write to the pipe any more
            os.close(self.original)

    def stop(self) -> None:
        """Puts file descriptor 2 back. The thread ends when the pipe's last writer closes: at
        once, or when a child process that inherited it exits."""
        if self.stopped:
            return
        self.stopped = True
        if sys.stderr is not None:
            sys.stderr.flush()
        os.dup2(self.original, 2)
        self.thread.join(timeout=2)


_process_filter: NativeLogFilter | None = None       # a script's, for the whole process
_block_filter: NativeLogFilter | None = None         # `quiet_native_logs`', while a block runs
_blocks = 0
_lock = threading.Lock()


def filter_native_logs() -> None:
    """Filters native log lines out of file descriptor 2 for the rest of the process (the
    scripts that train or score call it unless verbose; not serve.py, where a crash's last
    lines, still in the pipe, would be lost)."""
    global _process_filter
    with _lock:
        if _process_filter is None:          # inside a `quiet_native_logs` block: keep its filter
            _process_filter = _block_filter or NativeLogFilter()
            atexit.register(_process_filter.stop)


@contextlib.contextmanager
def quiet_native_logs():
    """Within the block, drops the native INFO and WARNING lines (ScaNN's partitioner, absl's
    banner) that C++ code writes to file descriptor 2, for library users who have no
    `filter_native_logs`; everything else passes as it is written. Blocks may overlap across
    threads (the filter stays until the last ends). A no-op when verbose, when the process-wide
    filter is on, or when file descriptor 2 is closed."""
    import tworec
    global _block_filter, _blocks
    with _lock:
        active = not (tworec.verbose_requested() or _process_filter is not None)
        if active and _blocks == 0:
            try:
                _block_filter = NativeLogFilter()
            except OSError:                  # no file descriptor 2 to filter
                active = False
        _blocks += active
    try:
        yield
    finally:
        with _lock:
            _blocks -= active
            if active and _blocks == 0:
                if _block_filter is not _process_filter:
                    _block_filter.stop()
                _block_filter = None


def is_terminal() -> bool:
    return sys.stdout.isatty()


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose mistakes end with one line, `error: ...`, and exit code 2
    (argparse's own prints the usage first)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def one_line(error: BaseException) -> str:
    """An exception as one line, `Type: cause`: the first line of its message, or the last
    when the first only introduces the rest (TensorFlow's op errors open with "Graph
    execution error:" and end with the cause)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    return f"{type(error).__name__}: {lines[-1] if lines[0].endswith(':') else lines[0]}"


def parser_for(doc: str) -> OneLineParser:
    """A command's parser, described by the first paragraph of its docstring."""
    return OneLineParser(description=" ".join(doc.split("\n\n")[0].split()))


def exit_without_finalizing(code: int) -> NoReturn:
    """Ends the process with `code` once stdout, stderr and logging are flushed, skipping the
    interpreter's finalization. After a server has stopped, gRPC and TensorFlow may still hold
    threads blocked in C++; finalization cancels them and the cancellation aborts the process
    ("terminate called after throwing an instance of ''", exit -6) about one run in three.
    The native-log filter, an exit handler finalization would run, is stopped first so that
    every line already written reaches the real stderr."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if _process_filter is not None:
        _process_filter.stop()
    os._exit(code)
