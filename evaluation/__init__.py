"""Evaluation: held-out sets per protocol, ranks and metrics, and the baselines every report
carries. Imports only `tworec.features`."""
from tworec.evaluation.baselines import (baseline_ranks, baselines, cold_start_window,
                                         prepared_baseline_ranks, prepared_baselines)
from tworec.evaluation.metrics import (KS, MISS, evaluate, evaluate_ranks, rank_metrics,
                                       target_ranks, top_k_rows)
from tworec.evaluation.sets import EvalSet, eval_set

__all__ = ["KS", "MISS", "EvalSet", "baseline_ranks", "baselines", "cold_start_window",
           "eval_set", "evaluate", "evaluate_ranks", "prepared_baseline_ranks",
           "prepared_baselines", "rank_metrics", "target_ranks", "top_k_rows"]
