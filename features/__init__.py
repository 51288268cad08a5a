"""The data layer: sources, Interactions, splits, vocabularies, history and tf.data pipelines.

TFRS needs Keras 2, so `TF_USE_LEGACY_KERAS` is set before anything imports TensorFlow.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from features.interactions import DataError, Interactions  # noqa: E402
from features.splits import Split, split  # noqa: E402
from features.vocab import Vocabulary  # noqa: E402
from features.history import build_history  # noqa: E402
from features.sources import load  # noqa: E402
from features.synthetic import SyntheticConfig, generate  # noqa: E402

__all__ = [
    "DataError", "Interactions", "Split", "split", "Vocabulary", "build_history", "load",
    "SyntheticConfig", "generate",
]
