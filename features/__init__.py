"""The data layer: sources, Interactions, splits, vocabularies, history and tf.data pipelines."""

from tworec.features.interactions import DataError, Interactions
from tworec.features.splits import Split, split
from tworec.features.vocab import Vocabulary
from tworec.features.history import build_history
from tworec.features.sources import from_columns, load
from tworec.features.synthetic import SyntheticConfig, generate

__all__ = [
    "DataError", "Interactions", "Split", "split", "Vocabulary", "build_history", "load",
    "from_columns",
    "SyntheticConfig", "generate",
]
