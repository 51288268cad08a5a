"""tworec: from an interaction log to a served two-stage TensorFlow Recommenders model.

The packages live in the repository's top-level folders and install under this namespace:
`tworec.features` (data layer), `tworec.evaluation`, `tworec.retrieval`, `tworec.ranking`,
`tworec.serving` and `tworec.pipeline`. Importing any of them runs this file first, which is
the one place that selects Keras 2 (TFRS needs it) before anything imports TensorFlow, and
quiets TensorFlow's C++ and Python logs (`TWOREC_VERBOSE=1`, or a script's `--verbose`,
brings them back; errors always print).
"""
import logging
import os

VERBOSE_VARIABLE = "TWOREC_VERBOSE"
NOISY_LOGGERS = ("tensorflow", "absl", "h5py")

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


def verbose_requested() -> bool:
    """Whether `TWOREC_VERBOSE` asks for TensorFlow's own logs."""
    return os.environ.get(VERBOSE_VARIABLE, "") not in ("", "0")


def configure_logs(verbose: bool) -> None:
    """Quiets (or restores) TensorFlow's C++ logs (read when TensorFlow loads; a level the user
    set is kept unless `verbose`) and the Python loggers of TensorFlow, Keras and absl. Errors
    print either way."""
    if verbose or "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0" if verbose else "3"
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR)


configure_logs(verbose_requested())
