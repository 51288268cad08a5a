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


# The files that take longest, longest first (`--durations=0` summed per file, 2 workers).
# `make test` gives each worker the next file in collection order when it is nearly done
# (`--dist loadfile --no-loadscope-reorder`): the long files start first and the short ones
# fill the end, so the two workers end together (xdist's own order, by number of tests, left
# the slowest files last: simulated on the same durations, 26 s longer). A file not named
# runs after these: a new slow one belongs here.
SLOWEST_FIRST = ("test_pipeline.py", "test_retrieval.py", "test_compare.py", "test_ranking.py",
                 "test_readme.py", "test_retrieval_distributed.py", "test_resume.py",
                 "test_parameter_server.py", "test_scripts_serving.py", "test_run_folder.py",
                 "test_serving_abuse.py", "test_stream.py", "test_serving.py", "test_report.py",
                 "test_prepare.py", "test_features.py", "test_shards.py")


def pytest_collection_modifyitems(items):
    """Puts the slowest files first (`SLOWEST_FIRST`; the others after, as collected), and
    refuses test ids that pytest made from bytes: each xdist worker collects on its own, and
    an id made from bytes (a gzip header holds the time it was made) can differ between them,
    which stops the whole run. Name such cases with parametrize's ids=."""
    rank = {name: place for place, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items if ascii_escaped else ():
        callspec = getattr(item, "callspec", None)
        values = callspec.params.values() if callspec else ()
        if any(isinstance(value, bytes) and value and ascii_escaped(value) in callspec.id
               for value in values):
            raise pytest.UsageError(f"{item.nodeid}: a test id made from bytes; name the case "
                                    "with parametrize's ids=")
