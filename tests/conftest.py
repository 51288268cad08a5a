"""Fixtures shared by several test files."""
import os
import subprocess
import sys

import pytest

try:
    from _pytest.compat import ascii_escaped   # how pytest writes bytes in an id (private)
except ImportError:                            # moved: the guard below stands down
    ascii_escaped = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def offline(monkeypatch) -> list:
    """No host can be reached and no proxy is set; returns the (host, port) pairs tried."""
    import socket
    tried = []

    def unreachable(address, timeout=None):
        tried.append(address)
        raise socket.gaierror(-2, "Name or service not known")
    monkeypatch.setattr(socket, "create_connection", unreachable)
    for proxy in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    return tried


@pytest.fixture(scope="session")
def retrieval_run(tmp_path_factory):
    """A run folder of train_retrieval.py on the tiny synthetic log, two retrieval members
    (retrieval, baselines, index, retrieval exports, report); tests that change it copy it
    first."""
    out = tmp_path_factory.mktemp("retrieval_run")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_retrieval.py"),
                           "--data", "synthetic:tiny", "--preset", "tiny", "--members", "2",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return out


def pytest_collection_modifyitems(items):
    """Refuse test ids that pytest made from bytes: each xdist worker collects on its own, and
    an id made from bytes (a gzip header holds the time it was made) can differ between them,
    which stops the whole run. Name such cases with parametrize's ids=."""
    for item in items if ascii_escaped else ():
        callspec = getattr(item, "callspec", None)
        values = callspec.params.values() if callspec else ()
        if any(isinstance(value, bytes) and value and ascii_escaped(value) in callspec.id
               for value in values):
            raise pytest.UsageError(f"{item.nodeid}: a test id made from bytes; name the case "
                                    "with parametrize's ids=")
