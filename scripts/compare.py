"""Compares retrieval configs on the validation rows, the way a change is chosen: every arm
trained with every seed, and each arm's gain over the first with its paired bootstrap 95%
interval over users.

    python scripts/compare.py --data SOURCE --out DIR --arm NAME[:FIELD=VALUE,...] --arm ...
        [--split temporal|random|global] [--preset tiny|default] [--epochs N] [--seeds 0 1 2]

FIELD=VALUE replaces a field of the retrieval config (`retrieval.config.RetrievalConfig`), e.g.
`--arm one:members=1 --arm three:members=3`. Prints the table and writes DIR/compare.md,
DIR/compare.json and DIR/ranks.npz (the rank of every validation row under each arm and seed,
and the row's user). Test rows are never scored.
"""
import json
import os
import sys

import numpy as np

from tworec.pipeline import cli
from tworec.pipeline.compare import ARM_FORM, check_arms, compare, parse_arm, table
from tworec.pipeline.config import resolve
from tworec.pipeline.folder import load_source

OUTPUTS = ("compare.md", "compare.json", "ranks.npz")


def main(argv=None) -> int:
    parser = cli.parser_for(__doc__)
    cli.add_run_arguments(parser, out_help="the folder of the comparison's results")
    parser.add_argument("--arm", action="append", default=[], metavar="NAME[:FIELD=VALUE,...]",
                        help=f"an arm of the comparison ({ARM_FORM}); two or more, the first "
                             "is the reference")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="every arm trains once with each (default: 0 1 2)")
    args = parser.parse_args(argv)
    if any(os.path.exists(os.path.join(args.out, name)) for name in OUTPUTS) \
            and not args.overwrite:
        return cli.fail(f"{args.out} already holds a comparison; pass --overwrite or another "
                        "--out")
    source = cli.source_of(args)
    try:
        arms = [parse_arm(text) for text in args.arm]
        configs = resolve(args.preset or "default", epochs=args.epochs,
                          steps=("train retrieval",), data=cli.data_given(args))
        check_arms(arms, configs, args.seeds)
        log = load_source(source)
    except ValueError as error:                       # DataError included
        return cli.fail(str(error))
    cli.show_logs(args)
    result, ranks = compare(log, configs, arms, args.seeds)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump({"source": source, "configs": configs.to_dict(), **result}, f, indent=2)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(table(result))
    np.savez(os.path.join(args.out, "ranks.npz"), **ranks)
    print(table(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
