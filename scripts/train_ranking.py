"""Trains the ranking model on retrieval's candidates, evaluates it alone and as the second
stage over retrieval's top-K, and exports `ranking` and the composed `recommender`.

    python scripts/train_ranking.py --retrieval-run RUN [--model dcn|bst]
        [--task listwise|binary|regression] [--cooccurrence-neighbors K]
        [--title-neighbors K] [--title-candidates E] [--popularity-periods P] [--epochs N]
        [--mixed-precision] [--jit-compile]
    python scripts/train_ranking.py --data SOURCE --out RUN
        [--split temporal|random|global[:Q]|latest|none]
        [--preset tiny|default] [--members M] [--top-k 100] ...

With --retrieval-run, the retrieval model trained in RUN (by train_retrieval.py or the
pipeline) is reloaded, with RUN's own data source and configs, and ranking is trained into RUN;
otherwise retrieval is trained first, into the same new run folder, and its ScaNN index
tuned: the whole pipeline.
"""
import sys

from tworec.pipeline import cli
from tworec.pipeline.config import MODELS, PIPELINE, RANKING_ONLY, TASKS, RunConfig


def main(argv=None) -> int:
    parser = cli.parser_for(__doc__)
    cli.add_run_arguments(parser, out_required=False)
    parser.add_argument("--retrieval-run", metavar="RUN",
                        help="a run folder with a trained retrieval model to reuse")
    parser.add_argument("--model", choices=MODELS)
    parser.add_argument("--task", choices=TASKS)
    parser.add_argument("--cooccurrence-neighbors", type=int, metavar="K",
                        help="add the co-occurrence feature: each item's K most similar items "
                             "(0, the default: without it)")
    parser.add_argument("--title-neighbors", type=int, metavar="K",
                        help="the held-out title similarity: each item's K most similar titles "
                             "(default 50; 0: without it; refused for a regression ranker, which "
                             "reads none)")
    parser.add_argument("--title-candidates", type=int, metavar="E",
                        help="add to each known user's candidates the E items whose titles are "
                             "most like their latest items' (default 10; 0: none; refused for a "
                             "regression ranker)")
    parser.add_argument("--popularity-periods", type=int, metavar="P",
                        help="the held-out popularity signals: the items' popularity in P "
                             "periods of the known rows (default 20; 0: without them; refused "
                             "for a regression ranker, which reads none)")
    parser.add_argument("--top-k", type=int,
                        help="retrieval candidates to re-rank (default 100; a retrieval run "
                             "keeps its own)")
    cli.add_members_argument(parser)
    parser.add_argument("--mixed-precision", action="store_true", default=None,
                        help="train the ranker in float16 (weights float32; evaluated and "
                             "exported in float32), for a GPU")
    parser.add_argument("--jit-compile", action="store_true", default=None,
                        help="compile the ranker's training steps with XLA, for a GPU")
    args = parser.parse_args(argv)
    kept = [flag for flag, value in (("--data", args.data), ("--data-dir", args.data_dir),
                                     ("--split", args.split),
                                     ("--preset", args.preset), ("--top-k", args.top_k),
                                     ("--members", args.members),
                                     ("--columns", args.columns or None),
                                     ("--delimiter", args.delimiter),
                                     ("--cold-start-window", args.cold_start_window),
                                     ("--keep-seen", args.keep_seen or None),
                                     ("--overwrite", args.overwrite or None))
            if value is not None]
    if args.out and args.out != args.retrieval_run:
        kept.append("--out")
    if args.retrieval_run and kept:
        return cli.fail(f"--retrieval-run reuses RUN's data and configs and trains into RUN; "
                        f"leave out {' '.join(kept)}")
    if not (args.retrieval_run or args.out):
        return cli.fail("give --retrieval-run RUN, or --out RUN to train retrieval first")
    args.out = args.retrieval_run or args.out
    ranking = {name: value for name, value in (
        ("model", args.model), ("task", args.task),
        ("cooccurrence_neighbors", args.cooccurrence_neighbors),
        ("popularity_periods", args.popularity_periods),
        ("title_neighbors", args.title_neighbors),
        ("title_candidates", args.title_candidates),
        ("mixed_precision", args.mixed_precision),
        ("jit_compile", args.jit_compile)) if value is not None}
    if args.retrieval_run:
        return cli.run(args, RANKING_ONLY, continue_run=True, ranking=ranking)
    top_k = RunConfig.candidates if args.top_k is None else args.top_k
    return cli.run(args, PIPELINE, ranking=ranking,
                   retrieval=cli.members_given(args), run=cli.candidates_run(top_k))


if __name__ == "__main__":
    sys.exit(main())
