"""A run folder before anything trains: whether `--out` can take a run, what a continued run
reads back, and every check of the log and configs that needs no model. TensorFlow-free, so that
the scripts answer a mistake in well under a second, before the flow (`pipeline.run`) loads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil

import numpy as np

from tworec.features import Interactions, Split, load, split
from tworec.features.interactions import SourceNotFound
from tworec.features.inputs import MODEL_ITEM_FEATURES
from tworec.features.splits import require_held_out
from tworec.features.sources import (NO_RATING, has_fixed_columns, is_release, release_gaps,
                                     tie_order_notes, unread_columns_note)
from tworec.pipeline import config as run_config, report as run_report
from tworec.pipeline.config import Configs
from tworec.serving.layout import list_versions


class RunFolderError(ValueError):
    """A run folder that cannot be used; the message names the folder and the problem."""

# What a run folder holds (and `clear` removes before a run replaces it).
RUN_ENTRIES = ("config.json", "config.json.tmp", "report.json", "report.json.tmp", "report.md",
               "report.md.tmp", "report.html", "report.html.tmp", "plots", "export", "vocab",
               "retrieval", "checkpoints", "tensorboard", "retrieval_config.json",
               "retrieval_train.json", "retrieval_report.json", "retrieval_report.json.tmp",
               "ranking_config.json", "ranking_train.json")
# What makes a run folder that cannot be continued usable again.
TRAIN_AGAIN = ("train a run into it again (scripts/pipeline.py or scripts/train_retrieval.py with "
               "--overwrite)")
# Where `clear` moves a run's entries before deleting them: while it exists, replacing the
# folder's run was stopped midway, and only --overwrite finishes it.
CLEARING = ".tworec-clearing"
# What a retrieval training that was interrupted leaves, and nothing else: a rerun of the
# command that started it resumes it from its checkpoint.
INTERRUPTED_RETRIEVAL = {"config.json", "config.json.tmp", "retrieval_config.json", "checkpoints",
                         "tensorboard"}
# The report's retrieval section but its test figures, written once the trained retrieval is
# saved: a run stopped after it (no report.json) resumes from that model (`AFTER_RETRIEVAL`).
RETRIEVAL_REPORT = "retrieval_report.json"
TRAINING, AFTER_RETRIEVAL = "training", "after retrieval"      # what a rerun resumes
# The version of `fingerprint`: 2 digests every column a run reads (1 left out the ratings and
# the side features).
FINGERPRINT_FORMAT = 2


@dataclasses.dataclass
class CheckedRun:
    """What `check_run` accepted: the folder, the loaded log and its split, the configs fitted
    to its catalogue and training rows, the source with the log's fingerprint, the report so
    far (a continued run's), the notices about fitted settings, and how the folder is to be
    used."""
    out: str
    log: Interactions
    parts: Split
    configs: Configs
    source: dict
    report: dict
    notices: list[str]
    continue_run: bool
    overwrite: bool
    resume: str | None = None       # TRAINING, AFTER_RETRIEVAL or None


# How the notices about the command that ran begin: a continued run's ranking config and what
# a rerun resumed (a later continued run does not keep them; each says its own).
RANKING_CONFIG_NOTICE = "the ranking config is"
RESUMED_AFTER_RETRIEVAL = ("resumes after the retrieval training, which finished: loads its "
                           "model and runs the steps after it")
RESUMED_TRAINING = "resumes the interrupted retrieval training from its last finished epoch"
RESTARTED_TRAINING = "starts the interrupted retrieval training over: it finished no epoch"
COMMAND_NOTICES = (RANKING_CONFIG_NOTICE, RESUMED_AFTER_RETRIEVAL, RESUMED_TRAINING,
                   RESTARTED_TRAINING)


def check_run(out: str, source: dict, configs: Configs, continue_run: bool = False,
              overwrite: bool = False) -> CheckedRun:
    """Loads the log and checks everything before any training: the folder, the configs
    against the log, for a continued run that only the ranking config changed and that the
    source still gives the log the run was trained on, and for a run interrupted in or after
    its retrieval training that it is rerun with the same source, log and configs. Raises
    DataError, ValueError or RunFolderError with a one-line message; changes nothing on disk.

    Args:
        out: the run folder: new (or empty) for a fresh run, a run folder to replace with
            `overwrite`, a folder holding a run interrupted in or after its retrieval training
            to resume, or for `continue_run` the run whose retrieval model is reused.
        source: {"data": a `features.load` source, "columns": role -> column name, and
            optionally "delimiter" of a text log (detected when absent) and "data_dir", the
            TFDS data directory}.
        configs: the resolved configs (for a continued run, resolved from `read_run(out)`).
    """
    check_source(source)
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
        check_fingerprint_format(out, saved_source, "train a new run (scripts/pipeline.py)")
        if stopped_after_retrieval(out):
            raise RunFolderError(f"{out}: its run stopped after retrieval trained, before it "
                                 "finished; rerun the command that started it to finish it "
                                 "(it resumes from the trained retrieval)")
        try:
            report = run_report.read(out)
        except ValueError as error:
            raise RunFolderError(f"{error}; {TRAIN_AGAIN}") from None
        if "retrieval" not in report:
            raise RunFolderError(
                f"{out}: its retrieval stage did not finish (no report.json with retrieval's "
                "results); " + ("rerun the command that started it to resume its training"
                                if interrupted_retrieval(out) else TRAIN_AGAIN))
        if "outside_catalogue" not in report.get("data", {}):
            raise RunFolderError(f"{out}: made before a run's catalogue was the items of its fit "
                                 "rows (its retrieval export may serve items only held-out rows "
                                 f"have); {TRAIN_AGAIN}")
        if not list_versions(os.path.join(out, "export", "retrieval")):
            raise RunFolderError(f"{out}: holds no retrieval export (export/retrieval/N), which "
                                 f"a continued run serves and composes; {TRAIN_AGAIN}")
    resume = None if continue_run else check_fresh(out, overwrite)
    configs.validate()                  # all but what depends on the log, before it loads
    cluster = [] if continue_run else check_cluster(configs.retrieval.strategy)
    cluster += gpu_settings_without_gpu(configs, continue_run)
    try:
        log = load_source(source)
    except SourceNotFound as error:
        data = None if has_fixed_columns(source["data"]) else source["data"]   # tfds:NAME
        relative = [path for path in (source.get("data_dir"), data)
                    if path and not os.path.isabs(path)]
        if continue_run and relative:
            raise SourceNotFound(f"{error}; {os.path.join(out, 'config.json')} holds "
                                 f"{relative[0]} as given, relative to the folder the run was "
                                 "made from: run the command from there") from None
        raise
    configs.validate(has_ratings=log.rating is not None,
                     has_user_features=bool(log.user_features))
    log_fingerprint = fingerprint(log)
    if continue_run and source.get("fingerprint") != log_fingerprint:
        raise RunFolderError(f"{out}: {source['data']} now gives another log than the run was "
                             "trained on (its rows, ids, ratings or features differ"
                             + (", or the run was made before user features that change within "
                                "a user were read row by row" if log.user_feature_rows else "")
                             + (", or the run was made before a release's ratings of one second "
                                "were read in a random order" if is_release(source["data"]) else "")
                             + "); train a new run")
    parts = split(log, configs.data.split)
    run, notices = configs.run.for_catalogue(   # the items of the fit rows, what is served
        int(log.items_of(parts.fit).sum()))
    notices = cluster + notices
    if continue_run:                     # what no flag said: the folder's, not the preset's
        ranking = configs.ranking
        notices.append(f"{RANKING_CONFIG_NOTICE} {out}'s (config.json), with the flags given in "
                       f"place of its fields: model {ranking.model}, task {ranking.task}, "
                       f"epochs {ranking.epochs}, co-occurrence neighbours "
                       f"{ranking.cooccurrence_neighbors}, popularity periods "
                       f"{ranking.popularity_periods}, title neighbours "
                       f"{ranking.title_neighbors}, title candidates "
                       f"{ranking.title_candidates}")
    notices += release_gaps(source["data"])
    notices += tie_order_notes(log)
    if log.unread_columns:
        notices.append(unread_columns_note(
            log.unread_columns,
            log.rating is None and (source.get("columns") or {}).get("rating") != NO_RATING))
    unread = sorted(set(log.item_features) - {*MODEL_ITEM_FEATURES, "title"})  # title: the ranker's
    if unread:
        notices.append(f"item features {unread} are not read: the models read "
                       f"{' and '.join(MODEL_ITEM_FEATURES)}, and the ranker title")
    if log.user_feature_rows:
        notices.append(f"user features {sorted(log.user_feature_rows)} change within a user: "
                       + ("every row reads its user's value of their last training row, which "
                          "under `random` can be later than a test row"
                          if configs.data.split == "random" else
                          "training and validation read each user's value of their last "
                          "training row, the test rows and the exports that of their last "
                          "training or validation row, never a later one"))
    configs, source = dataclasses.replace(configs, run=run), {**source,
                                                              "fingerprint": log_fingerprint}
    require_held_out(parts)
    if not continue_run:                                   # a continued run keeps its model
        retrieval, lowered = configs.retrieval.for_training_rows(len(parts.train))
        configs, notices = dataclasses.replace(configs, retrieval=retrieval), notices + lowered
    if resume:
        check_resumable(out, source, configs)
        backup = os.path.join(out, "checkpoints", "retrieval")
        notices.append(RESUMED_AFTER_RETRIEVAL if resume == AFTER_RETRIEVAL else
                       f"{RESUMED_TRAINING} ({backup})" if checkpointed(backup) else
                       RESTARTED_TRAINING)
    return CheckedRun(out, log, parts, configs, source,
                      report if continue_run else {}, notices, continue_run,
                      overwrite, resume)


SOURCE_KEYS = ("data", "columns", "delimiter", "data_dir")     # and the run's "fingerprint"


def check_source(source) -> None:
    """Raises ValueError, in one line, unless `source` is a dict `check_run` reads whole: a
    `data` text and only the keys of SOURCE_KEYS (a misspelt key would go unread)."""
    if not isinstance(source, dict) or not isinstance(source.get("data"), str):
        raise ValueError(f"the source must be a dict with 'data', a features.load source (a "
                         f"path, 'synthetic' or 'tfds:NAME'), got {source!r:.80}")
    unknown = sorted(set(source) - {*SOURCE_KEYS, "fingerprint"}, key=str)
    if unknown:
        raise ValueError(f"the source has keys {unknown} that nothing reads; it takes "
                         f"{list(SOURCE_KEYS)}")
    if not isinstance(source.get("columns") or {}, dict):
        raise ValueError(f"the source's 'columns' must map roles to column names, as "
                         f"{{'user': 'uid'}}, got {source['columns']!r:.80}")


def load_source(source: dict) -> Interactions:
    """The log of a source as `check_run` takes it (`features.load`)."""
    return load(source["data"], columns=source.get("columns") or {},
                delimiter=source.get("delimiter"), data_dir=source.get("data_dir"))


def read_run(out: str) -> tuple[dict, Configs]:
    """(source, configs) of an existing run folder; RunFolderError when it is none."""
    path = os.path.join(out, "config.json")
    if not os.path.exists(path):
        raise RunFolderError(f"{out}: not a run folder (no config.json); train retrieval "
                             "into it first (scripts/train_retrieval.py)")
    try:
        source, configs = run_config.read(path)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as error:
        raise RunFolderError(f"{path} cannot be read as a run's config ({type(error).__name__}: "
                             f"{error}); {TRAIN_AGAIN}") from None
    if source.get("columns") and has_fixed_columns(source["data"]):
        source = {**source, "columns": {}}   # recorded before they were refused; never read
    return source, configs


def check_cluster(strategy: str) -> list[str]:
    """Raises ValueError when the retrieval `strategy` needs a TF_CONFIG cluster this process
    is not in (parameter_server: one with ps tasks, this process its chief); for multi_worker
    without a cluster, returns the notice that it trains on this machine alone."""
    if strategy not in ("multi_worker", "parameter_server"):
        return []
    text = os.environ.get("TF_CONFIG", "")
    try:
        config = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as error:
        raise ValueError(f"TF_CONFIG is not JSON ({error}); it names the cluster of --strategy "
                         f"{strategy}") from None
    cluster, task = config.get("cluster") or {}, config.get("task") or {}
    if strategy == "parameter_server" and not (cluster.get("ps") and task.get("type") == "chief"):
        found = ("unset" if not text.strip() else
                 f"task {task.get('type')!r} in a cluster of {sorted(cluster)}")
        raise ValueError(f"--strategy parameter_server runs on the chief of a TF_CONFIG cluster "
                         f"with ps tasks (TF_CONFIG: {found}); set TF_CONFIG so (the ps and "
                         "worker tasks run python -m tworec.features.training), or use "
                         "--strategy mirrored on one machine")
    if strategy == "multi_worker" and not cluster:
        return ["--strategy multi_worker without a TF_CONFIG cluster trains on this machine "
                "alone"]
    return []


def gpu_settings_without_gpu(configs: Configs, continue_run: bool = False) -> list[str]:
    """The notice that XLA (jit_compile) and mixed precision, set for a model this run trains
    (a continued run trains ranking only), are for a GPU, when this machine has none."""
    stages = (configs.ranking,) if continue_run else (configs.retrieval, configs.ranking)
    slower = [flag for flag, name in (("--jit-compile", "jit_compile"),
                                      ("--mixed-precision", "mixed_precision"))
              if any(getattr(stage, name) for stage in stages)]
    if not slower:
        return []
    import tensorflow as tf
    if tf.config.list_physical_devices("GPU"):
        return []
    one = len(slower) == 1
    return [f"{' and '.join(slower)} {'is' if one else 'are'} for a GPU and this machine has "
            f"none: on a CPU {'it trains' if one else 'they train'} slower, not faster (leave "
            f"{'it' if one else 'them'} out here)"]


def check_fresh(out: str, overwrite: bool) -> str | None:
    """Raises RunFolderError unless `out` can take a new run: absent or an empty folder, with
    `overwrite` a run folder (nothing else is ever deleted), or without it a folder holding
    only an interrupted retrieval training or a run stopped after its retrieval trained;
    returns what the run resumes (TRAINING, AFTER_RETRIEVAL), None for a fresh one."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise RunFolderError(f"--out {out} is a file; name a folder for the run")
    if os.path.isdir(os.path.join(out, CLEARING)) and not overwrite:      # a stopped `clear`
        raise RunFolderError(f"--out {out}: replacing its run (--overwrite) was stopped midway; "
                             "rerun with --overwrite to finish, or name a new folder")
    if not os.path.isdir(out) or not set(os.listdir(out)) - {CLEARING}:   # `clear` deletes it
        return None
    if not os.path.exists(os.path.join(out, "config.json")):
        raise RunFolderError(f"--out {out} is a folder with other files in it; name a new or "
                             "empty folder for the run")
    if overwrite:
        return None
    if interrupted_retrieval(out):
        return TRAINING
    if stopped_after_retrieval(out):
        return AFTER_RETRIEVAL
    raise RunFolderError(f"--out {out} already holds a run; pass --overwrite to replace it, "
                         "or name a new folder")


@contextlib.contextmanager
def only_run_into(out: str):
    """Holds an exclusive lock on the run folder `out` while a command checks it and runs into
    it: a second command into the same folder is refused in one line (RunFolderError), as it
    would take a training in progress for an interrupted one and resume into it, or clear it
    with --overwrite. The folders it creates are removed again if the command leaves them
    empty. The lock goes with the process however it ends; a file system without `flock`
    (some NFS mounts) runs unlocked, and a file at `out` is left to `check_fresh` to refuse."""
    if os.path.exists(out) and not os.path.isdir(out):
        yield
        return
    made, path = [], os.path.abspath(out)                 # the folders it makes, deepest first
    while not os.path.exists(path):
        made.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(out, exist_ok=True)
        descriptor = os.open(out, os.O_RDONLY)
    except OSError as error:                     # under a file, a read-only place, or ''
        _remove_empty(made)
        raise RunFolderError(f"--out {out or repr(out)}: cannot make this folder "
                             f"({error.strerror or error}); name one that can be made") from None
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunFolderError(f"{out}: another process is running into this folder; wait "
                                 "for it to end, or name another folder") from None
        except OSError:
            pass                                        # no flock here: unlocked
        yield
    finally:
        os.close(descriptor)
        _remove_empty(made)


def _remove_empty(folders: list[str]) -> None:
    """Removes `folders` (deepest first) while they are empty."""
    for folder in folders:
        if not os.path.isdir(folder):                     # never made: its parent may be
            continue
        try:
            os.rmdir(folder)                              # refused once the run wrote in it
        except OSError:
            break


def interrupted_retrieval(out: str) -> bool:
    """Whether the run folder `out` holds nothing a finished step writes
    (`INTERRUPTED_RETRIEVAL`): a retrieval training that stopped, with a checkpoint to resume
    from or, stopped in its first epoch, none."""
    return set(os.listdir(out)) <= INTERRUPTED_RETRIEVAL


def stopped_after_retrieval(out: str) -> bool:
    """Whether the run folder `out` holds a run stopped (Ctrl-C, a failed step) after its
    retrieval training finished: the retrieval report saved (`save_retrieval_report`), no
    report.json."""
    return (os.path.exists(os.path.join(out, RETRIEVAL_REPORT))
            and not os.path.exists(os.path.join(out, "report.json")))


def save_retrieval_report(out: str, section: dict) -> None:
    """Writes the report's retrieval section (its training), atomically."""
    path = os.path.join(out, RETRIEVAL_REPORT)
    with open(path + ".tmp", "w") as f:
        json.dump(section, f)
    os.replace(path + ".tmp", path)


def resume_after_retrieval(out: str) -> dict:
    """Clears what the steps after retrieval wrote in `out` that a rerun would add to (the
    exports, the plots, the ranking's TensorBoard logs) and returns the saved retrieval
    section."""
    for name in ("export", "plots", os.path.join("tensorboard", "ranking")):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    with open(os.path.join(out, RETRIEVAL_REPORT)) as f:
        return json.load(f)


def checkpointed(backup: str) -> bool:
    """Whether a training's backup folder holds a checkpoint (`BackupAndRestore`'s)."""
    return os.path.exists(os.path.join(backup, "chief", "checkpoint"))


def check_resumable(out: str, source: dict, configs: Configs) -> None:
    """Raises RunFolderError unless the interrupted training in `out` was checkpointed by
    this tworec (with early stopping's state, and the retrieval config its config.json
    holds) and started with `source` (with the fingerprint of the log loaded now) and
    `configs` (fitted to it); a cold-start window the run chose counts as not given, as it is
    chosen again alike."""
    saved_source, saved = read_run(out)
    check_fingerprint_format(out, saved_source, "pass --overwrite to start over")
    backup = os.path.join(out, "checkpoints", "retrieval")
    if checkpointed(backup) and not (os.path.isdir(os.path.join(backup, "state"))
                                     and _stage_config(out) == saved.retrieval.to_json()):
        raise RunFolderError(f"--out {out} holds an interrupted training checkpointed by an "
                             "older tworec (without the early stopping state resuming needs, or "
                             "with fewer retrieval settings); pass --overwrite to start over")
    if configs.data.cold_start_window is None:
        saved = dataclasses.replace(saved, data=dataclasses.replace(saved.data,
                                                                    cold_start_window=None))
    changed = [difference for name in ("data", "retrieval", "ranking", "run")
               for difference in _config_differences(name, getattr(saved, name),
                                                     getattr(configs, name))]
    changed += [f"source {key} {saved_source.get(key)!r} in the folder, {source.get(key)!r} now"
                for key in sorted(set(source) | set(saved_source))
                if source.get(key) != saved_source.get(key)]
    if changed:
        raise RunFolderError(f"--out {out} holds an interrupted training started otherwise "
                             f"(these differ: {'; '.join(changed)}); rerun the command that "
                             "started it to resume it, or pass --overwrite to start over")


def _config_differences(name: str, saved, now) -> list[str]:
    """'NAME.FIELD SAVED in the folder, NOW now' for each field of a config whose value
    differs as config.json holds them (1 and 1.0 differ there)."""
    if _as_json(saved) == _as_json(now):
        return []
    before, after = dataclasses.asdict(saved), dataclasses.asdict(now)
    return [f"{name}.{field} {json.dumps(before.get(field))} in the folder, "
            f"{json.dumps(after.get(field))} now" for field in sorted(set(before) | set(after))
            if json.dumps(before.get(field)) != json.dumps(after.get(field))]


def _as_json(config) -> str:
    """A config as config.json (and a stage's checkpoint, STAGE_config.json) hold it: equal
    values of other types (1 and 1.0) are other configs there."""
    return json.dumps(dataclasses.asdict(config))


def _stage_config(out: str) -> str | None:
    """The text of the folder's retrieval_config.json (what its checkpoint was trained with:
    `features.training.run_callbacks` resumes it only under that text; the tworec that wrote
    the folder wrote config.json's retrieval section alike), None without one."""
    path = os.path.join(out, "retrieval_config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def check_fingerprint_format(out: str, saved_source: dict, advice: str) -> None:
    """Raises RunFolderError, ending with `advice`, when the folder's log fingerprint is of an
    older format, which cannot vouch for the log's ratings and side features."""
    if (saved_source.get("fingerprint") or {}).get("format") != FINGERPRINT_FORMAT:
        raise RunFolderError(f"{out}: made before runs fingerprinted the log's ratings and side "
                             f"features, so a change to them would go unnoticed; {advice}")


def clear(out: str) -> None:
    """Removes what a run wrote in `out` (a folder `check_fresh` accepted with overwrite): each
    entry is moved into `out/CLEARING` (config.json last), which is then deleted; a stop before
    it is gone leaves that folder, and `check_fresh` takes the folder for nothing but another
    --overwrite, whose `clear` deletes it with the rest."""
    aside = os.path.join(out, CLEARING)
    os.makedirs(aside, exist_ok=True)
    for name in sorted(RUN_ENTRIES, key=lambda name: name == "config.json"):
        if os.path.lexists(os.path.join(out, name)):
            os.replace(os.path.join(out, name), os.path.join(aside, name))
    shutil.rmtree(aside)


def fingerprint(log: Interactions) -> dict:
    """What identifies a log: its sizes and a digest of every column a run reads (the rows,
    ratings, ids, genre names and user and item features)."""
    columns = {"user": log.user, "item": log.item, "time": log.timestamp, "rating": log.rating,
               "user_ids": log.user_ids, "item_ids": log.item_ids,
               "genre_names": np.asarray(log.genre_names, dtype=str),
               **{f"user.{name}": values for name, values in log.user_features.items()},
               **{f"user_rows.{name}": values for name, values in log.user_feature_rows.items()},
               **{f"item.{name}": values for name, values in log.item_features.items()}}
    digest = hashlib.sha256()
    for name in sorted(columns):
        digest.update(f"{name}\0".encode())
        add_column(digest, columns[name])
    return {"format": FINGERPRINT_FORMAT, "interactions": int(len(log)),
            "users": int(log.num_users), "items": int(log.num_items),
            "sha256": digest.hexdigest()}


def add_column(digest, values) -> None:
    """Adds a column (None: absent) to a hashlib `digest`: its type, shape and values, text as
    UTF-8 with each value ended by a NUL (the values, not object pointers), an object array's
    values each with its type (None and "None", 1 and "1" differ)."""
    if values is None:
        digest.update(b"absent\0")
        return
    values = np.asarray(values)
    if values.dtype.kind in "OUS":
        typed = values.dtype.kind == "O"
        digest.update(f"text {values.shape}\0".encode())
        digest.update("".join(f"{type(value).__name__ + ' ' if typed else ''}{value}\0"
                              for value in values.ravel()).encode())
    else:
        digest.update(f"{values.dtype.str} {values.shape}\0".encode())
        digest.update(np.ascontiguousarray(values).tobytes())
