"""What a run and a library user see: native log lines dropped, everything else kept."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tworec import console

NOISE = (b"I0000 00:00:1796246462.994831   25985 partitioner_factory_base.cc:58] Size of sampled\n"
         b"W0000 00:00:1796246462.995484   25985 gmm_utils.cc:1026] Could not normalize\n"
         b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n")


def stderr_once_it_holds(capfd, text: str, seconds: float = 5.0) -> str:
    """What reached stderr by the time it holds `text` (the filter forwards from a thread)."""
    deadline, said = time.monotonic() + seconds, ""
    while text not in said and time.monotonic() < deadline:
        said += capfd.readouterr().err
        time.sleep(0.01)
    return said


@pytest.fixture
def library_user(monkeypatch):
    """A process without the scripts' fd filter and without TWOREC_VERBOSE."""
    monkeypatch.setattr(console, "_process_filter", None)
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


def test_quiet_native_logs_passes_other_output_on_as_it_is_written(library_user, capfd):
    with console.quiet_native_logs():
        os.write(2, NOISE + b"an error, now\n")
        assert stderr_once_it_holds(capfd, "an error, now") == "an error, now\n"   # in the block


def test_overlapping_blocks_in_two_threads_leave_stderr_as_it_was(library_user, capfd):
    before = os.fstat(2).st_ino
    first_entered, second_entered = threading.Event(), threading.Event()

    def first():
        with console.quiet_native_logs():
            first_entered.set()
            second_entered.wait(5)
            os.write(2, NOISE + b"first\n")
        # the second block is still open: its lines are still filtered
        os.write(2, NOISE.splitlines(keepends=True)[0])

    def second():
        first_entered.wait(5)
        with console.quiet_native_logs():
            second_entered.set()
            time.sleep(0.2)
            os.write(2, b"second\n")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert os.fstat(2).st_ino == before
    os.write(2, b"after\n")
    assert sorted(capfd.readouterr().err.splitlines()) == ["after", "first", "second"]


def test_building_a_scann_index_prints_nothing(library_user, capfd):
    from tworec.retrieval.index import ScannParams, build_index
    candidates = np.random.default_rng(0).random((500, 8), dtype=np.float32)
    build_index(candidates, 10, ScannParams(num_leaves=10, num_leaves_to_search=3,
                                            num_reordering_candidates=20))
    assert capfd.readouterr().err == ""


def test_a_child_process_holding_the_pipe_never_writes_into_a_reused_descriptor(library_user,
                                                                                tmp_path):
    """A child started inside a block keeps the pipe open past the block: its later output
    must still reach the real stderr, never a file that took the freed descriptor number."""
    import subprocess
    import sys
    with console.quiet_native_logs():
        child = subprocess.Popen([sys.executable, "-c", "import time, os; time.sleep(2.5); "
                                  "os.write(2, b'child line\\n')"])
    victim = open(tmp_path / "victim.txt", "wb")             # may get a freed descriptor
    child.wait(timeout=30)
    time.sleep(0.2)
    victim.close()
    assert (tmp_path / "victim.txt").read_bytes() == b""


def test_the_process_filter_installed_inside_a_block_stays(library_user, capfd, monkeypatch):
    monkeypatch.setattr(console, "_block_filter", None)
    with console.quiet_native_logs():
        console.filter_native_logs()
    os.write(2, NOISE + b"kept\n")
    assert stderr_once_it_holds(capfd, "kept") == "kept\n"
    console._process_filter.stop()
    monkeypatch.setattr(console, "_process_filter", None)


def test_exiting_without_finalizing_keeps_the_exit_code_and_every_filtered_line():
    """The servers' exit: every line written to the filtered stderr before it arrives."""
    code = ("import os; from tworec import console; console.filter_native_logs()\n"
            "for n in range(2000): os.write(2, b'line %d\\n' % n)\n"
            "console.exit_without_finalizing(3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert done.returncode == 3
    assert done.stderr.decode().splitlines() == [f"line {n}" for n in range(2000)]


@pytest.mark.parametrize("message, expected", [
    ("out of memory\nwhere it happened", "RuntimeError: out of memory"),
    ("Graph execution error:\n\nDetected at node x\n  shapes differ\n",
     "RuntimeError: shapes differ"),
    ("", "RuntimeError: "),
])
def test_an_error_is_one_line_of_its_type_and_cause(message, expected):
    assert console.one_line(RuntimeError(message)) == expected


def test_a_commands_help_gives_its_docstrings_whole_first_paragraph():
    doc = """Trains the model and evaluates it alone and as
    the second stage.

        python scripts/x.py --out RUN
    """
    assert console.parser_for(doc).description == ("Trains the model and evaluates it alone and "
                                                   "as the second stage.")
