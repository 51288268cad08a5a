"""The retrieval stage.

TFRS needs Keras 2, so `TF_USE_LEGACY_KERAS` is set before anything imports TensorFlow.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
