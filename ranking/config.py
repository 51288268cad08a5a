"""Configuration of the ranking stage, with named presets derived by `dataclasses.replace`."""
from __future__ import annotations

import dataclasses
import json
import numbers

MODELS = ("dcn", "bst")
TASKS = ("listwise", "binary", "regression")


@dataclasses.dataclass(frozen=True)
class RankingConfig:
    """Everything that decides a ranking run."""

    model: str = "dcn"                    # dcn | bst
    task: str = "listwise"                # listwise | binary | regression
    rating_weight: float = 0.1            # multitask rating head (0 disables; needs ratings)
    ranking_weight: float = 1.0
    embedding_dim: int = 32
    cross_layers: int = 2
    cross_structure: str = "stacked"      # stacked | parallel
    projection_dim: int | None = None     # low-rank cross layers
    deep_layers: tuple[int, ...] = (256, 128)
    use_retrieval_score: bool = True      # the retrieval score of each pair, when given
    use_transitions: bool = True          # how often the candidate followed the latest item
    cooccurrence_neighbors: int = 0       # similar items kept per item (0: no co-occurrence)
    cooccurrence_folds: int = 5           # user folds: training rows read out-of-fold values
    popularity_periods: int = 20          # periods of the known rows whose item popularity
                                          # calibration weighs (0: no popularity signals;
                                          # a regression ranker reads none)
    title_neighbors: int = 50             # similar titles kept per item, whose similarity to
                                          # the history calibration weighs (0: none; a log
                                          # without titles and a regression ranker read none)
    title_candidates: int = 10            # items added to retrieval's candidates: the most
                                          # title-similar to the user's latest items (0: none;
                                          # needs the title similarity)
    title_candidate_history: int = 3      # the latest history items they are similar to
    bst_heads: int = 8
    bst_layers: tuple[int, ...] = (1024, 512, 256)
    num_negatives: int = 9                # per positive, in a list of 1 + num_negatives
    hard_negative_share: float = 1.0      # of the negatives, drawn from retrieval's candidates
    learning_rate: float = 1e-3
    batch_size: int = 256
    epochs: int = 5
    early_stopping_patience: int = 2
    calibrate: bool = True                # refit the logit's balance on validation's served lists
    mixed_precision: bool = False
    jit_compile: bool = False
    seed: int = 0

    def validate(self, has_ratings: bool = True, history_length: int | None = None) -> None:
        """Raises ValueError naming the first setting that cannot work (with the data config's
        `history_length` when given)."""
        if self.model not in MODELS:
            raise ValueError(f"model {self.model!r}: choose one of {MODELS}")
        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r}: choose one of {TASKS}")
        if self.cross_structure not in ("stacked", "parallel"):
            raise ValueError(f"cross_structure {self.cross_structure!r}: stacked or parallel")
        if self.task == "regression" and not has_ratings:
            raise ValueError("task 'regression' needs ratings, and this log has none")
        if self.model == "bst" and history_length is not None and history_length <= 0:
            raise ValueError(f"model 'bst' needs history_length > 0, got {history_length}")
        if self.num_negatives <= 0 and self.task != "regression":
            raise ValueError(f"num_negatives must be positive for task {self.task!r}")
        if self.cooccurrence_neighbors < 0:
            raise ValueError("cooccurrence_neighbors must be >= 0 (0 turns the feature off), "
                             f"got {self.cooccurrence_neighbors}")
        if self.cooccurrence_folds < 2:
            raise ValueError("cooccurrence_folds must be at least 2, "
                             f"got {self.cooccurrence_folds}")
        if self.title_neighbors < 0:
            raise ValueError("title_neighbors must be >= 0 (0 turns the title similarity off), "
                             f"got {self.title_neighbors}")
        for name in ("title_candidates", "title_candidate_history"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 adds no title candidates), "
                                 f"got {getattr(self, name)}")
        if self.popularity_periods < 0:
            raise ValueError("popularity_periods must be >= 0 (0 turns the popularity signals "
                             f"off), got {self.popularity_periods}")
        if not 0 <= self.hard_negative_share <= 1:
            raise ValueError(f"hard_negative_share must be in [0, 1], got {self.hard_negative_share}")
        for name in ("embedding_dim", "bst_heads", "batch_size", "epochs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("cross_layers", "early_stopping_patience"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.projection_dim is not None and self.projection_dim <= 0:
            raise ValueError(f"projection_dim must be None or positive, got {self.projection_dim}")
        for name in ("deep_layers", "bst_layers"):
            layers = getattr(self, name)
            if not isinstance(layers, (tuple, list)) or not all(
                    isinstance(units, numbers.Integral) and not isinstance(units, bool)
                    and units > 0 for units in layers):
                raise ValueError(f"{name} must be positive layer widths, got {layers}")
        if not 0 < self.learning_rate < float("inf"):                 # NaN included
            raise ValueError(f"learning_rate must be a positive number, got {self.learning_rate}")
        for name in ("rating_weight", "ranking_weight"):
            if not 0 <= getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be 0 or a positive number, got "
                                 f"{getattr(self, name)}")
        if self.ranking_weight == 0 and self.task != "regression":
            raise ValueError(f"ranking_weight 0 leaves a {self.task} ranker's scores untrained; "
                             "give a positive ranking_weight, or task regression")

    @property
    def held_out_periods(self) -> int:
        """The popularity periods the ranker reads: none for a regression ranker, whose
        predicted ratings have no logit for calibration to weigh them in."""
        return 0 if self.task == "regression" else self.popularity_periods

    @property
    def held_out_title_neighbors(self) -> int:
        """The title neighbours the ranker reads: none for a regression ranker (no logit)."""
        return 0 if self.task == "regression" else self.title_neighbors

    @property
    def added_title_candidates(self) -> int:
        """The title candidates added to each served list: none without the title similarity
        or the history items they are similar to."""
        return (self.title_candidates
                if self.held_out_title_neighbors and self.title_candidate_history else 0)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


PRESETS = {
    "default": RankingConfig(),
    "tiny": RankingConfig(embedding_dim=8, deep_layers=(32,), bst_heads=2,
                          bst_layers=(32,), num_negatives=4, batch_size=64, epochs=2,
                          early_stopping_patience=0, learning_rate=5e-3),
}


def preset(name: str, **overrides) -> RankingConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown ranking preset {name!r}; known: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
