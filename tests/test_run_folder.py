"""What a run folder refuses before any training: a continued run on a log that changed in any
column it reads, on a folder made before runs fingerprinted every column, or on a folder whose
retrieval stage did not finish; flags a continued run would ignore; and `--data-dir` anywhere
but with a TFDS source (with one, it reaches TFDS)."""
import dataclasses
import hashlib
import json
import os
import runpy

import numpy as np
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from tworec.features import DataError, load
from tworec.pipeline import config, folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = {"user": "user", "item": "item", "time": "time", "rating": "rating",
           "user.age": "age", "item.color": "color"}
USERS, ITEMS, ROWS_PER_USER = 30, 12, 8


def write_log(path, changed: str | None = None) -> str:
    """A CSV log with ratings, a user feature `age` (u0's first row is a year younger) and an
    item feature `color`; `changed` ("age", "color" or "rating") gives the same rows with that
    column's values moved around, "earlier age" with u0's second row a year younger too."""
    rng = np.random.default_rng(0)
    users = np.repeat(np.arange(USERS), ROWS_PER_USER)
    items = np.concatenate([rng.choice(ITEMS, ROWS_PER_USER, replace=False)
                            for _ in range(USERS)])
    ratings = rng.integers(1, 6, len(users))
    ages, colors = rng.integers(18, 70, USERS), rng.choice(["red", "blue", "green"], ITEMS)
    if changed == "age":
        ages = np.roll(ages, 1)                       # the same ages, other users
    elif changed == "color":
        colors = np.roll(colors, 1)
    elif changed == "rating":
        ratings = np.random.default_rng(1).permutation(ratings)
    row_ages = ages[users]
    row_ages[:2 if changed == "earlier age" else 1] -= 1
    lines = ["user,item,time,rating,age,color"] + [
        f"u{user},i{item},{row},{rating},{row_ages[row]},{colors[item]}"
        for row, (user, item, rating) in enumerate(zip(users, items, ratings))]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def trained_run(out, log: str, report: bool = True, columns: dict = COLUMNS,
                recorded: dict | None = None, split: str = "temporal") -> None:
    """Writes what a finished retrieval run on `log` with `columns` and `split` leaves for a
    continued run to check: config.json (with the log's fingerprint, a chosen cold-start window
    and the source's fields replaced by `recorded`) and, with `report`, a report.json with
    retrieval's results and a retrieval export's version folder."""
    checked = folder.check_run(str(out), {"data": log, "columns": columns},
                               config.resolve("tiny", data={"split": split}))
    configs = checked.configs
    configs = dataclasses.replace(configs, data=dataclasses.replace(configs.data,
                                                                    cold_start_window=1.0))
    os.makedirs(out)
    config.write(os.path.join(out, "config.json"), configs, {**checked.source, **(recorded or {})})
    if report:
        (out / "report.json").write_text(json.dumps({"data": {"outside_catalogue": 0},
                                                     "retrieval": {"test": None}}))
        os.makedirs(out / "export" / "retrieval" / "1")


def continue_run(out) -> folder.CheckedRun:
    """`check_run` as `train_ranking.py --retrieval-run OUT` calls it."""
    source, saved = folder.read_run(str(out))
    return folder.check_run(str(out), source, config.resolve(base=saved), continue_run=True)


@pytest.mark.parametrize("source, message", [
    ("log.csv", "the source must be a dict with 'data'"),
    ({"source": "log.csv"}, "the source must be a dict with 'data'"),
    ({"data": "synthetic:tiny", "colums": {"user": "uid"}},
     r"the source has keys \['colums'\] that nothing reads; it takes \['data', 'columns', "),
    ({"data": "synthetic:tiny", "columns": "user=uid"}, "the source's 'columns' must map roles")])
def test_a_source_the_run_would_not_read_whole_is_refused_in_one_line(tmp_path, source, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        folder.check_run(str(tmp_path / "run"), source, config.resolve("tiny"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("verbose", [0, 1])
def test_a_library_run_with_verbose_0_prints_nothing(tmp_path, capsys, verbose):
    from tworec.pipeline import prepare_run
    run = prepare_run(str(tmp_path / "run"), {"data": "synthetic:tiny"}, config.resolve("tiny"),
                      verbose=verbose)
    with run.step("a step"):
        run.notice("a notice")
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed] == \
        (["[run] a step ...", "[run] note", "[run] a step"] if verbose else [])
    assert run.report["notices"] == ["a notice"]


def test_a_batch_larger_than_the_training_rows_is_lowered_with_a_notice(tmp_path):
    """An epoch trains on whole batches: a batch above the training rows would train nothing
    (and failed once the run had started). It is lowered before anything is written, as the
    item counts are, so the same command resumes an interrupted run of it."""
    configs = config.resolve("tiny")
    configs = dataclasses.replace(configs, retrieval=dataclasses.replace(configs.retrieval,
                                                                         batch_size=512))
    checked = folder.check_run(str(tmp_path / "run"), {"data": write_log(tmp_path / "log.csv"),
                                                       "columns": COLUMNS}, configs)
    train_rows = USERS * (ROWS_PER_USER - 2)          # each user's last two rows held out
    assert len(checked.parts.train) == train_rows
    assert checked.configs.retrieval.batch_size == train_rows
    assert checked.notices[-1] == f"batch_size 512 lowered to the training rows, {train_rows}"
    assert ("item features ['color'] are not read: the models read genres and year, and the "
            "ranker title") in checked.notices
    assert ("user features ['age'] change within a user: training and validation read each "
            "user's value of their last training row, the test rows and the exports that of "
            "their last training or validation row, never a later one") in checked.notices
    assert not any("batch_size" in notice for notice in checked.notices[:-1])
    assert not (tmp_path / "run").exists()
    random = dataclasses.replace(configs, data=dataclasses.replace(configs.data, split="random"))
    checked = folder.check_run(str(tmp_path / "run"), {"data": write_log(tmp_path / "log.csv"),
                                                       "columns": COLUMNS}, random)
    assert ("user features ['age'] change within a user: every row reads its user's value of "
            "their last training row, which under `random` can be later than a test row"
            ) in checked.notices


def test_gpu_settings_on_a_machine_without_one_are_noticed(tmp_path, monkeypatch):
    """XLA and mixed precision train slower on a CPU (train_retrieval.py on synthetic:tiny:
    207 s against 10 s with --jit-compile, 15 s with --mixed-precision): a run says so when
    it has no GPU."""
    import tensorflow as tf
    configs = config.resolve("tiny")
    configs = dataclasses.replace(
        configs, retrieval=dataclasses.replace(configs.retrieval, jit_compile=True),
        ranking=dataclasses.replace(configs.ranking, mixed_precision=True))
    source = {"data": write_log(tmp_path / "log.csv"), "columns": COLUMNS}
    notice = ("--jit-compile and --mixed-precision are for a GPU and this machine has none: on "
              "a CPU they train slower, not faster (leave them out here)")
    assert notice in folder.check_run(str(tmp_path / "run"), source, configs).notices
    jit_only = dataclasses.replace(configs, ranking=config.resolve("tiny").ranking)
    assert ("--jit-compile is for a GPU and this machine has none: on a CPU it trains slower, "
            "not faster (leave it out here)") in folder.check_run(
        str(tmp_path / "run"), source, jit_only).notices
    assert folder.gpu_settings_without_gpu(jit_only, continue_run=True) == []   # no retrieval
    assert not any("GPU" in notice for notice in folder.check_run(
        str(tmp_path / "run"), source, config.resolve("tiny")).notices)
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind: ["a GPU"])
    assert notice not in folder.check_run(str(tmp_path / "run"), source, configs).notices


def test_train_ranking_takes_the_gpu_flags_the_notice_of_a_continued_run_names(tmp_path,
                                                                             monkeypatch):
    """A continued run is told to leave out the ranker's --jit-compile and --mixed-precision:
    `train_ranking.py --retrieval-run` takes both, and sets them for ranking alone."""
    import tensorflow as tf
    from tworec.pipeline import cli
    given = {}
    monkeypatch.setattr(cli, "run", lambda args, steps, **kwargs: given.update(kwargs) or 0)
    main = runpy.run_path(os.path.join(ROOT, "scripts", "train_ranking.py"))["main"]
    assert main(["--retrieval-run", str(tmp_path), "--jit-compile", "--mixed-precision"]) == 0
    assert given == {"continue_run": True,
                     "ranking": {"jit_compile": True, "mixed_precision": True}}
    configs = config.resolve("tiny")
    configs = dataclasses.replace(configs, ranking=dataclasses.replace(
        configs.ranking, jit_compile=True, mixed_precision=True))
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind: [])
    assert folder.gpu_settings_without_gpu(configs, continue_run=True) == [
        "--jit-compile and --mixed-precision are for a GPU and this machine has none: on a CPU "
        "they train slower, not faster (leave them out here)"]


def test_a_continued_run_says_whose_ranking_config_it_trains_with(tmp_path):
    """train_ranking.py --retrieval-run RUN trains with RUN's ranking config (a BST trained
    there before trains again without --model), and says so."""
    trained_run(tmp_path / "run", write_log(tmp_path / "log.csv"))
    ranking = config.resolve("tiny").ranking
    assert (
        f"the ranking config is {tmp_path / 'run'}'s (config.json), with the flags given in "
        f"place of its fields: model dcn, task listwise, epochs {ranking.epochs}, co-occurrence "
        f"neighbours 0, popularity periods {ranking.popularity_periods}, title neighbours "
        f"{ranking.title_neighbors}, title candidates {ranking.title_candidates}"
    ) in continue_run(tmp_path / "run").notices


@pytest.mark.parametrize("source", ["log.csv", "shards/part-*.parquet"])
def test_a_continued_run_from_another_folder_says_its_log_path_is_relative(tmp_path,
                                                                         monkeypatch, source):
    """config.json keeps the --data path as given; from another working folder a relative one
    is not found, and the message says why (it named only a path the user never typed)."""
    made_here = tmp_path / "made_here"
    (made_here / "shards").mkdir(parents=True)
    write_log(made_here / "log.csv")
    pq.write_table(pacsv.read_csv(made_here / "log.csv"), made_here / "shards" / "part-0.parquet")
    monkeypatch.chdir(made_here)
    trained_run(tmp_path / "run", source)
    continue_run(tmp_path / "run")                               # from where it was made
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as error:
        continue_run(tmp_path / "run")
    assert str(error.value).startswith((f"{source}: no such file", f"{source}: no file matches"))
    assert str(error.value).endswith(
        f"; {tmp_path / 'run' / 'config.json'} holds {source} as given, relative to the folder "
        "the run was made from: run the command from there")


def test_a_run_that_recorded_columns_its_source_never_read_continues(tmp_path):
    """Before --columns was refused for sources with fixed columns, a run could record them;
    they were never read, and its folder still continues, with no columns."""
    trained_run(tmp_path / "run", "synthetic:tiny", columns={},
                recorded={"columns": {"user": "customer"}})
    continued = continue_run(tmp_path / "run")
    assert continued.source["columns"] == {} and continued.log.num_users > 0


@pytest.mark.parametrize("changed", ["age", "earlier age", "color", "rating"])
def test_a_continued_run_refuses_a_log_whose_features_or_ratings_changed(tmp_path, changed):
    log = write_log(tmp_path / "log.csv")
    trained_run(tmp_path / "run", log)
    assert continue_run(tmp_path / "run").log.num_users == USERS        # unchanged: accepted
    write_log(tmp_path / "log.csv", changed)
    with pytest.raises(folder.RunFolderError, match="now gives another log than the run was"
                       ) as error:
        continue_run(tmp_path / "run")
    assert "a release's ratings" not in str(error.value)            # a generic log's order stays


@pytest.mark.parametrize("interrupted", [False, True])
def test_a_folder_fingerprinted_by_an_older_version_is_not_continued_or_resumed(tmp_path,
                                                                                interrupted):
    """An older fingerprint left out ratings and side features: it cannot vouch for them,
    neither for a continued run nor for an interrupted retrieval training rerun."""
    log, out = write_log(tmp_path / "log.csv"), tmp_path / "run"
    trained_run(out, log, report=not interrupted)
    values = json.loads((out / "config.json").read_text())
    del values["source"]["fingerprint"]["format"]
    (out / "config.json").write_text(json.dumps(values))
    (out / "checkpoints" / "retrieval").mkdir(parents=True)
    with pytest.raises(folder.RunFolderError, match="made before runs fingerprinted the log's"):
        if interrupted:             # the command that started it, run again
            folder.check_run(str(out), {"data": log, "columns": COLUMNS}, config.resolve("tiny"))
        else:
            continue_run(out)


def test_the_fingerprint_tells_text_from_other_values():
    """Object columns are digested with each value's type: None, 1 and "None", "1" differ."""
    def digest(values) -> str:
        sha = hashlib.sha256()
        folder.add_column(sha, np.array(values, dtype=object))
        return sha.hexdigest()
    assert digest([None, 1]) != digest(["None", "1"])
    assert digest(["a", "b"]) == digest(["a", "b"]) != digest(["b", "a"])


@pytest.fixture
def script(monkeypatch, capsys):
    """Runs scripts/NAME.py's main in this process (without the process-wide native log
    filter); returns its exit code and its stderr."""
    from tworec import console
    monkeypatch.setattr(console, "filter_native_logs", lambda: None)

    def run(name: str, *args: str) -> tuple[int, str]:
        code = runpy.run_path(os.path.join(ROOT, "scripts", name))["main"](list(args))
        return code, capsys.readouterr().err
    return run


def test_a_continued_run_refuses_a_folder_whose_retrieval_stage_did_not_finish(tmp_path, script):
    """A pipeline that failed after training retrieval leaves no report.json: ranking trained
    on it would report no retrieval, baselines or index and export no retrieval."""
    trained_run(tmp_path / "run", write_log(tmp_path / "log.csv"), report=False)
    code, error = script("train_ranking.py", "--retrieval-run", str(tmp_path / "run"))
    assert code == 2 and "its retrieval stage did not finish" in error, error
    assert error.strip().endswith("; rerun the command that started it to resume its training")
    assert len(error.strip().splitlines()) == 1, error


@pytest.mark.parametrize("flag", [["--keep-seen"], ["--overwrite"], ["--data-dir", "tfds"]])
def test_a_continued_run_refuses_the_flags_it_would_ignore(tmp_path, script, flag):
    trained_run(tmp_path / "run", write_log(tmp_path / "log.csv"))
    code, error = script("train_ranking.py", "--retrieval-run", str(tmp_path / "run"), *flag)
    assert code == 2 and f"leave out {flag[0]}" in error, error
    assert len(error.strip().splitlines()) == 1, error


def test_data_dir_reaches_tfds_and_is_refused_for_other_sources(tmp_path, script, monkeypatch):
    """TFDS cannot download here: its load records where it was asked to look and fails, as
    it does offline; the message says what to pass."""
    import tensorflow_datasets as tfds
    from tworec.features import sources
    asked = []
    monkeypatch.setattr(sources, "_check_download_host", lambda *args: None)

    def offline_load(name, **kwargs):
        asked.append(kwargs.get("data_dir"))
        raise ConnectionError("no network")
    monkeypatch.setattr(tfds, "load", offline_load)
    code, error = script("train_retrieval.py", "--data", "tfds:movielens/100k-ratings",
                         "--data-dir", str(tmp_path / "tfds"), "--out", str(tmp_path / "run"))
    assert code == 2 and asked == [str(tmp_path / "tfds")], error
    assert "pass its data directory with --data-dir" in error
    assert len(error.strip().splitlines()) == 1, error
    with pytest.raises(DataError, match="--data-dir .*: .* is not a TensorFlow Datasets source"):
        load(write_log(tmp_path / "log.csv"), columns=COLUMNS, data_dir=str(tmp_path / "tfds"))


def test_a_refused_command_leaves_no_folder_behind(tmp_path, script):
    """The folder is locked (and so made) before it is checked; a command refused before
    anything is written removes what it made."""
    code, error = script("train_retrieval.py", "--data", str(tmp_path / "missing.csv"),
                         "--out", str(tmp_path / "runs" / "first"))
    assert code == 2 and "missing.csv" in error, error
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("command", [["train_ranking.py", "--retrieval-run", "RUN"],
                                     ["train_retrieval.py", "--out", "RUN"]])
def test_a_command_into_a_folder_another_runs_into_is_refused_first(tmp_path, script, command):
    """The lock is taken before the folder is read: the answer is that another process runs
    into it, not advice (`--overwrite`, a finished retrieval) drawn from a folder in flux."""
    trained_run(tmp_path / "run", write_log(tmp_path / "log.csv"))
    with folder.only_run_into(str(tmp_path / "run")):
        code, error = script(*[str(tmp_path / "run") if word == "RUN" else word
                               for word in command])
    assert code == 2 and "another process is running into this folder" in error, error
    assert len(error.strip().splitlines()) == 1, error


def test_an_interrupted_retrieval_run_resumes_when_its_command_is_rerun(tmp_path, script,
                                                                        monkeypatch):
    """The folder holds config.json and a checkpoint: the same command resumes after the last
    finished epoch; another config is refused in one line, before any training, and so is the
    same command while another process runs into the folder (it would resume into a training
    in progress, or clear it with --overwrite)."""
    from test_resume import Interrupt
    from tworec.features import training
    command = ["--data", "synthetic:tiny", "--preset", "tiny", "--out", str(tmp_path)]
    callbacks = training.run_callbacks
    monkeypatch.setattr(training, "run_callbacks", lambda *args: callbacks(*args) + [Interrupt(1)])
    code, error = script("train_retrieval.py", *command, "--epochs", "4")
    assert code == 1 and "interrupted after epoch 1" in error, error
    monkeypatch.setattr(training, "run_callbacks", callbacks)
    state = tmp_path / "checkpoints" / "retrieval" / "state"
    state.rename(state.with_name("aside"))          # as an older tworec's checkpoint
    code, error = script("train_retrieval.py", *command, "--epochs", "4")
    assert code == 2 and "checkpointed by an older tworec" in error, error
    assert len(error.strip().splitlines()) == 1, error
    state.with_name("aside").rename(state)
    written = tmp_path / "retrieval_config.json"
    trained_with = written.read_text()
    older = json.loads(trained_with)
    del older["members"]                 # as a tworec before retrieval had members wrote it
    written.write_text(json.dumps(older, indent=2))
    for epochs in ("4", "5"):          # named as an older tworec's, whatever is asked
        code, error = script("train_retrieval.py", *command, "--epochs", epochs)
        assert code == 2 and "checkpointed by an older tworec" in error, error
    written.write_text(trained_with)
    code, error = script("train_retrieval.py", *command, "--epochs", "5")
    assert code == 2 and "holds an interrupted training started otherwise (these differ: " \
        "retrieval.epochs 4 in the folder, 5 now); rerun the command" in error, error
    assert len(error.strip().splitlines()) == 1, error
    with folder.only_run_into(str(tmp_path)):          # the command still running elsewhere
        for overwrite in ([], ["--overwrite"]):
            code, error = script("train_retrieval.py", *command, "--epochs", "4", *overwrite)
            assert code == 2 and "another process is running into this folder" in error, error
            assert len(error.strip().splitlines()) == 1, error
    assert (tmp_path / "checkpoints" / "retrieval").is_dir()         # --overwrite cleared nothing
    code, error = script("train_retrieval.py", *command, "--epochs", "4")
    assert code == 0, error
    assert json.loads((tmp_path / "retrieval_train.json").read_text())["epochs"] == 4  # 1 to 4
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["retrieval"]["test"] and any("resumes the interrupted" in notice
                                               for notice in report["notices"])


def test_a_retrieval_run_stopped_in_its_first_epoch_starts_over_when_its_command_is_rerun(
        tmp_path, script, monkeypatch):
    """Stopped before its first checkpoint, the folder holds only config.json,
    retrieval_config.json and TensorBoard logs: the same command starts the training over,
    and says so (it was refused as a folder that "already holds a run")."""
    from test_resume import Interrupt
    from tworec.features import training
    command = ["--data", "synthetic:tiny", "--preset", "tiny", "--out", str(tmp_path),
               "--epochs", "2"]
    callbacks = training.run_callbacks
    monkeypatch.setattr(training, "run_callbacks", lambda *args: callbacks(*args) + [Interrupt(-1)])
    code, error = script("train_retrieval.py", *command)
    assert code == 1 and "interrupted after epoch -1" in error, error
    monkeypatch.setattr(training, "run_callbacks", callbacks)
    assert "config.json" in os.listdir(tmp_path)
    assert not (tmp_path / "checkpoints" / "retrieval" / "chief").exists()
    code, error = script("train_retrieval.py", *command)
    assert code == 0, error
    report = json.loads((tmp_path / "report.json").read_text())
    assert any("starts the interrupted retrieval training over" in notice
               for notice in report["notices"])
    assert json.loads((tmp_path / "retrieval_train.json").read_text())["epochs"] == 2


def test_ctrl_c_in_training_says_in_one_line_how_to_resume(tmp_path, script, monkeypatch,
                                                            capsys):
    """Ctrl-C during the retrieval training: exit 130 and one line, no traceback, saying how
    to resume (without --overwrite, which would start over); that command resumes."""
    import tensorflow as tf
    from tworec.features import training
    from tworec.pipeline import cli

    class CtrlC(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):       # once the epoch is checkpointed
            raise KeyboardInterrupt
    command = ["--data", "synthetic:tiny", "--preset", "tiny", "--out", str(tmp_path),
               "--epochs", "2"]
    callbacks = training.run_callbacks
    monkeypatch.setattr(training, "run_callbacks", lambda *args: callbacks(*args) + [CtrlC()])
    code, error = script("train_retrieval.py", *command, "--overwrite")
    assert code == 130 and "Traceback" not in error, error
    assert error.splitlines()[-1] == ("error: stopped (Ctrl-C); rerun it without --overwrite to "
                                      "resume the retrieval training"), error
    assert cli.stopped(str(tmp_path), overwrite=False) == 130
    assert capsys.readouterr().err == ("error: stopped (Ctrl-C); rerun the same command to "
                                       "resume the retrieval training\n")
    monkeypatch.setattr(training, "run_callbacks", callbacks)
    code, error = script("train_retrieval.py", *command)
    assert code == 0, error
    report = json.loads((tmp_path / "report.json").read_text())
    assert any("resumes the interrupted retrieval training" in notice
               for notice in report["notices"])
    assert cli.stopped(str(tmp_path), overwrite=False) == 130     # a finished run: no advice
    assert capsys.readouterr().err == "error: stopped (Ctrl-C)\n"


def test_a_run_stopped_after_retrieval_trained_resumes_from_it(tmp_path, script, monkeypatch):
    """Ctrl-C or a failed step once the trained retrieval is saved (its evaluation included):
    the same command loads the trained model, evaluates it and runs the steps after it (the
    whole run was refused as a folder that "already holds a run"); the exports start again at
    version 1."""
    from tworec.pipeline import run as run_module
    command = ["--data", "synthetic:tiny", "--preset", "tiny", "--out", str(tmp_path),
               "--epochs", "2"]

    def stop(*args):
        raise KeyboardInterrupt

    def fail(*args):
        raise RuntimeError("no space left")
    weights = None
    for patched_name, replacement, code, line in (
            ("evaluate_retrieval", stop, 130, "error: stopped (Ctrl-C); rerun the same command "
                                              "to resume after the trained retrieval"),
            ("write_models_config", stop, 130, "error: stopped (Ctrl-C); rerun the same "
                                               "command to resume after the trained retrieval"),
            ("baselines", fail, 1, "error: step 'baselines' failed: RuntimeError: no space "
                                   "left; rerun the same command to resume after the trained "
                                   "retrieval")):
        with monkeypatch.context() as patched:
            if patched_name == "evaluate_retrieval":
                patched.setattr(run_module.Run, patched_name, stop)
            elif patched_name == "baselines":
                patched.setitem(run_module.STEP_METHODS, patched_name, replacement)
            else:                                                # the exports are written
                patched.setattr(run_module, patched_name, replacement)
            done, error = script("train_retrieval.py", *command)
        assert done == code and error.splitlines()[-1] == line, error
        weights = weights or (tmp_path / "retrieval" / "weights.index").read_bytes()
        if patched_name == "write_models_config":
            assert (tmp_path / "export" / "retrieval" / "1").is_dir()
            code, error = script("train_ranking.py", "--retrieval-run", str(tmp_path))
            assert code == 2 and "its run stopped after retrieval trained" in error, error
    saved = json.loads((tmp_path / "retrieval_report.json").read_text())
    monkeypatch.setitem(run_module.STEP_METHODS, "train retrieval", fail)  # never again
    code, error = script("train_retrieval.py", *command)
    assert code == 0, error
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "retrieval" / "weights.index").read_bytes() == weights   # not retrained
    retrieval = {key: value for key, value in report["retrieval"].items()
                 if key not in ("test", "against_baselines")}       # evaluated, compared again
    assert retrieval == saved and report["retrieval"]["test"]["recall@10"] > 0
    assert report["index"]["params"] and "train retrieval" not in report["timings"]
    assert ("resumes after the retrieval training, which finished: loads its model and runs "
            "the steps after it") in report["notices"]
    assert sorted(os.listdir(tmp_path / "export" / "retrieval")) == ["1"]
    assert set(report["exports"]) >= {"retrieval"}


@pytest.mark.parametrize("text", ["", '{"source": {"data": "synthetic:tiny"}, "data": {',
                                  '{"source": {}, "data": "x"}'])
def test_a_config_that_cannot_be_read_is_named_in_one_line(tmp_path, script, text):
    """A folder holding only a config.json cut short (config.json is now written whole or not
    at all, but older runs and other writers may leave one) names the file, and advice that
    works for a new run and a continued one alike (train_ranking takes no --overwrite)."""
    (tmp_path / "config.json").write_text(text)
    for command in (["train_retrieval.py", "--data", "synthetic:tiny", "--preset", "tiny",
                     "--out", str(tmp_path)], ["train_ranking.py", "--retrieval-run",
                                               str(tmp_path)]):
        code, error = script(*command)
        assert code == 2 and error == (
            f"error: {tmp_path / 'config.json'} cannot be read as a run's config "
            f"{error.split(' config ')[1].split(';')[0]}; {folder.TRAIN_AGAIN}\n"), error


def test_a_continued_run_of_a_release_may_predate_its_shuffled_ties(tmp_path):
    """A release's log changed when its ties of time were shuffled: a run made before cannot
    continue, and the message says that this, not the data, may have changed."""
    release = tmp_path / "ml-latest-small"
    release.mkdir()
    (release / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + "".join(
        f"{user},{movie},4,{second}\n" for user in range(20) for movie, second in
        ((1, 5), (2, 5), (3, 6), (4, 7))))
    trained_run(tmp_path / "run", str(release), columns={})
    values = json.loads((tmp_path / "run" / "config.json").read_text())
    values["source"]["fingerprint"]["sha256"] = "0" * 64               # as the older log's
    (tmp_path / "run" / "config.json").write_text(json.dumps(values))
    with pytest.raises(folder.RunFolderError, match="or the run was made before a release's "
                                                    "ratings of one second were read in a random "
                                                    "order\\); train a new run"):
        continue_run(tmp_path / "run")


def test_a_release_without_its_movies_file_is_noted(tmp_path):
    """A GroupLens folder of ratings.csv alone loads (the log's items make the catalogue), and
    the run says its items have no genres, year or title."""
    log = pacsv.read_csv(write_log(tmp_path / "log.csv"))
    release = tmp_path / "ml-latest-small"
    release.mkdir()
    pacsv.write_csv(log.select(["user", "item", "rating", "time"]).rename_columns(
        ["userId", "movieId", "rating", "timestamp"]), release / "ratings.csv")
    checked = folder.check_run(str(tmp_path / "run"), {"data": str(release)},
                               config.resolve("tiny"))
    assert checked.log.num_items == ITEMS
    assert (f"{release} has no movies.csv beside its ratings: its items have no genres, year or "
            "title") in checked.notices


def test_a_log_with_its_ties_in_id_order_is_noted(tmp_path):
    """A run says when a generic log lists its tied rows by item id (`tie_order_notes`)."""
    path = tmp_path / "ratings.csv"
    path.write_text("user_id,item_id,timestamp\n" + "".join(
        f"u{user},i0,1\n" + "".join(f"u{user},i{item},9\n" for item in (1, 2, 3))
        for user in range(300)))
    checked = folder.check_run(str(tmp_path / "run"), {"data": str(path)}, config.resolve("tiny"))
    assert sum(notice.startswith(f"{path}: 50% of its rows share their user's timestamp")
               for notice in checked.notices) == 1, checked.notices


def test_a_continued_run_from_another_folder_says_its_tfds_data_dir_is_relative(tmp_path,
                                                                              monkeypatch,
                                                                              offline):
    """A relative --data-dir is kept as given too: from another folder TFDS would not find
    the prepared copy, and the message names the directory."""
    import tensorflow_datasets as tfds
    made_here = tmp_path / "made_here"
    made_here.mkdir()
    monkeypatch.chdir(made_here)
    with tfds.testing.mock_data(num_examples=300):
        trained_run(tmp_path / "run", "tfds:movielens/100k-ratings", columns={},
                    recorded={"data_dir": "tfds"}, split="none")   # mock users have < 3 rows
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as error:
        continue_run(tmp_path / "run")
    assert str(error.value).startswith("tfds:movielens/100k-ratings: not prepared in tfds/")
    assert str(error.value).endswith(
        f"; {tmp_path / 'run' / 'config.json'} holds tfds as given, relative to the folder the "
        "run was made from: run the command from there")
    source, configs = folder.read_run(str(tmp_path / "run"))       # no --data-dir: nothing
    del source["data_dir"]                                          # relative to name
    config.write(str(tmp_path / "run" / "config.json"), configs, source)
    with pytest.raises(DataError) as error:
        continue_run(tmp_path / "run")
    assert "as given" not in str(error.value)


def test_a_continued_run_keeps_the_folders_notices_and_says_its_own_once(tmp_path):
    """The retrieval run's notices (a lowered batch, an index not tuned) still describe the
    folder's retrieval; what an earlier command did (its ranking config, a resumed training)
    does not."""
    from tworec.pipeline.run import start_run
    trained_run(tmp_path / "run", write_log(tmp_path / "log.csv"))
    continued = continue_run(tmp_path / "run")
    shared = next(notice for notice in continued.notices if notice.startswith("item features"))
    earlier = ["batch_size 512 lowered to the training rows, 180",
               f"{folder.RANKING_CONFIG_NOTICE} an earlier continued run's",
               "resumes the interrupted retrieval training from its last finished epoch", shared]
    (tmp_path / "run" / "report.json").write_text(json.dumps(
        {"data": {"outside_catalogue": 0}, "retrieval": {"test": None}, "notices": earlier}))
    started = start_run(continue_run(tmp_path / "run"))
    assert started.report["notices"] == [earlier[0], shared] + [
        notice for notice in continued.notices if notice != shared]
    assert any(notice.startswith(folder.RANKING_CONFIG_NOTICE) for notice in continued.notices)


def test_a_continued_run_says_the_folders_repeat_notice_again_and_records_it_once(
        tmp_path, monkeypatch, capsys):
    """A notice of held-out rows no model can hit (`Run.miss_notices`) describes the log, not
    a command: a continued run finds it in the folder's report, keeps it once and prints it
    again; a new one is added and printed once."""
    from tworec.pipeline import run as run_module
    trained_run(tmp_path / "run", write_log(tmp_path / "log.csv"))
    repeats = ["3 of 60 test rows (5.0%) hold an item already among their user's known rows",
               "2 of 60 validation rows (3.3%) hold an item already among their user's known rows"]
    monkeypatch.setattr(run_module.Run, "miss_notices", lambda run: repeats)
    (tmp_path / "run" / "report.json").write_text(json.dumps(
        {"data": {"outside_catalogue": 0}, "retrieval": {"test": None},
         "notices": repeats[:1]}))
    started = run_module.start_run(continue_run(tmp_path / "run"))
    printed = capsys.readouterr().out
    assert [started.report["notices"].count(notice) for notice in repeats] == [1, 1]
    assert [printed.count(f"note: {notice}") for notice in repeats] == [1, 1]


def test_a_strategy_is_checked_against_tf_config_before_the_log_loads(tmp_path, monkeypatch):
    """The parameter-server strategy failed after the log loaded and left a folder its
    command could never resume; multi_worker without a cluster trained on one machine
    without a word."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    checked = folder.check_run(str(tmp_path / "run"), {"data": write_log(tmp_path / "log.csv"),
                                                       "columns": COLUMNS},
                               config.resolve("tiny", retrieval={"strategy": "multi_worker"}))
    assert checked.notices[0] == ("--strategy multi_worker without a TF_CONFIG cluster trains "
                                  "on this machine alone")
    assert folder.check_cluster("mirrored") == folder.check_cluster("default") == []
    assert folder.check_cluster("multi_worker") == [
        "--strategy multi_worker without a TF_CONFIG cluster trains on this machine alone"]
    with pytest.raises(ValueError, match=r"\(TF_CONFIG: unset\); set TF_CONFIG so"):
        folder.check_cluster("parameter_server")
    cluster = {"chief": ["localhost:1"], "ps": ["localhost:2"], "worker": ["localhost:3"]}
    for task, works in (("chief", True), ("worker", False)):
        monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster,
                                                    "task": {"type": task, "index": 0}}))
        assert folder.check_cluster("multi_worker") == []
        if works:
            assert folder.check_cluster("parameter_server") == []
        else:
            with pytest.raises(ValueError, match="TF_CONFIG: task 'worker' in a cluster of "
                                                 r"\['chief', 'ps', 'worker'\]"):
                folder.check_cluster("parameter_server")
    monkeypatch.setenv("TF_CONFIG", "{cluster")
    with pytest.raises(ValueError, match="TF_CONFIG is not JSON"):
        folder.check_cluster("multi_worker")
    assert folder.check_cluster("mirrored") == []               # it never reads TF_CONFIG


def test_a_continued_run_that_stops_leaves_the_folders_config(tmp_path, monkeypatch):
    """config.json describes the models the folder serves: a continued run writes its ranking
    config there once it exported them, not when it starts (one stopped left the config of a
    ranker that never trained, which the next continued run then trained)."""
    from tworec.pipeline.run import StepFailed, execute, start_run
    trained_run(tmp_path / "run", write_log(tmp_path / "log.csv"))
    before = (tmp_path / "run" / "config.json").read_text()
    source, saved = folder.read_run(str(tmp_path / "run"))
    configs = config.resolve(base=saved, ranking={"model": "bst"}, steps=config.RANKING_ONLY)
    started = start_run(folder.check_run(str(tmp_path / "run"), source, configs,
                                         continue_run=True))
    with pytest.raises(StepFailed, match="step 'load retrieval' failed"):
        execute(started, config.RANKING_ONLY)                # no model to load: it stops
    assert (tmp_path / "run" / "config.json").read_text() == before
    from tworec.pipeline import run as run_module
    for name in config.RANKING_ONLY:                          # each step done, as if trained
        monkeypatch.setitem(run_module.STEP_METHODS, name, lambda run: None)
    monkeypatch.setattr(run_module.Run, "load_retrieval", lambda run: None)

    def fail(run):
        raise RuntimeError("port in use")
    monkeypatch.setitem(run_module.STEP_METHODS, "serve and check", fail)
    with pytest.raises(StepFailed, match="step 'serve and check' failed"):
        execute(started, config.RANKING_ONLY)                # once exported, its models serve
    assert folder.read_run(str(tmp_path / "run"))[1].ranking.model == "bst"


def test_an_out_that_cannot_be_made_leaves_no_folder_it_made(tmp_path):
    out = tmp_path / "new" / ("x" * 300)                  # a name too long: its parent made
    with pytest.raises(folder.RunFolderError, match=r"^--out .*: cannot make this folder "
                                                    r"\(File name too long\)"):
        with folder.only_run_into(str(out)):
            pass
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("stop_at", ["retrieval_config.json", "deleting"])
def test_a_stopped_overwrite_is_finished_by_overwrite_alone(tmp_path, monkeypatch, stop_at):
    """--overwrite moves every entry of the old run aside (config.json last) and deletes them.
    Stopped midway, while moving or deleting, the folder is neither resumed nor replaced
    without --overwrite (it may hold half the old run: no advice to resume it); another
    --overwrite deletes what was moved aside and starts afresh."""
    from tworec.pipeline import cli
    out = tmp_path / "run"
    for name in ("export/retrieval/1", "checkpoints/retrieval", "tensorboard", "plots",
                 "retrieval"):
        os.makedirs(out / name)
    for name in ("config.json", "retrieval_config.json", "retrieval_report.json",
                 "report.json", "report.md", "report.html"):
        (out / name).write_text("{}")
    moved, replace = [], os.replace

    def moving(source, target):
        if os.path.basename(source) == stop_at:
            raise KeyboardInterrupt
        moved.append(os.path.basename(source))
        replace(source, target)

    def stopped(path, *args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(folder.os, "replace", moving)
    monkeypatch.setattr(folder.shutil, "rmtree", stopped)
    with pytest.raises(KeyboardInterrupt):
        folder.clear(str(out))
    monkeypatch.undo()
    if stop_at == "deleting":
        assert moved[-1] == "config.json" and len(moved) == 11
        assert os.listdir(out) == [folder.CLEARING]
    assert cli.resume_advice(str(out), overwrite=True) == (
        "; rerun it with --overwrite to finish replacing the folder's run")
    for _ in range(2):               # a check with --overwrite that fails after (its data)
        with pytest.raises(folder.RunFolderError, match="stopped midway; rerun with --overwrite"):
            folder.check_fresh(str(out), overwrite=False)        # deletes nothing: still marked
        assert folder.check_fresh(str(out), overwrite=True) is None
    folder.clear(str(out))
    assert os.listdir(out) == []


def test_a_report_stopped_while_written_leaves_no_report_json(tmp_path, monkeypatch):
    """report.json marks a finished run: it is written last, whole, once report.md and
    report.html are; a stop before leaves the folder's earlier report.json as it was."""
    from tworec.pipeline import report as run_report
    (tmp_path / "report.json").write_text('{"retrieval": {"test": null}}')

    replace = os.replace

    def stopped_at_html(source, target):
        if target.endswith("report.html"):
            raise KeyboardInterrupt
        replace(source, target)
    monkeypatch.setattr(run_report, "markdown", lambda report, out, plots: "# a report\n")
    monkeypatch.setattr(run_report, "html", lambda text, out, plots: "<p>a report</p>")
    monkeypatch.setattr(run_report.os, "replace", stopped_at_html)
    with pytest.raises(KeyboardInterrupt):
        run_report.write(str(tmp_path), {"retrieval": {"test": None}, "ranking": {}})
    assert json.loads((tmp_path / "report.json").read_text()) == {"retrieval": {"test": None}}
    assert (tmp_path / "report.md").exists() and not (tmp_path / "report.html").exists()
    monkeypatch.setattr(run_report.os, "replace", replace)
    run_report.write(str(tmp_path), {"retrieval": {"test": None}, "ranking": {}})
    assert "ranking" in json.loads((tmp_path / "report.json").read_text())
    assert sorted(os.listdir(tmp_path)) == ["plots", "report.html", "report.json", "report.md"]


def test_a_continued_run_shows_no_old_ranking_from_its_start(tmp_path, capsys):
    """Once a continued run starts, the folder's report drops the ranking stage it replaces
    (and the example lists it served): stopped after its export, the folder serves the new
    ranker and no figure of the old one. Its Ctrl-C line says the report shows no ranking
    until the command is rerun; a folder whose report still shows one gets no advice."""
    from tworec.pipeline import cli
    from tworec.pipeline.run import start_run
    trained_run(tmp_path / "run", write_log(tmp_path / "log.csv"))
    old = {"data": {"outside_catalogue": 0}, "retrieval": {"test": None},
           "ranking": {"model": "dcn"}, "examples": {"users": []},
           "two_stage": {"test": {"recall@10": 0.715}}, "serving": {"served": {}}}
    (tmp_path / "run" / "report.json").write_text(json.dumps(old))
    assert cli.stopped(str(tmp_path / "run"), overwrite=False, continue_run=True) == 130
    assert capsys.readouterr().err == "error: stopped (Ctrl-C)\n"
    start_run(continue_run(tmp_path / "run"), verbose=0)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert not {"ranking", "two_stage", "serving", "examples"} & set(report)
    assert "Two-stage" not in (tmp_path / "run" / "report.md").read_text()
    assert cli.stopped(str(tmp_path / "run"), overwrite=False, continue_run=True) == 130
    assert capsys.readouterr().err == ("error: stopped (Ctrl-C); its report shows no ranking "
                                       "stage until the same command, rerun, trains one\n")


@pytest.mark.parametrize("broken", ["report", "catalogue", "export"])
def test_a_continued_run_refuses_a_report_or_export_it_cannot_use(tmp_path, broken):
    """A report.json cut short, one of a run made before the catalogue was the fit rows'
    items (its export may serve an item only held-out rows have), or no retrieval export to
    compose with, is refused before any training, naming it, with advice that works for a
    continued run."""
    trained_run(tmp_path / "run", write_log(tmp_path / "log.csv"))
    if broken == "report":
        (tmp_path / "run" / "report.json").write_text('{"retrieval": {"te')
        named = f"{tmp_path / 'run' / 'report.json'} cannot be read as a run's report ("
    elif broken == "catalogue":
        (tmp_path / "run" / "report.json").write_text('{"retrieval": {"test": null}}')
        named = f"{tmp_path / 'run'}: made before a run's catalogue was the items of its fit rows"
    else:
        os.rmdir(tmp_path / "run" / "export" / "retrieval" / "1")
        named = f"{tmp_path / 'run'}: holds no retrieval export (export/retrieval/N)"
    with pytest.raises(folder.RunFolderError) as error:
        continue_run(tmp_path / "run")
    assert str(error.value).startswith(named) and str(error.value).endswith(folder.TRAIN_AGAIN)
