"""The README is true for a stranger: every command in it names a make target, script or module
that exists with the flags it shows, each is run by a test (or is an outside tool, said why),
and its library snippets run as printed."""
import ast
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()

# What runs each command: "make TARGET", "scripts/NAME.py" or "-m MODULE" -> the tests that run
# it as the README shows it (file::function), or why no test can.
EXERCISED = {
    "make test": "CI itself runs `make test`",
    "make demo": "tests/test_pipeline.py::test_the_run_is_quiet_and_says_each_step_and_where_the_report_is",
    "make serve": "tests/test_pipeline.py::test_make_serve_serves_the_run_folder",
    "make bench": "tests/test_readme.py::test_benchmark_script_runs_every_part_small",
    "scripts/describe_data.py": "tests/test_features.py::test_describe_data_prints_one_json_object",
    "scripts/pipeline.py": "tests/test_pipeline.py::test_report_follows_the_schema",
    "scripts/train_retrieval.py":
        "tests/test_pipeline.py::test_train_retrieval_script_writes_its_part_of_the_run",
    "scripts/train_ranking.py":
        "tests/test_pipeline.py::test_train_ranking_reuses_a_retrieval_run_and_matches_the_pipeline",
    "scripts/serve.py": "tests/test_serving_abuse.py",
    "scripts/recommend.py":
        "tests/test_scripts_serving.py::test_recommend_all_script_writes_the_file_and_says_where",
    "scripts/benchmark.py": "tests/test_readme.py::test_benchmark_script_runs_every_part_small",
    "scripts/compare.py":
        "tests/test_compare.py::test_the_script_prints_the_table_and_writes_it_with_the_ranks",
    "-m tworec.pipeline.benchmark":      # the scale part runs its jobs with it
        "tests/test_readme.py::test_benchmark_script_runs_every_part_small",
    "-m tworec.serving.soak": "tests/test_readme.py::test_soak_runs_briefly",
    "-m tworec.features.shards":
        "tests/test_shards.py::test_the_module_writes_a_preset_and_100m_is_for_shards_only",
    "-m tworec.features.prepare": "tests/test_stream.py::test_the_prepare_module_says_progress_"
                                  "and_one_json_line",
    "-m tworec.features.training":
        "tests/test_parameter_server.py::test_embedding_tables_are_split_across_the_two_ps_tasks",
}
OUTSIDE = {                      # commands of other tools: not runnable on a machine without them
    "curl": "a download from GroupLens; the loader reads the release's .zip (tests/test_features.py)",
    "tensorflow_model_server": "the TF Serving binary is not installable here; the conformance "
                               "tests run against it when TFSERVING_REST is set",
    "docker": "no Docker engine here",
}


def readme_commands() -> list[str]:
    """Every shell command of the README: lines of its plain code blocks (an indented line
    continues the one before; a trailing backslash too) and inline `python ...` commands."""
    commands = []
    for language, block in re.findall(r"```(\w*)\n(.*?)```", README, re.S):
        if language or block.split()[0].endswith("/"):      # a snippet, or the folder tree
            continue
        for line in block.splitlines():
            if line.startswith((" ", "\t")) and commands and commands[-1].endswith("\\"):
                commands[-1] = commands[-1][:-1] + line.strip()
            elif line.startswith((" ", "\t")) and commands and line.strip().startswith("["):
                commands[-1] += " " + line.strip()
            elif line and not line.startswith((" ", "\t")):
                commands.append(line.split("  #")[0].strip())
    inline = re.findall(r"`(python (?:scripts/\w|-m )[^`]*|make \w+)`", README)
    return commands + [" ".join(command.split()) for command in inline]


def key_of(command: str) -> str:
    words = command.split()
    if words[0] == "make":
        return " ".join(words[:2])
    if words[0] == "python" and words[1] == "-m":
        return " ".join(words[1:3])
    if words[0] == "python":
        return words[1]
    return words[0]


def flags_of(command: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", command))


def help_text(key: str) -> str:
    target = key.split() if key.startswith("-m ") else [os.path.join(ROOT, key)]
    done = subprocess.run([sys.executable, *target, "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_readme_has_the_commands_we_expect():
    keys = {key_of(command) for command in readme_commands()}
    assert {"make test", "make demo", "scripts/pipeline.py", "scripts/serve.py",
            "scripts/recommend.py", "curl"} <= keys, keys


@pytest.mark.parametrize("key", sorted({key_of(c) for c in readme_commands()}))
def test_every_readme_command_is_run_by_a_test_or_is_an_outside_tool(key):
    if key in OUTSIDE:
        return
    assert key in EXERCISED, f"README command {key!r}: name the test that runs it in EXERCISED"
    where = EXERCISED[key]
    if where.startswith("tests/"):
        path, _, function = where.partition("::")
        source = open(os.path.join(ROOT, path), encoding="utf-8").read()
        names = {node.name for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.FunctionDef)}
        assert not function or function in names, f"{where} does not exist"


@pytest.mark.parametrize("key", sorted({key_of(c) for c in readme_commands()
                                        if c.startswith("python")}))
def test_readme_flags_exist(key):
    """Each flag the README shows for a script or module is one its --help lists."""
    shown = set().union(*(flags_of(c) for c in readme_commands() if key_of(c) == key))
    missing = sorted(shown - flags_of(help_text(key)))
    assert not missing, f"README shows {missing} for {key}, which its --help does not list"


def test_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", open(os.path.join(ROOT, "Makefile")).read(), re.M))
    for command in readme_commands():
        if command.startswith("make "):
            assert command.split()[1] in targets, command


def test_the_data_snippet_runs_as_printed():
    """The first library snippet, on the generator instead of a downloaded release."""
    snippet = next(block for language, block in re.findall(r"```(\w*)\n(.*?)```", README, re.S)
                   if language == "python" and "features.load" in block)
    namespace = {}
    exec(snippet.replace('"path/to/ml-latest-small"', '"synthetic:tiny"'), namespace)
    batch = next(iter(namespace["train"]))
    assert batch["history"].shape == (min(4096, len(namespace["parts"].train)), 20)


def test_the_in_memory_columns_snippet_runs_as_printed(capsys):
    snippet = next(block for language, block in re.findall(r"```(\w*)\n(.*?)```", README, re.S)
                   if language == "python" and "from_columns" in block)
    exec(snippet, {})
    assert capsys.readouterr().out == "3 2 2\n"


def test_the_tie_shuffling_snippet_runs_as_printed(tmp_path, monkeypatch):
    """The DuckDB line that reorders a ratings.csv listed by movie id: the same rows, in time
    order within each user, their ties no longer in id order and not in one order for all."""
    from tworec.features import load
    from tworec.features.sources import tie_order_notes
    snippet = next(block for language, block in re.findall(r"```(\w*)\n(.*?)```", README, re.S)
                   if language == "python" and "duckdb" in block)
    rows = [(user, movie, 4.0, second) for user in range(1, 301)
            for movie, second in ((5, 1), (10, 9), (20, 9), (30, 9))]
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + "".join(
        f"{user},{movie},{rating},{second}\n" for user, movie, rating, second in rows))
    assert tie_order_notes(load(str(tmp_path / "ratings.csv")))            # in id order
    monkeypatch.chdir(tmp_path)
    exec(snippet, {})
    lines = (tmp_path / "shuffled.csv").read_text().splitlines()
    assert lines[0] == "userId,movieId,rating,timestamp"
    shuffled = [tuple(map(float, line.split(","))) for line in lines[1:]]
    assert sorted(shuffled) == sorted(rows)
    assert [(u, t) for u, _, _, t in shuffled] == sorted((u, t) for u, _, _, t in rows)
    last = [movie for (user, movie, _, _), after in zip(shuffled, shuffled[1:] + [(0,) * 4])
            if after[0] != user]                                          # each user's last
    assert set(last) == {10, 20, 30} and min(map(last.count, (10, 20, 30))) > 50
    assert tie_order_notes(load(str(tmp_path / "shuffled.csv"))) == []


def test_soak_runs_briefly():
    """The README's soak, shortened: valid and malformed requests both sent, no valid one failed
    or answered wrongly, no malformed one answered 200 or 5xx."""
    done = subprocess.run([sys.executable, "-m", "tworec.serving.soak", "--seconds", "3",
                           "--clients", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    report = json.loads(done.stdout)
    assert report["problems"] == 0, report["problem_examples"]
    assert report["valid_requests"] > 0 and report["malformed_requests"] > 0
    assert report["server_exit_code"] == 0


def test_benchmark_script_runs_every_part_small():
    """`make bench` runs scripts/benchmark.py; here every part on small data (--smoke): each
    ends with its figures, the serving part with no failed request, and nothing but the
    benchmark's own lines on stderr."""
    from tworec.pipeline.benchmark import PARTS
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"),
                           "--smoke", "--json"], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    assert list(results) == list(PARTS)
    for name in ("input", "train_retrieval", "train_ranking", "index"):
        assert results[name]["ratio"] > 0, (name, results[name])
    for name in ("train_retrieval", "train_ranking"):              # smoke: one round
        part = results[name]
        assert part["rounds"] == len(part["round_ratios"]) == 1, name
        assert part["ratio"] == pytest.approx(part["ours_examples_per_second"] / part[
            "tutorial_examples_per_second"], abs=0.011), name                # ours over theirs
    for model in ("retrieval", "retrieval_scann", "recommender"):
        figures = results["serving"][model]
        assert all(run["errors"] == 0 and run["requests"] > 0 for run in figures.values()), model
    assert all(line.startswith("[benchmark] ") for line in done.stderr.splitlines()), \
        done.stderr[-2000:]
    assert "[benchmark] input: done in " in done.stderr and "{" not in done.stderr  # once
    scale = results["scale"]["sizes"][0]
    for side in (scale, scale["in_memory"]):
        assert side["rows"] > 0 and side["peak_rss_gib"] > 0, side
        assert side["step_examples_per_second"] > 0 and side["input_ratio"] > 0, side
    # the training processes' peaks without and with the rate measurements after training
    assert scale["train_with_rate_measurements_peak_rss_gib"] >= scale["train_peak_rss_gib"]
    in_memory = scale["in_memory"]
    assert in_memory["with_rate_measurements_peak_rss_gib"] >= in_memory["peak_rss_gib"]


def test_training_benchmarks_time_their_sides_in_turn_and_pair_each_round():
    """A round measures every side once, in the order given and then reversed; the ratio is the
    median of the rounds' own ratios (not the ratio of the medians, nor their mean)."""
    from tworec.pipeline.benchmark import in_turn, paired_ratios
    calls = []
    rates = in_turn({"ours": lambda: calls.append("ours") or 10.0 * len(calls),
                     "tutorial": lambda: calls.append("tutorial") or 5.0}, rounds=3)
    assert calls == ["ours", "tutorial", "tutorial", "ours", "ours", "tutorial"]
    assert rates == {"ours": [10.0, 40.0, 50.0], "tutorial": [5.0, 5.0, 5.0]}
    assert paired_ratios([2.0, 9.0, 3.0, 1.0], [1.0, 3.0, 2.0, 3.0]) == {  # 2, 3, 1.5, 1/3
        "ratio": 1.75, "round_ratios": [2.0, 3.0, 1.5, 0.33]}  # mean 1.71, medians' ratio 1


@pytest.mark.parametrize("names, message", [
    (["nope"], "unknown part(s) ['nope']; known: "), ([], "name each part once, e.g. input,"),
    (["input", "input"], "name each part once, e.g. input,")])
def test_benchmark_parts_are_each_named_once_before_any_runs(names, message):
    """`--only ''` ran nothing and `--only input,input` ran a part twice."""
    from tworec.pipeline.benchmark import run
    with pytest.raises(ValueError) as refused:
        run(names)
    assert str(refused.value).startswith(message), str(refused.value)


def test_the_input_pipelines_read_each_row_once_an_epoch_and_a_repeat_is_caught(monkeypatch):
    """Every side of the `input` part does the same work: checked before it is timed."""
    import tensorflow as tf
    from tworec.pipeline import benchmark
    benchmark.check_first_epochs(batch_size=8, rows=83)             # all four pipelines pass
    real = benchmark.input_pipelines

    def with_a_repeat(columns, batch_size):
        pipelines = real(columns, batch_size)
        pipelines["by_hand"] = pipelines["by_hand"].map(        # row 0 in place of row 1
            lambda batch: {"row": tf.where(batch["row"] == 1, tf.constant(0, tf.int64),
                                           batch["row"])})
        return pipelines
    monkeypatch.setattr(benchmark, "input_pipelines", with_a_repeat)
    with pytest.raises(AssertionError, match="^input pipeline 'by_hand': its first epoch is "
                                             "not 80 distinct shuffled rows$"):
        benchmark.check_first_epochs(batch_size=8, rows=83)


def test_a_benchmark_process_reads_its_own_peak_memory_not_its_parents():
    """A scale job runs in a process this one starts: its peak resident memory is its own,
    not this process's (Linux starts a child's `ru_maxrss` at its parent's peak)."""
    from tworec.pipeline.benchmark import _peak_rss_gib
    held = bytearray(600 << 20)
    held[::4096] = b"\1" * len(held[::4096])                 # touched: resident
    ours = _peak_rss_gib()
    child = subprocess.run([sys.executable, "-c", "from tworec.pipeline.benchmark import "
                            "_peak_rss_gib; print(_peak_rss_gib())"], capture_output=True,
                           text=True, check=True)
    assert ours > 0.6 and 0 < float(child.stdout) < ours - 0.4, (ours, child.stdout)


def test_the_prepared_log_snippet_runs_as_printed(tmp_path, capsys):
    """The training-from-shards snippet, on the tiny log prepared, for 5 small steps."""
    import pyarrow.parquet as pq
    from test_prepare import _log_table
    from tworec.features.prepare import prepare_shards
    pq.write_table(_log_table(), tmp_path / "log.parquet")
    prepare_shards(str(tmp_path / "log.parquet"), str(tmp_path / "prepared"), history_length=5)
    snippet = next(block for language, block in re.findall(r"```(\w*)\n(.*?)```", README, re.S)
                   if language == "python" and "fit_prepared" in block)
    exec(snippet.replace('"PREPARED"', repr(str(tmp_path / "prepared")))
         .replace("batch_size=4096", "batch_size=64").replace("2000", "5"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("[retrieval] epoch 1/1: loss ") and len(printed) == 3
    assert printed[1].startswith("{'recall@10': ")
    assert printed[2].startswith("{'popularity': {'recall@10': ") and "'ease': None" in printed[2]


def test_the_ceiling_snippet_runs_as_printed(capsys):
    """The planted-scores snippet, on the tiny preset instead of the default."""
    snippet = next(block for language, block in re.findall(r"```(\w*)\n(.*?)```", README, re.S)
                   if language == "python" and "planted_scores" in block)
    exec(snippet.replace('PRESETS["default"]', 'PRESETS["tiny"]'), {})
    printed = capsys.readouterr().out
    assert printed.startswith("{'recall@10': ") and "'ndcg@10': " in printed
