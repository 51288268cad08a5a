"""What a run and a library user see: native log lines dropped, everything else kept."""
import os

import numpy as np
import pytest

from tworec import console

NOISE = (b"I0000 00:00:1796246462.994831   25985 partitioner_factory_base.cc:58] Size of sampled\n"
         b"W0000 00:00:1796246462.995484   25985 gmm_utils.cc:1026] Could not normalize\n"
         b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n")


@pytest.fixture
def library_user(monkeypatch):
    """A process without the scripts' fd filter and without TWOREC_VERBOSE."""
    monkeypatch.setattr(console.filter_native_logs, "installed", False, raising=False)
    monkeypatch.delenv("TWOREC_VERBOSE", raising=False)


def test_quiet_native_logs_drops_native_lines_and_keeps_the_rest(library_user, capfd):
    with console.quiet_native_logs():
        os.write(2, NOISE + b"E0000 a real error stays\nplain text stays\n")
    assert capfd.readouterr().err == "E0000 a real error stays\nplain text stays\n"


def test_quiet_native_logs_keeps_everything_when_verbose(library_user, capfd, monkeypatch):
    monkeypatch.setenv("TWOREC_VERBOSE", "1")
    with console.quiet_native_logs():
        os.write(2, NOISE)
    assert capfd.readouterr().err == NOISE.decode()


def test_quiet_native_logs_passes_output_on_when_the_block_fails(library_user, capfd):
    with pytest.raises(RuntimeError):
        with console.quiet_native_logs():
            os.write(2, NOISE + b"said before failing\n")
            raise RuntimeError("boom")
    assert capfd.readouterr().err == "said before failing\n"


def test_building_a_scann_index_prints_nothing(library_user, capfd):
    from tworec.retrieval.index import ScannParams, build_index
    candidates = np.random.default_rng(0).random((500, 8), dtype=np.float32)
    build_index(candidates, 10, ScannParams(num_leaves=10, num_leaves_to_search=3,
                                            num_reordering_candidates=20))
    assert capfd.readouterr().err == ""
