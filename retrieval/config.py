"""Configuration of the retrieval stage, with named presets derived by `dataclasses.replace`."""
from __future__ import annotations

import dataclasses
import json
import re

ENCODERS = ("none", "mean", "gru", "transformer")
STRATEGIES = ("default", "mirrored", "multi_worker", "parameter_server")
OPTIMIZERS = ("adam", "lazy_adam", "adagrad", "sgd")   # lazy_adam: sparse updates of big tables
PARTITIONER = re.compile(r"min_size(:0*[1-9][0-9]*)?|fixed:0*[1-9][0-9]*")   # positive N


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    """Everything that decides a retrieval run."""

    embedding_dim: int = 64               # per member
    members: int = 3                      # two-tower models trained side by side, served as
                                          # one (`TowerEnsemble`: the mean of their scores)
    history_encoder: str = "gru"          # none | mean | gru | transformer
    use_user_id: bool = True
    use_user_features: bool = True
    use_item_features: bool = True
    l2_normalize: bool = True
    temperature: float = 0.05
    logq_correction: bool = True
    remove_accidental_hits: bool = True
    num_hard_negatives: int | None = None
    optimizer: str = "adam"
    learning_rate: float = 3e-3
    batch_size: int = 512
    epochs: int = 8
    early_stopping_patience: int = 2      # epochs without validation recall@10 gain; 0 disables
    mixed_precision: bool = False
    jit_compile: bool = False
    strategy: str = "default"             # default | mirrored | multi_worker | parameter_server
    partitioner: str = "min_size"         # parameter_server: min_size[:BYTES] | fixed:N
    seed: int = 0

    def validate(self, history_length: int | None = None,
                 has_user_features: bool | None = None) -> None:
        """Raises ValueError naming the first setting that cannot work (with the data config's
        `history_length`, and whether the log has user features, when given; the devices are
        checked by `features.training.make_strategy`)."""
        user_features = self.use_user_features and has_user_features is not False
        if not (self.use_user_id or user_features or self.history_encoder != "none"):
            raise ValueError("the query tower reads nothing: keep use_user_id or a "
                             "history_encoder" + (" (this log has no user features)"
                                                  if has_user_features is False else
                                                  ", or use_user_features"))
        if self.history_encoder not in ENCODERS:
            raise ValueError(f"history_encoder {self.history_encoder!r}: choose one of {ENCODERS}")
        if self.history_encoder != "none" and history_length is not None and history_length <= 0:
            raise ValueError(f"history_encoder {self.history_encoder!r} needs history_length > 0, "
                             f"got {history_length}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: choose one of {OPTIMIZERS}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy {self.strategy!r}: choose one of {STRATEGIES}")
        if not PARTITIONER.fullmatch(self.partitioner):
            raise ValueError(f"partitioner {self.partitioner!r}: use min_size, min_size:BYTES "
                             "or fixed:N")
        if self.mixed_precision and self.strategy == "parameter_server":
            raise ValueError("mixed_precision with strategy 'parameter_server': Keras's loss "
                             "scaling does not support it; use mirrored or multi_worker, or "
                             "float32")
        if self.jit_compile and self.strategy == "parameter_server":
            raise ValueError("jit_compile with strategy 'parameter_server': XLA's step cannot "
                             "read variables the ps tasks hold; use the strategy without it")
        for name in ("embedding_dim", "members", "batch_size", "epochs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_hard_negatives is not None and self.num_hard_negatives <= 0:
            raise ValueError("num_hard_negatives must be None or positive, got "
                             f"{self.num_hard_negatives}")
        for name in ("temperature", "learning_rate"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):                 # NaN included
                raise ValueError(f"{name} must be a positive number, got {value}")
        if self.early_stopping_patience < 0:
            raise ValueError("early_stopping_patience must be 0 (off) or positive, got "
                             f"{self.early_stopping_patience}")

    def require_whole_batch(self, rows: int) -> None:
        """Raises ValueError when `rows` training rows hold no whole batch (an epoch trains on
        whole batches, and would hold none)."""
        if rows < self.batch_size:
            raise ValueError(f"batch_size {self.batch_size} is larger than the training split "
                             f"({rows} rows)")

    def for_training_rows(self, rows: int) -> tuple["RetrievalConfig", list[str]]:
        """The config with its batch lowered to `rows` when larger (an epoch trains on whole
        batches, and would hold none), and a notice when it was lowered."""
        if 0 < rows < self.batch_size:
            return dataclasses.replace(self, batch_size=rows), [
                f"batch_size {self.batch_size} lowered to the training rows, {rows}"]
        return self, []

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


PRESETS = {
    "default": RetrievalConfig(),
    "tiny": RetrievalConfig(embedding_dim=16, members=1, batch_size=128, epochs=3,
                            early_stopping_patience=0, learning_rate=1e-2),
}


def preset(name: str, **overrides) -> RetrievalConfig:
    """A named preset with some fields replaced."""
    if name not in PRESETS:
        raise ValueError(f"unknown retrieval preset {name!r}; known: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
