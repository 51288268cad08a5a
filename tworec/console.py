"""What a command-line run shows: native library log lines (absl and glog style, as ScaNN's
partitioner and TensorFlow's graph passes write them straight to file descriptor 2) are
dropped unless verbose, and Keras progress is one line per epoch when output is not a terminal.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
import tempfile
import threading

# `I1202 18:28:05.56 123 file.cc:42] ...` (absl/glog INFO or WARNING), and absl's banner.
NATIVE_NOISE = re.compile(rb"^([IW]\d{4} [\d:.]+ +\d+ [\w./-]+:\d+\]|"
                          rb"WARNING: All log messages before absl::InitializeLog\(\))")


def filter_native_logs() -> None:
    """Routes file descriptor 2 through a thread that drops native INFO and WARNING log lines
    and passes everything else (Python's stderr, errors, crashes' messages) on unchanged."""
    if getattr(filter_native_logs, "installed", False):
        return
    original = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            for line in iter(pipe.readline, b""):
                if not NATIVE_NOISE.match(line):
                    os.write(original, line)

    thread = threading.Thread(target=forward, name="native-log-filter", daemon=True)
    thread.start()

    def restore() -> None:
        sys.stderr.flush()
        os.dup2(original, 2)                 # the pipe's last writer closes: the thread ends
        thread.join(timeout=2)

    atexit.register(restore)
    filter_native_logs.installed = True


@contextlib.contextmanager
def quiet_native_logs():
    """Within the block, drops the native INFO and WARNING lines (ScaNN's partitioner, absl's
    banner) that C++ code writes to file descriptor 2, for library users who have no
    `filter_native_logs`; anything else written meanwhile is passed on when the block ends.
    A no-op when verbose or when the process-wide filter is on."""
    import tworec
    if tworec.verbose_requested() or getattr(filter_native_logs, "installed", False):
        yield
        return
    sys.stderr.flush()
    original = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(original, 2)
            os.close(original)
            captured.seek(0)
            kept = b"".join(line for line in captured if not NATIVE_NOISE.match(line))
            if kept:
                os.write(2, kept)


def is_terminal() -> bool:
    return sys.stdout.isatty()
