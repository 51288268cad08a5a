"""One command from a log to served recommendations and a report.

    python scripts/pipeline.py --data SOURCE --out RUN
        [--split temporal|random|global[:Q]|latest|none] [--preset tiny|default] [--epochs N]
        [--members M] [--top-k K] [--top-n N]

Steps: load and split, train retrieval, evaluate it beside the baselines, tune the ScaNN index,
train ranking on retrieval's candidates, export every model with `models.config`, serve them
with the embedded server on free ports, query test users over REST and gRPC against the
in-process models, and write RUN/report.json, RUN/report.md and RUN/plots/.
"""
import sys

from tworec.pipeline import cli
from tworec.pipeline.config import PIPELINE


def main(argv=None) -> int:
    parser = cli.parser_for(__doc__)
    cli.add_run_arguments(parser)
    cli.add_list_arguments(parser)
    cli.add_members_argument(parser)
    args = parser.parse_args(argv)
    return cli.run(args, PIPELINE, retrieval=cli.members_given(args),
                   run=cli.list_run(args))


if __name__ == "__main__":
    sys.exit(main())
