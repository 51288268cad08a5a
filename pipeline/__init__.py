"""The run: data -> retrieval -> index -> ranking -> evaluation -> exports -> served check ->
report, as one library flow (`tworec.pipeline.run`) that every entry point calls.

    from tworec.pipeline import PIPELINE, execute, prepare_run, resolve
    run = prepare_run("runs/demo", {"data": "synthetic"}, resolve("tiny"))
    report = execute(run, PIPELINE)

The flow (and TensorFlow with it) is imported on first use, so that the configs and the
scripts' `--help` load fast.
"""
from tworec.pipeline.config import PIPELINE, Configs, RunConfig, resolve

_LAZY = {"Run", "execute", "prepare_run", "start_run"}

__all__ = ["PIPELINE", "Configs", "RunConfig", "resolve", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        from tworec.pipeline import run
        return getattr(run, name)
    raise AttributeError(f"module 'tworec.pipeline' has no attribute {name!r}")
