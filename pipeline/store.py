"""What a run folder keeps so that it can be evaluated, exported or served again, or its ranking
retrained, without retraining retrieval:

    RUN/config.json              the data source and the resolved configs (`pipeline.config`)
    RUN/vocab/users.json, items.json   the vocabularies the models were built with
    RUN/retrieval/weights.*      the trained two-tower model's weights (a TF checkpoint)
"""
from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from tworec.features.inputs import ModelInputs
from tworec.features.training import float32_policy
from tworec.features.vocab import Vocabulary
from tworec.pipeline.folder import RunFolderError
from tworec.retrieval.config import RetrievalConfig
from tworec.retrieval.model import RetrievalModel
from tworec.retrieval.train import build_model


def save_vocabularies(run_dir: str, inputs: ModelInputs) -> None:
    for vocab in (inputs.users, inputs.items):
        vocab.save(os.path.join(run_dir, "vocab", f"{vocab.name}.json"))


def check_vocabularies(run_dir: str, inputs: ModelInputs) -> None:
    """Raises RunFolderError unless the log prepared now gives the vocabularies the run's
    models were built with (the same log, split and configs)."""
    for vocab in (inputs.users, inputs.items):
        path = os.path.join(run_dir, "vocab", f"{vocab.name}.json")
        if not os.path.exists(path):
            raise RunFolderError(f"{run_dir}: no {path}; train retrieval into it first")
        if not np.array_equal(Vocabulary.load(path).ids, vocab.ids):
            raise RunFolderError(f"{run_dir}: the log gives other {vocab.name} than the run was "
                                 "trained on; use the run's own data source")


def _weights_path(run_dir: str) -> str:
    return os.path.join(run_dir, "retrieval", "weights")


def save_retrieval(run_dir: str, model: RetrievalModel) -> None:
    tf.train.Checkpoint(model=model).write(_weights_path(run_dir))


def load_retrieval(run_dir: str, inputs: ModelInputs, config: RetrievalConfig) -> RetrievalModel:
    """The run's trained two-tower model, rebuilt from its config and the inputs and restored,
    in float32 as `retrieval.train.fit` returns it, whatever precision it trained in."""
    path = _weights_path(run_dir)
    if not tf.io.gfile.exists(path + ".index"):
        raise RunFolderError(f"{run_dir}: no trained retrieval model ({path}.index)")
    with float32_policy():
        model = build_model(config, inputs)
    model.candidate(tf.zeros([1], tf.int64))                         # creates the variables
    model.query({name: values[:1] for name, values in inputs.examples["train"].items()})
    tf.train.Checkpoint(model=model).read(path).expect_partial().assert_existing_objects_matched()
    return model
