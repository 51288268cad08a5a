"""TF Serving's export layout: `BASE/VERSION/` SavedModels, `models.config`, warmup records.

A new version is written into a temporary folder inside BASE (a name that is not an integer,
so TF Serving and our server skip it) and renamed into place: a poller never sees half a model.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable


def list_versions(base_path: str) -> list[int]:
    """Integer versions under `base_path`, increasing; other folder names are skipped."""
    if not os.path.isdir(base_path):
        return []
    return sorted(int(name) for name in os.listdir(base_path)
                  if name.isdigit() and os.path.isdir(os.path.join(base_path, name)))


def next_version(base_path: str) -> int:
    versions = list_versions(base_path)
    return versions[-1] + 1 if versions else 1


def write_version(base_path: str, write: Callable[[str], None], version: int | None = None) -> str:
    """Writes a version atomically.

    Args:
        base_path: the model's folder.
        write: called with a temporary folder to fill (e.g. `tf.saved_model.save`).
        version: the version number, or the next free one.

    Returns:
        The folder of the new version.
    """
    os.makedirs(base_path, exist_ok=True)
    version = next_version(base_path) if version is None else int(version)
    final = os.path.join(base_path, str(version))
    if os.path.exists(final):
        raise FileExistsError(f"{final} exists; versions are never overwritten")
    staging = tempfile.mkdtemp(prefix=f".tmp-{version}-", dir=base_path)
    try:
        write(staging)
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final
