"""Trains the two-tower retrieval model, evaluates it beside the baselines, tunes a ScaNN index
and exports `retrieval` (brute force) and `retrieval_scann` SavedModels.

    python scripts/train_retrieval.py --data SOURCE --out RUN
        [--split temporal|random|global[:Q]|latest|none] [--preset tiny|default]
        [--epochs N] [--members M]
        [--strategy default|mirrored|multi_worker|parameter_server] [--partitioner min_size]
        [--optimizer adam|lazy_adam|adagrad|sgd] [--batch-size B] [--mixed-precision]
        [--jit-compile]

The run folder can then be given to `train_ranking.py --retrieval-run RUN`.
"""
import sys

from tworec.pipeline import cli
from tworec.pipeline.config import ENCODERS, OPTIMIZERS, RETRIEVAL_ONLY, STRATEGIES, RunConfig


def main(argv=None) -> int:
    parser = cli.parser_for(__doc__)
    cli.add_run_arguments(parser)
    parser.add_argument("--top-k", type=int, default=RunConfig.candidates,
                        help="items the exports return")
    cli.add_members_argument(parser)
    parser.add_argument("--batch-size", type=int,
                        help="the global batch, split across the replicas (preset's default)")
    parser.add_argument("--history-encoder", choices=ENCODERS,
                        help="how the query tower reads the user's latest items")
    parser.add_argument("--strategy", choices=STRATEGIES,
                        help="default (one device); mirrored: every local GPU or CPU device; "
                             "multi_worker and parameter_server read TF_CONFIG")
    parser.add_argument("--optimizer", choices=OPTIMIZERS,
                        help="adam (default); lazy_adam updates only the embedding rows a batch "
                             "touches, for tables of millions of rows")
    parser.add_argument("--partitioner",
                        help="--strategy parameter_server: how the embedding tables split "
                             "across the ps tasks: min_size (default), min_size:BYTES, fixed:N")
    parser.add_argument("--mixed-precision", action="store_true", default=None,
                        help="train in float16 (weights float32; evaluated and exported in "
                             "float32), for a GPU")
    parser.add_argument("--jit-compile", action="store_true", default=None,
                        help="compile the training steps with XLA, for a GPU")
    args = parser.parse_args(argv)
    if args.partitioner and args.strategy != "parameter_server":
        return cli.fail("--partitioner splits tables across parameter servers: it goes with "
                        "--strategy parameter_server")
    retrieval = {name: value for name, value in (
        ("batch_size", args.batch_size), ("history_encoder", args.history_encoder),
        ("strategy", args.strategy), ("partitioner", args.partitioner),
        ("optimizer", args.optimizer),
        ("mixed_precision", args.mixed_precision),
        ("jit_compile", args.jit_compile)) if value is not None} | cli.members_given(args)
    return cli.run(args, RETRIEVAL_ONLY, retrieval=retrieval, run=cli.candidates_run(args.top_k))


if __name__ == "__main__":
    sys.exit(main())
