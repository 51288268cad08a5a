"""tworec: from an interaction log to a served two-stage TensorFlow Recommenders model.

The packages live in the repository's top-level folders and install under this namespace:
`tworec.features` (data layer), `tworec.evaluation`, `tworec.retrieval`, `tworec.ranking`,
`tworec.serving` and `tworec.pipeline`. Importing any of them runs this file first, which is
the one place that selects Keras 2 (TFRS needs it) before anything imports TensorFlow.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
