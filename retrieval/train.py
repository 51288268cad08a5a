"""Training and full-catalogue evaluation of the two-tower model."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tworec.evaluation import KS, EvalSet, eval_set, evaluate, top_k_rows
from tworec.evaluation.metrics import prepared_ranks, rank_metrics
from tworec.features.batches import batches, batches_in_order, steps_per_epoch as one_pass
from tworec.features.inputs import EMPTY_SLOT, ModelInputs
from tworec.features.stream import PreparedLog
from tworec.features.vocab import FIRST
from tworec.features.training import (Float32Twin, make_optimizer, make_strategy,
                                      mixed_precision, train, worker_seed)
from tworec.retrieval.config import RetrievalConfig
from tworec.retrieval.index import equal_rows, exact_scorer
from tworec.retrieval.model import RetrievalModel, TowerEnsemble, TwoTower


def build_model(config: RetrievalConfig, data: ModelInputs | PreparedLog) -> RetrievalModel:
    """A compiled two-tower model for the vocabularies and item features of in-memory inputs,
    or of a prepared log (its catalogue is its item vocabulary; no item or user features)."""
    if isinstance(data, PreparedLog):
        num_items = data.num_items
        sizes = dict(num_users=data.num_users, item_index=data.item_index(),
                     item_vocab_size=num_items + FIRST,
                     item_genres=np.zeros((num_items, 0), np.float32),
                     item_year=np.zeros(num_items, np.int32), user_feature_sizes={})
    else:
        sizes = dict(num_users=data.users.size, item_index=data.item_index,
                     item_vocab_size=data.items.size, item_genres=data.item_genres,
                     item_year=data.item_year,
                     user_feature_sizes={n: v.size for n, v in data.user_feature_vocabs.items()})
    kind = TwoTower if config.members == 1 else TowerEnsemble
    model = kind(config, history_length=data.history_length,
                 item_probability=data.item_probability, **sizes)
    model.compile(optimizer=make_optimizer(config.optimizer, config.learning_rate,
                                           config.mixed_precision),
                  jit_compile=config.jit_compile)
    return model


def embed_items(model: RetrievalModel, codes: np.ndarray, batch_size: int = 8192) -> np.ndarray:
    """[n, d] float32 candidate-tower embeddings of catalogue codes [n]."""
    return np.concatenate([model.candidate(batch["item"]).numpy() for batch in
                           batches_in_order({"item": codes.astype(np.int64)}, batch_size)])


def candidate_embeddings(model: RetrievalModel, num_items: int,
                         batch_size: int = 8192) -> np.ndarray:
    """[num_items, d] float32 embeddings of the whole catalogue, one computed per distinct
    input of the candidate tower (`TwoTower.candidate_inputs`) and copied to the items that
    share it: the tower gives an input a few ulps apart at different batch positions, which
    would break the tie of identical items (such as those without training rows)."""
    first, inverse = equal_rows(model.candidate_inputs()[:num_items])
    return embed_items(model, first, batch_size)[inverse]                        # [I, d]


def query_embeddings(model: RetrievalModel, examples: dict[str, np.ndarray],
                     batch_size: int = 4096) -> np.ndarray:
    """[m, d] float32 query embeddings of example rows (d: `embedding_dim` x members)."""
    if not len(examples["user"]):
        return np.zeros((0, model.config.embedding_dim * model.config.members), np.float32)
    return np.concatenate([model.query(batch).numpy()
                           for batch in batches_in_order(examples, batch_size)])


def latest_queries(model: RetrievalModel, data: ModelInputs) -> np.ndarray:
    """[num_users, d] every user's query embedding from their state (`data.latest`, what the
    export serves for a user id)."""
    features = {"user": data.users.remap(data.interactions.user_ids), "history": data.latest}
    features.update({f"user_{name}": index for name, index in data.user_feature_index.items()})
    return query_embeddings(model, features)


def embeddings_for_ranking(model: RetrievalModel, data: ModelInputs) -> dict:
    """The arrays the ranking stage takes as its retrieval signal: `queries` (part -> [m, d]),
    `latest` ([num_users, d]) and `items` ([num_items, d])."""
    return {"queries": {part: query_embeddings(model, examples)
                        for part, examples in data.examples.items()},
            "latest": latest_queries(model, data),
            "items": candidate_embeddings(model, data.num_items)}


def popular_order(data: ModelInputs | PreparedLog, part: str) -> np.ndarray:
    """[num_items] float32 scores that order the catalogue as users unknown before `part` are
    served (`ModelInputs.popular`; a prepared log: by training popularity, ties to the lower
    code), strictly decreasing: the served order, not a tie."""
    order = (np.argsort(-data.item_probability, kind="stable") if isinstance(data, PreparedLog)
             else data.popular[part].order)
    scores = np.empty(data.num_items, np.float32)
    scores[order] = -np.arange(data.num_items)
    return scores


def catalogue_scorer(model: RetrievalModel, data: ModelInputs, part: str, evalset: EvalSet):
    """positions [b] into `evalset` -> scores [b, num_items], as the export scores them: the
    towers' dot products for users it knows (identical items tying exactly: `exact_scorer`),
    the popular order for the others."""
    catalogue = exact_scorer(candidate_embeddings(model, data.num_items))
    queries = query_embeddings(model, data.examples[part])
    popular = popular_order(data, part)

    def score(positions: np.ndarray) -> np.ndarray:
        scores = catalogue(queries[positions])                                    # [b, I]
        scores[~evalset.known[positions]] = popular
        return scores
    return score


def evaluate_model(model: RetrievalModel, data: ModelInputs, part: str = "test", ks=KS,
                   evalset: EvalSet | None = None) -> dict[str, float]:
    """Recall@K (the hit rate of the held-out item) and NDCG@K over the full catalogue, each
    user's known items excluded (unless `data.exclude_seen` is off) and the items without
    rows known before the part never ranked, as the export serves."""
    evalset = evalset or eval_set(data.interactions, data.split, part,
                                  exclude_seen=data.exclude_seen)
    return evaluate(catalogue_scorer(model, data, part, evalset), evalset, ks, name="retrieval")


def evaluate_prepared(model: RetrievalModel, prepared: PreparedLog, part: str = "test", ks=KS,
                      memory_limit: str = "1GB") -> dict[str, float]:
    """`evaluate_model` for a prepared log, in bounded memory: held-out rows arrive in batches
    with their users' known items (`PreparedLog.heldout_batches`), and each batch is scored
    against the whole catalogue ([b, num_items], at most SCORES_BYTES) as the export scores
    it; memory holds the candidates' embeddings, one batch, one rank per row and one pass of
    held-out users' known items (at most `SEEN_ROWS_PER_PASS` log rows).

    The catalogue is the prepared log's (the items with training rows): a held-out item
    outside it is a miss. Users it does not know get the training popularity order (not
    `ModelInputs.popular`). On a log whose every item has training rows and every held-out
    user training rows (a temporal split) this equals `evaluate_model`; otherwise
    `evaluate_model` also ranks the test part's items with validation rows alone (on the OOV
    embedding)."""
    # every item of a prepared log is an input of its own (its own id, no item features)
    catalogue = exact_scorer(embed_items(model, np.arange(prepared.num_items)))
    popular = popular_order(prepared, part)

    def score(rows: dict) -> np.ndarray:
        queries = query_embeddings(model, {"user": rows["user"], "history": rows["history"]},
                                   batch_size=len(rows["user"]))                  # [b, d]
        scores = catalogue(queries)                                               # [b, I]
        scores[~rows["known"]] = popular
        return scores
    ranks = prepared_ranks({"retrieval": score}, prepared, part, memory_limit)["retrieval"]
    return rank_metrics(ranks, ks)


def top_candidates(model: RetrievalModel, data: ModelInputs, part: str, k: int,
                   evalset: EvalSet | None = None, batch_size: int = 2048) -> np.ndarray:
    """[m, k] catalogue codes of the best k items for every row of `part`, best first (ties to
    the lower code, as the export), `EMPTY_SLOT` where fewer than k items remain (the export's
    empty id). Without `evalset`, among the training rows' items (the lists a ranker trains
    on know no other). With `evalset` (of that part) rows are scored as `catalogue_scorer`
    does, its excluded items and those outside its catalogue skipped: the export's
    candidates."""
    if evalset is None:
        catalogue = exact_scorer(candidate_embeddings(model, data.num_items))
        queries = query_embeddings(model, data.examples[part])
        untrained = data.item_index < FIRST

        def score(positions: np.ndarray) -> np.ndarray:
            scores = catalogue(queries[positions])                                # [b, I]
            scores[:, untrained] = -np.inf
            return scores
    else:
        score = catalogue_scorer(model, data, part, evalset)
    result = []
    for start in range(0, len(data.examples[part]["user"]), batch_size):
        positions = np.arange(start, min(start + batch_size, len(data.examples[part]["user"])))
        scores = score(positions)                                                 # [b, I]
        if evalset is not None:
            rows, cols = evalset.excluded[positions].nonzero()
            scores[rows, cols] = -np.inf
            scores[:, ~evalset.catalogue] = -np.inf
        best = top_k_rows(scores, k)
        best[np.isneginf(np.take_along_axis(scores, best, 1))] = EMPTY_SLOT
        result.append(best)
    return np.concatenate(result) if result else np.zeros((0, k), np.int64)


class ValidationRecall(tf.keras.callbacks.Callback):
    """Logs `val_recall@10` (full catalogue) of the model's float32 twin, what would be
    exported (`Float32Twin`), after every epoch, for early stopping."""

    def __init__(self, data: ModelInputs, float32: Float32Twin):
        super().__init__()
        self.data, self.float32 = data, float32
        self.evalset = eval_set(data.interactions, data.split, "validation",
                                exclude_seen=data.exclude_seen)

    def on_epoch_end(self, epoch, logs=None):
        metrics = evaluate_model(self.float32(self.model), self.data, "validation", ks=(10,),
                                 evalset=self.evalset)
        logs["val_recall@10"] = metrics["recall@10"]
        logs["val_ndcg@10"] = metrics["ndcg@10"]


def fit(data: ModelInputs, config: RetrievalConfig, run_dir: str | None = None,
        verbose: int = 1, steps_per_epoch: int | None = None,
        validate: bool = True) -> tuple[RetrievalModel, dict]:
    """Trains a two-tower model on in-memory inputs.

    Args:
        data: the model inputs (`features.inputs.prepare`); validation drives early stopping.
        config: the stage's configuration, checked before anything trains.
        run_dir: where the config, TensorBoard logs and resumable checkpoints go.
        steps_per_epoch: steps of an epoch; default one pass over the training rows.
        validate: score the validation rows after every epoch (and stop early on them).

    Returns:
        (model, summary) with summary holding per-epoch logs, seconds and examples/s; the
        model computes in float32 even when it trained under mixed precision
        (`features.training.Float32Twin`).
    """
    config.validate(history_length=data.history_length,
                    has_user_features=bool(data.user_feature_vocabs))
    train_rows = data.examples["train"]
    config.require_whole_batch(len(train_rows["user"]))
    steps = steps_per_epoch or one_pass(len(train_rows["user"]), config.batch_size,
                                        drop_remainder=True)
    return _fit(data, config, steps, run_dir, verbose,
                lambda seed: batches(train_rows, config.batch_size, shuffle=True, seed=seed,
                                     epochs=None, drop_remainder=True),
                validation=data if validate and len(data.split.validation) else None)


def fit_prepared(prepared: PreparedLog, config: RetrievalConfig, steps_per_epoch: int | None = None,
                 run_dir: str | None = None, verbose: int = 1) -> tuple[RetrievalModel, dict]:
    """Trains a two-tower model on a prepared log streamed from its shards
    (`PreparedLog.training_batches`), for `config.epochs` epochs of `steps_per_epoch` steps
    (default: one pass over the training rows). No validation runs between epochs
    (`evaluate_prepared` scores a part afterwards). The model computes in float32, as `fit`'s."""
    config.validate(history_length=prepared.history_length)
    config.require_whole_batch(prepared.train_rows)
    steps = steps_per_epoch or prepared.train_rows // config.batch_size
    return _fit(prepared, config, steps, run_dir, verbose,
                lambda seed: prepared.training_batches(config.batch_size, seed))


def _fit(data: ModelInputs | PreparedLog, config: RetrievalConfig, steps: int,
         run_dir: str | None, verbose: int, dataset, validation: ModelInputs | None = None
         ) -> tuple[RetrievalModel, dict]:
    """Builds the model under the config's strategy and trains it on `dataset(seed)`, an
    endless dataset of batches, validating (and stopping early) on `validation`'s rows when
    given; returns the model's float32 twin (the model itself when it trained in float32)."""
    tf.keras.utils.set_random_seed(config.seed)
    strategy = make_strategy(config.strategy, config.partitioner, config.jit_compile)
    with strategy.scope(), mixed_precision(config.mixed_precision):
        model = build_model(config, data)
    if isinstance(strategy, tf.distribute.ParameterServerStrategy):
        # Keras asks a dataset function of this strategy; every worker runs the same one, so
        # each draws its seed when it makes the dataset and reads its own shuffle of all rows.
        train_data = tf.keras.utils.experimental.DatasetCreator(
            lambda context: dataset(worker_seed()))
    else:
        train_data = dataset(config.seed)
    float32 = Float32Twin(lambda: build_model(config, data), train_data)
    callbacks = []
    if validation is not None:
        callbacks.append(ValidationRecall(validation, float32))
        if config.early_stopping_patience:
            callbacks.append(tf.keras.callbacks.EarlyStopping(
                "val_recall@10", mode="max", patience=config.early_stopping_patience,
                restore_best_weights=True))
    summary = train(model, train_data, stage="retrieval", config=config, steps_per_epoch=steps,
                    examples_per_epoch=steps * config.batch_size, callbacks=callbacks,
                    run_dir=run_dir, verbose=verbose)
    summary["loss"] = {"logq_correction": config.logq_correction,
                       "remove_accidental_hits": config.remove_accidental_hits,
                       "num_hard_negatives": config.num_hard_negatives}
    return float32(model), summary
