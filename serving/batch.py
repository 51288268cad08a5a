"""Every known user's top-n from an export, scored a batch at a time into one Parquet file.

    rows = score_all("RUN/export/recommender", "recs.parquet", n=10, batch_size=1024)

Any export whose `serving_default` maps `user_id` [b] string to `item_ids` [b, k] string and
`scores` [b, k] float32 works (retrieval, retrieval_scann, recommender). It is loaded the way
the server loads it (`LoadedModel`: tag `serve`, a session of its own). Its users are the ones
it knows: `assets.extra/state.json` records only how many, so the ids are read from the table
of known users baked into the export (`UserInputs.user_positions`, see `features.layers`), in
the order of their codes, and checked against that count.

The file has one row per (user, item), best first: user_id string, rank int32 (1-based),
item_id string, score float32, and title string (null when unknown) when titles are given;
one row group per batch; empty slots (item id "") are left out. Memory holds the user ids
and one batch's results; the file appears under its name only once it is complete.
"""
from __future__ import annotations

import collections
import functools
import json
import os
import secrets
import sys
import warnings
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tworec.serving.layout import list_versions
from tworec.serving.recommender import PAD_ID

STATE_FILE = os.path.join("assets.extra", "state.json")        # written by features.layers
# Where each export keeps its table of known users: retrieval and retrieval_scann hold their
# `UserInputs` as `users`; the composed recommender holds the retrieval SavedModel.
USER_TABLES = ("users.user_positions", "retrieval.users.user_positions")


class ExportError(ValueError):
    """An export that cannot be scored; the message names it and what would work."""


def saved_model_dir(export: str, version: int | None = None) -> str:
    """The SavedModel folder of an export: version `version` of the base path `export` (the
    latest when None), or `export` itself when it is a SavedModel folder.

    Raises:
        ExportError: naming the export and what would work.
    """
    if os.path.isfile(os.path.join(export, "saved_model.pb")):
        if version is not None:
            raise ExportError(f"{export} is a SavedModel folder itself, not a folder of versions; "
                             "leave out the version or give its parent")
        return export
    versions = [v for v in list_versions(export)
                if os.path.isfile(os.path.join(export, str(v), "saved_model.pb"))]
    if not versions:
        raise ExportError(f"{export} holds no SavedModel (no VERSION/saved_model.pb in it); "
                         "give an export folder such as RUN/export/recommender")
    if version is None:
        return os.path.join(export, str(versions[-1]))
    if version not in versions:
        raise ExportError(f"{export} has no version {version}; its versions are "
                         f"{', '.join(map(str, versions))}")
    return os.path.join(export, str(version))


def known_user_ids(path: str) -> np.ndarray:
    """[U] bytes: the users a SavedModel folder knows, in the order of their codes.

    Raises:
        ExportError: when the export holds no table of known users, or one whose size differs
            from the count in its `state.json`.
    """
    import tensorflow as tf

    from tworec.serving.model import register_custom_ops
    register_custom_ops()                       # a retrieval_scann export holds ScaNN's ops
    root = tf.saved_model.load(path)
    tables = [_attribute(root, name) for name in USER_TABLES]
    table = next((table for table in tables if table is not None), None)
    if table is None:
        raise ExportError(f"{path} has no table of known users ({' or '.join(USER_TABLES)}); "
                         "every user is scored only for the exports tworec writes "
                         "(retrieval, retrieval_scann, recommender)")
    keys, positions = tf.raw_ops.LookupTableExportV2(
        table_handle=table.resource_handle, Tkeys=tf.string, Tvalues=tf.int64)     # [U], [U]
    users = keys.numpy()[np.argsort(positions.numpy())]
    state_path = os.path.join(path, STATE_FILE)
    if os.path.exists(state_path):
        with open(state_path) as f:
            counted = json.load(f).get("users")
        if counted is not None and counted != len(users):
            raise ExportError(f"{path}: its table of known users holds {len(users)} users but "
                             f"{STATE_FILE} counts {counted}")
    return users


def score_all(export: str, out: str, n: int = 10, batch_size: int = 1024,
              titles: dict[str, str] | None = None, version: int | None = None,
              progress: Callable[[int, int], None] | None = None) -> int:
    """Writes every known user's top `n` items of an export to a Parquet file.

    Args:
        export: an export's base path (e.g. RUN/export/recommender) or a version folder.
        out: the Parquet file to write (replaced if it exists).
        n: items per user at most (the export may return fewer: a UserWarning says so).
        batch_size: users per model run, and rows of users per row group.
        titles: item id -> title; adds the `title` column.
        version: the version to load; the latest when None.
        progress: called after each batch with (users done, users in all).

    Returns:
        The number of rows written.
    """
    if n < 1 or batch_size < 1:
        raise ValueError(f"n and batch_size must be at least 1, got {n} and {batch_size}")
    from tworec.serving.model import LoadedModel
    path = saved_model_dir(export, version)
    users = known_user_ids(path)                                                    # [U]
    model = LoadedModel(path, run_warmup=False)
    partial = None
    try:
        partial = partial_file(out)                  # renamed to `out` once complete
        _check_signature(model, path)
        rows = _write_batches(model, users, partial, n, batch_size, titles, progress)
        os.replace(partial, out)
    finally:
        model.close()
        if partial is not None and os.path.exists(partial):
            os.unlink(partial)
    return rows


def partial_file(out: str) -> str:
    """A new empty file beside `out`, named after it and hidden (`.NAME.XXXX.partial`): what
    is written before it is renamed to `out`, never a file of the user's, nor another run's (a
    killed run leaves it behind). Its mode is a new file's (0666 less the umask). Raises
    OSError when the folder cannot be written."""
    folder, name = os.path.split(out)
    while True:                         # mkstemp's file would be 0600: the kernel applies the
        path = os.path.join(folder or ".", f".{name}.{secrets.token_hex(4)}.partial")
        try:                            # umask (and any default ACL) to 0666 itself
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue


def _write_batches(model, users: np.ndarray, path: str, n: int, batch_size: int,
                   titles: dict[str, str] | None,
                   progress: Callable[[int, int], None] | None) -> int:
    """Scores `users` [U] a batch at a time, one row group each; returns the rows written."""
    rows = titled = 0
    short = collections.Counter()                     # users with 0, or fewer than n, items
    first_empty = None
    with pq.ParquetWriter(path, _schema(titles is not None)) as writer:
        for start in range(0, len(users), batch_size):
            batch = users[start:start + batch_size]                                     # [b]
            outputs = model.run({"user_id": batch})
            listed = min(n, outputs["item_ids"].shape[1])           # the export's width
            if start == 0 and listed < n:
                warnings.warn(f"the export returns {listed} items per user, fewer than the {n} "
                              "asked for; the file holds those")
            filled = (outputs["item_ids"][:, :n] != PAD_ID).sum(axis=1)                # [b]
            short["none"] += int((filled == 0).sum())
            short["fewer"] += int(((filled > 0) & (filled < listed)).sum())
            if first_empty is None and (filled == 0).any():
                first_empty = batch[np.argmax(filled == 0)]
            table = batch_table(batch, outputs["item_ids"][:, :n], outputs["scores"][:, :n],
                                titles)
            writer.write_table(table, row_group_size=max(len(table), 1))
            rows += len(table)
            titled += len(table) - table.column("title").null_count if titles is not None else 0
            if progress:
                progress(start + len(batch), len(users))
    if short["none"]:
        example = first_empty.decode("utf-8", "replace") if isinstance(
            first_empty, bytes) else str(first_empty)
        warnings.warn(f"{short['none']} known users got no item back (their seen items are "
                      "excluded; a ScaNN export may also find fewer), so the file has no row "
                      f"of them, e.g. {example!r}")
    if short["fewer"]:
        warnings.warn(f"{short['fewer']} known users got fewer than {listed} items back (their "
                      "seen items are excluded; a ScaNN export may also find fewer)")
    if titles is not None and rows and not titled:
        warnings.warn("no item written has one of the titles given (another catalogue's ids?); "
                      "the title column is empty")
    return rows


def batch_table(user_ids: np.ndarray, item_ids: np.ndarray, scores: np.ndarray,
                titles: dict[str, str] | None = None) -> pa.Table:
    """One batch's rows: (user, rank, item, score[, title]) for every filled slot.

    Args:
        user_ids: [b] bytes.
        item_ids: [b, k] bytes, best first; `PAD_ID` marks an empty slot.
        scores: [b, k] float32.
        titles: item id -> title, or None for no title column.
    """
    rows, slots = np.nonzero(item_ids != PAD_ID)                      # [m], by user then rank
    items = pa.array(item_ids[rows, slots], pa.binary()).cast(pa.string())
    columns = {"user_id": pa.array(user_ids[rows], pa.binary()).cast(pa.string()),
               "rank": pa.array(slots + 1, pa.int32()),
               "item_id": items,
               "score": pa.array(scores[rows, slots], pa.float32())}
    if titles is not None:
        columns["title"] = pa.array([titles.get(item) for item in items.to_pylist()],
                                    pa.string())
    return pa.table(columns, schema=_schema(titles is not None))


def _schema(with_titles: bool) -> pa.Schema:
    """The columns of the file; `title` only when titles are given."""
    schema = pa.schema([("user_id", pa.string()), ("rank", pa.int32()),
                        ("item_id", pa.string()), ("score", pa.float32())])
    return schema.append(pa.field("title", pa.string())) if with_titles else schema


def _check_signature(model, path: str) -> None:
    """Refuses an export whose serving_default is not user_id -> item_ids, scores."""
    signature = model.signature("")
    inputs, outputs = sorted(signature.inputs), sorted(signature.outputs)
    if inputs != ["user_id"] or not {"item_ids", "scores"} <= set(outputs):
        raise ExportError(f"{path}: serving_default takes {', '.join(inputs)} and "
                         f"returns {', '.join(outputs)}; scoring every user needs user_id -> "
                         "item_ids, scores (a retrieval, retrieval_scann or recommender export)")


def _attribute(root, dotted: str):
    """`root.a.b` for "a.b"; None when any step is missing."""
    return functools.reduce(lambda obj, name: getattr(obj, name, None), dotted.split("."), root)


class Progress:
    """Prints how many users are scored: on a terminal one line rewritten in place and erased
    at the end, otherwise a line at each further tenth; nothing for a run of one batch.

    Call: (users done, users in all).
    """

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.tenths = 0                                   # the last tenth printed

    def __call__(self, done: int, total: int) -> None:
        line = f"scored {done:,} of {total:,} users ({100 * done // total}%)"
        if self.stream.isatty():
            print("\r\033[K" + (line if done < total else ""), end="", file=self.stream,
                  flush=True)
        elif self.tenths < 10 * done // total and done < total:
            self.tenths = 10 * done // total
            print(line, file=self.stream, flush=True)
