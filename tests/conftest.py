"""Fixtures shared by several test files."""
import pytest

try:
    from _pytest.compat import ascii_escaped   # how pytest writes bytes in an id (private)
except ImportError:                            # moved: the guard below stands down
    ascii_escaped = None


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
