"""A run folder before anything trains: whether `--out` can take a run, what a continued run
reads back, and every check of the log and configs that needs no model. TensorFlow-free, so that
the scripts answer a mistake in well under a second, before the flow (`pipeline.run`) loads.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil

import numpy as np

from tworec.features import Interactions, load
from tworec.pipeline import config as run_config, report as run_report
from tworec.pipeline.config import Configs


class RunFolderError(ValueError):
    """A run folder that cannot be used; the message names the folder and the problem."""

# What a run folder holds (and `clear` removes before a run replaces it).
RUN_ENTRIES = ("config.json", "report.json", "report.md", "plots", "export", "vocab",
               "retrieval", "checkpoints", "tensorboard", "retrieval_config.json",
               "retrieval_train.json", "ranking_config.json", "ranking_train.json")


@dataclasses.dataclass
class CheckedRun:
    """What `check_run` accepted: the folder, the loaded log, the configs fitted to its
    catalogue, the source with the log's fingerprint, the report so far (a continued run's),
    the notices about fitted settings, and how the folder is to be used."""
    out: str
    log: Interactions
    configs: Configs
    source: dict
    report: dict
    notices: list[str]
    continue_run: bool
    overwrite: bool


def check_run(out: str, source: dict, configs: Configs, continue_run: bool = False,
              overwrite: bool = False) -> CheckedRun:
    """Loads the log and checks everything before any training: the folder, the configs
    against the log, and for a continued run that only the ranking config changed and that the
    source still gives the log the run was trained on. Raises DataError, ValueError or
    RunFolderError with a one-line message; changes nothing on disk.

    Args:
        out: the run folder: new (or empty) for a fresh run, a run folder to replace with
            `overwrite`, or for `continue_run` the run whose retrieval model is reused.
        source: {"data": a `features.load` source, "columns": role -> column name, and
            optionally "delimiter" of a text log (detected when absent)}.
        configs: the resolved configs (for a continued run, resolved from `read_run(out)`).
    """
    if continue_run:
        saved_source, saved = read_run(out)
        changed = [name for name in ("data", "retrieval", "run")
                   if getattr(configs, name) != getattr(saved, name)]
        if changed or source != saved_source:
            raise RunFolderError(
                f"{out}: a continued run keeps the folder's data source and its data, retrieval "
                f"and run configs; these differ: {changed or ['source']}")
        if saved.data.cold_start_window is None:
            raise RunFolderError(f"{out}: made before runs recorded what users never seen are "
                                 "served; train a new run (scripts/pipeline.py)")
    else:
        check_fresh(out, overwrite)
    configs.validate()                  # all but what depends on the log, before it loads
    log = load(source["data"], columns=source.get("columns") or {},
               delimiter=source.get("delimiter"))
    configs.validate(has_ratings=log.rating is not None)
    log_fingerprint = fingerprint(log)
    if continue_run and source.get("fingerprint") != log_fingerprint:
        raise RunFolderError(f"{out}: {source['data']} now gives another log than the run was "
                             "trained on; train a new run")
    run, notices = configs.run.for_catalogue(log.num_items)
    return CheckedRun(out, log, dataclasses.replace(configs, run=run),
                      {**source, "fingerprint": log_fingerprint},
                      run_report.read(out) if continue_run else {}, notices, continue_run,
                      overwrite)


def read_run(out: str) -> tuple[dict, Configs]:
    """(source, configs) of an existing run folder; RunFolderError when it is none."""
    path = os.path.join(out, "config.json")
    if not os.path.exists(path):
        raise RunFolderError(f"{out}: not a run folder (no config.json); train retrieval "
                             "into it first (scripts/train_retrieval.py)")
    return run_config.read(path)


def check_fresh(out: str, overwrite: bool) -> None:
    """Raises RunFolderError unless `out` can take a new run: absent or an empty folder, or
    with `overwrite` a run folder (nothing else is ever deleted)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise RunFolderError(f"--out {out} is a file; name a folder for the run")
    if not os.path.isdir(out) or not os.listdir(out):
        return
    if not os.path.exists(os.path.join(out, "config.json")):
        raise RunFolderError(f"--out {out} is a folder with other files in it; name a new or "
                             "empty folder for the run")
    if not overwrite:
        raise RunFolderError(f"--out {out} already holds a run; pass --overwrite to replace it, "
                             "or name a new folder")


def clear(out: str) -> None:
    """Removes what a run wrote in `out` (a folder `check_fresh` accepted with overwrite)."""
    for name in RUN_ENTRIES:
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def fingerprint(log: Interactions) -> dict:
    """What identifies a log: its sizes, time span and a digest of its rows."""
    digest = hashlib.sha256()
    for column in (log.user, log.item, log.timestamp):
        digest.update(np.ascontiguousarray(column).tobytes())
    digest.update("\n".join(log.user_ids).encode() + b"\0" + "\n".join(log.item_ids).encode())
    return {"interactions": int(len(log)), "users": int(log.num_users),
            "items": int(log.num_items), "sha256": digest.hexdigest()}
