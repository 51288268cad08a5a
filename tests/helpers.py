"""Helpers several test files import."""
import subprocess
import sys

import numpy as np


def exit_before_tensorflow(argv: list[str]) -> subprocess.CompletedProcess:
    """Runs the script argv[0] with argv in a fresh Python; its stdout is then "CODE LOADED":
    the exit code and whether TensorFlow was imported (stderr is the script's)."""
    return subprocess.run([sys.executable, "-c", (
        "import runpy, sys\n"
        f"sys.argv = {argv!r}\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as exit:\n    code = exit.code\n"
        "print(code, 'tensorflow' in sys.modules)")], capture_output=True, text=True, timeout=60)


def answers_of(export: str, user_ids: list[str]) -> np.ndarray:
    """[u, n] item ids a SavedModel export serves to `user_ids`."""
    import tensorflow as tf
    import tworec.serving  # noqa: F401  (the environment the exports are loaded in)
    signature = tf.saved_model.load(export).signatures["serving_default"]
    return signature(user_id=tf.constant(user_ids))["item_ids"].numpy().astype(str)
