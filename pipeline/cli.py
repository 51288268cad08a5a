"""What the run scripts share: their common arguments, and one call from parsed arguments to a
finished run with the exit codes a shell expects (0 done, 2 a user error caught before any
training, 1 a step that failed)."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from tworec.console import parser_for  # noqa: F401  (every script's parser, from here)
from tworec.features.inputs import PROTOCOLS
from tworec.features.interactions import DataError
from tworec.features.sources import DELIMITER_HELP, parse_columns
from tworec.pipeline.config import PRESETS, RETRIEVAL_PRESETS, RunConfig


def add_run_arguments(parser: argparse.ArgumentParser, out_required: bool = True,
                      out_help: str = "the run folder", split_help: str | None = None) -> None:
    """--data, --data-dir, --columns, --delimiter, --out, --split, --preset, --epochs and the
    other flags every run script takes."""
    parser.add_argument("--data", default=None,
                        help="synthetic[:PRESET], tfds:NAME, a GroupLens folder or .zip, or a "
                             ".csv/.tsv/.parquet log (default: synthetic)")
    parser.add_argument("--data-dir",
                        help="for --data tfds:NAME: the TFDS data directory, e.g. one holding a "
                             "copy prepared elsewhere (default: TFDS's own)")
    parser.add_argument("--columns", default="",
                        help="for generic files: ROLE=COLUMN,... with roles user, item, time, "
                             "rating, user.NAME, item.NAME; rating=none reads no ratings")
    parser.add_argument("--delimiter", help=DELIMITER_HELP)
    parser.add_argument("--out", required=out_required, help=out_help)
    parser.add_argument("--split",
                        help=split_help or f"evaluation protocol: {', '.join(PROTOCOLS)} "
                             "(default: temporal; global holds out every row after the 0.9 "
                             "quantile of time; latest validates on each user's last row and "
                             "tests nothing; none trains on every row and evaluates nothing)")
    parser.add_argument("--preset", choices=PRESETS, help="default (the default) or tiny")
    parser.add_argument("--epochs", type=int, help="epochs of every stage the command trains")
    parser.add_argument("--cold-start-window", type=float, metavar="W",
                        help="users never seen get the items most frequent in the latest W "
                             "share of the known rows, 0 < W <= 1 (default: chosen on "
                             "validation)")
    parser.add_argument("--keep-seen", action="store_true",
                        help="serve and rank items users already have (catalogues with repeats)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace what --out already holds")
    parser.add_argument("--verbose", action="store_true",
                        help="show TensorFlow's, absl's and ScaNN's own logs (also: TWOREC_VERBOSE=1)")


def add_list_arguments(parser: argparse.ArgumentParser) -> None:
    """--top-k and --top-n: the retrieval candidates the recommender re-ranks, and the items
    it returns (`list_run`)."""
    parser.add_argument("--top-k", type=int, default=RunConfig.candidates,
                        help="retrieval candidates to re-rank")
    parser.add_argument("--top-n", type=int, default=RunConfig.top_n,
                        help="items the recommender returns")


def list_run(args) -> dict:
    """The run config fields of `add_list_arguments`'s arguments."""
    return {"candidates": args.top_k, "top_n": args.top_n}


def add_members_argument(parser: argparse.ArgumentParser) -> None:
    """--members, of the scripts that train retrieval (`members_given` reads it)."""
    parser.add_argument("--members", type=int, metavar="M",
                        help="two-tower models trained side by side and served as one, by the "
                             "mean of their scores (presets: default "
                             f"{RETRIEVAL_PRESETS['default'].members}, tiny "
                             f"{RETRIEVAL_PRESETS['tiny'].members}); more members take longer "
                             "to train and serve embeddings M times as wide")


def members_given(args) -> dict:
    """The retrieval config field --members sets, when given."""
    return {} if args.members is None else {"members": args.members}


def fail(message: str) -> int:
    """Prints a one-line error for a mistake caught before any work; returns exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def failed(message: str) -> int:
    """Prints a one-line error for work that failed after it started; returns exit code 1."""
    print(f"error: {message}", file=sys.stderr)
    return 1


def candidates_run(top_k: int) -> dict:
    """The run config fields of a script with --top-k and no --top-n: the recommender returns
    RunConfig's top_n items, or all K candidates when K is fewer."""
    return {"candidates": top_k, "top_n": min(RunConfig.top_n, top_k)}


def source_of(args) -> dict:
    """The data source of parsed arguments, as RUN/config.json records it ("data_dir" only
    when given)."""
    source = {"data": "synthetic" if args.data is None else args.data,
              "columns": parse_columns(args.columns),
              "delimiter": args.delimiter}
    if args.data_dir is not None:
        source["data_dir"] = args.data_dir
    return source


def run(args, steps: tuple[str, ...], continue_run: bool = False, verbose: int = 1,
        **overrides) -> int:
    """Resolves the configs, prepares the run and executes `steps`; ends with the headline test
    figures and where the report is. `overrides` go to `pipeline.config.resolve`."""
    show_logs(args)
    try:
        return _run(args, steps, continue_run, verbose, overrides)
    except KeyboardInterrupt:
        return stopped(args.out, getattr(args, "overwrite", False), continue_run)


def stopped(out: str, overwrite: bool, continue_run: bool = False) -> int:
    """Prints the one line of a run that Ctrl-C stopped (once the folder lock is released and
    the folders it made empty are gone), with how to resume when it can; returns 130."""
    advice = continued_advice(out) if continue_run else resume_advice(out, overwrite)
    print("error: stopped (Ctrl-C)" + advice, file=sys.stderr)
    return 130


def continued_advice(out: str) -> str:
    """'; ...' for a continued run's folder whose report shows no ranking stage (it started
    replacing it, or there was none), else ''."""
    from tworec.pipeline.report import read
    try:
        shows_ranking = "ranking" in read(out)
    except ValueError:
        return ""
    return ("" if shows_ranking else "; its report shows no ranking stage until the same "
            "command, rerun, trains one")


def resume_advice(out: str, overwrite: bool) -> str:
    """'; rerun ... to resume ...' for a run folder a rerun resumes, else ''."""
    from tworec.pipeline.folder import CLEARING, interrupted_retrieval, stopped_after_retrieval
    if not (os.path.isdir(out) and os.listdir(out)):
        return ""
    if os.path.isdir(os.path.join(out, CLEARING)):
        return "; rerun it with --overwrite to finish replacing the folder's run"
    again = "rerun it without --overwrite" if overwrite else "rerun the same command"
    if interrupted_retrieval(out):
        return f"; {again} to resume the retrieval training"
    if stopped_after_retrieval(out):
        return f"; {again} to resume after the trained retrieval"
    return ""


def _run(args, steps: tuple[str, ...], continue_run: bool, verbose: int,
         overrides: dict) -> int:
    from tworec.pipeline.folder import RunFolderError, check_run, only_run_into
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(only_run_into(args.out))       # before the folder is read
            configs, source = _configs(args, steps, continue_run, overrides)
            checked = check_run(args.out, source, configs, continue_run=continue_run,
                                overwrite=args.overwrite)
            from tworec.pipeline.run import start_run                 # TensorFlow from here
            prepared = start_run(checked, verbose=verbose)
        except (DataError, ValueError, RunFolderError) as error:
            return fail(str(error))
        return _execute(prepared, steps, args.out, getattr(args, "overwrite", False))


def show_logs(args) -> None:
    """TensorFlow's, absl's and ScaNN's own logs shown with --verbose (or TWOREC_VERBOSE),
    dropped otherwise."""
    import tworec
    from tworec import console
    if args.verbose or tworec.verbose_requested():
        tworec.configure_logs(True)
    else:
        console.filter_native_logs()


def data_given(args) -> dict:
    """The data config fields of --split, --keep-seen and --cold-start-window."""
    return {"split": "temporal" if args.split is None else args.split,
            "exclude_seen": not args.keep_seen,
            "cold_start_window": args.cold_start_window}


def _configs(args, steps: tuple[str, ...], continue_run: bool, overrides: dict):
    """The run's (configs, source): a continued run's from its folder, with only ranking's
    settings (and its epochs) changed; a fresh run's from the arguments."""
    from tworec.pipeline.config import resolve
    from tworec.pipeline.folder import read_run
    if continue_run:
        source, base = read_run(args.out)
        ranking = dict(overrides.get("ranking", {}))
        if args.epochs is not None:
            ranking["epochs"] = args.epochs
        return resolve(base=base, ranking=ranking), source
    return resolve(args.preset or "default", epochs=args.epochs, steps=steps,
                   **{"data": data_given(args), **overrides}), source_of(args)


def _execute(prepared, steps: tuple[str, ...], out: str, overwrite: bool) -> int:
    """Executes `steps` of a started run; ends with the headline test figures and where the
    report is (a failed step, with how to resume when a rerun can)."""
    from tworec.pipeline.run import StepFailed, execute
    start = time.perf_counter()
    try:
        report = execute(prepared, steps)
    except StepFailed as error:
        return failed(str(error) + resume_advice(out, overwrite))
    for line in report.get("warnings", []):
        print(f"[run] warning: {line}", flush=True)
    figures = [f"{name} {test['recall@10']:.4f} / {test['ndcg@10']:.4f}"
               for name, test in (("retrieval", (report.get("retrieval") or {}).get("test")),
                                  ("two-stage", (report.get("two_stage") or {}).get("test")))
               if test]
    ranking = report.get("ranking") or {}
    rmse = (ranking.get("test") or {}).get("rmse") if ranking.get("task") == "regression" else None
    print(f"[run] done in {time.perf_counter() - start:.0f} s"
          + (f"; test Recall@10 / NDCG@10: {', '.join(figures)}" if figures else "")
          + (f"; test RMSE of the ratings {rmse:.3f}" if rmse is not None else ""))
    print(f"[run] report: {os.path.join(out, 'report.md')} "
          "(also report.html, report.json, plots/)")
    return 0
