"""Compares retrieval or ranking configs on the validation rows, the way a change is chosen:
every arm trained with every seed, and each arm's gain over the first with its paired
bootstrap 95% interval over users.

    python scripts/compare.py --data SOURCE --out DIR --arm NAME[:FIELD=VALUE,...] --arm ...
        [--stage retrieval|ranking] [--split temporal|global[:Q]] [--preset tiny|default]
        [--epochs N] [--seeds 0 1 2] [--top-k 100] [--top-n 10]

FIELD=VALUE replaces a field of the stage's config (`retrieval.config.RetrievalConfig`, or
`ranking.config.RankingConfig` with --stage ranking), e.g. `--arm one:members=1 --arm
three:members=3`. Ranking arms re-rank the lists of one retrieval model per seed and retrieval
config, shown as retrieval alone for the first arm's config; a ranking arm's
`retrieval.FIELD=VALUE` sets a field of its retrieval config (`--arm one:retrieval.members=1`),
and an arm re-ranks the lists of the first arm with the same config (retrieval alone, or
`retrieval alone (retrieval:NAME)`). Prints the table and writes DIR/compare.md,
DIR/compare.json and DIR/ranks.npz (the rank of every validation row under each arm and seed,
and the row and its user), rewritten after every seed: a comparison that stops keeps the seeds
it finished. No test row is scored. A log whose ties are listed by item id is noted (stderr, the
table and compare.json's "notes").
"""
import os
import shlex
import sys

from tworec.features.sources import tie_order_notes
from tworec.pipeline import cli
from tworec.pipeline.compare import (ARM_FORM, OUTPUTS, check_arms, compare, identical_arms,
                                     parse_arm, seeds_named, table, validation_split, write)
from tworec.pipeline.config import RunConfig, resolve
from tworec.pipeline.folder import RunFolderError, load_source, only_run_into


TRAINED = {"retrieval": ("train retrieval",),          # the stages --epochs sets
           "ranking": ("train retrieval", "train ranking")}


def main(argv=None) -> int:
    parser = cli.parser_for(__doc__)
    cli.add_run_arguments(parser, out_help="the folder of the comparison's results",
                          split_help="temporal (default) or global[:Q]: the protocols with "
                                     "validation rows")
    parser.add_argument("--arm", action="append", default=[], metavar="NAME[:FIELD=VALUE,...]",
                        help=f"an arm of the comparison ({ARM_FORM}); two or more, the first "
                             "is the reference")
    parser.add_argument("--stage", choices=("retrieval", "ranking"), default="retrieval",
                        help="the config the arms change: retrieval (default) or ranking, "
                             "whose arms re-rank one retrieval model's lists per seed and "
                             "retrieval config (an arm's retrieval.FIELD=VALUE)")
    cli.add_list_arguments(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="every arm trains once with each (default: 0 1 2)")
    args = parser.parse_args(argv)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        return cli.fail(f"--out {args.out} is a file; give a folder")
    ours = {*OUTPUTS, *(name + ".partial" for name in OUTPUTS)}    # a stopped write's too
    try:
        others = sorted(set(os.listdir(args.out)) - ours) if os.path.isdir(args.out) else []
    except OSError as error:
        return cli.fail(f"--out {args.out}: {error.strerror or error}")
    if others:                                 # a run folder, or anyone's: not ours to fill
        return cli.fail(f"--out {args.out} is a folder with other files in it ({others[0]}); "
                        "name a new or empty folder, or one holding a comparison")
    if any(os.path.exists(os.path.join(args.out, name)) for name in OUTPUTS) \
            and not args.overwrite:
        return cli.fail(f"{args.out} already holds a comparison; pass --overwrite or another "
                        "--out")
    try:
        with only_run_into(args.out):           # locked; folders it makes go if left empty
            return _compare(args, sys.argv if argv is None else ["scripts/compare.py", *argv])
    except RunFolderError as error:
        return cli.fail(str(error))
    except OSError as error:                  # --out cannot be made
        return cli.fail(f"--out {args.out}: {error.strerror or error}")


def _compare(args, argv: list[str]) -> int:
    """Checks everything, then compares and writes into the folder --out; the exit code.
    `argv`: the command line, the script's path first."""
    if not os.access(args.out, os.W_OK | os.X_OK):
        return cli.fail(f"--out {args.out}: cannot write in this folder")
    try:
        source = cli.source_of(args)
        arms = [parse_arm(text, args.stage) for text in args.arm]
        if args.stage == "retrieval" and (args.top_k, args.top_n) != (RunConfig.candidates,
                                                                       RunConfig.top_n):
            return cli.fail("--top-k and --top-n set the lists ranking arms re-rank; give "
                            "them with --stage ranking (retrieval arms rank the catalogue)")
        configs = resolve(args.preset or "default", epochs=args.epochs,
                          steps=TRAINED[args.stage], data=cli.data_given(args),
                          run=cli.list_run(args))
        check_arms(arms, configs, args.seeds)
        cli.show_logs(args)
        log = load_source(source)
        notes = tie_order_notes(log) + identical_arms(arms, configs)
        parts = validation_split(log, configs, arms)
    except ValueError as error:                       # DataError included
        return cli.fail(str(error))
    except OSError as error:
        return cli.fail(f"--data {source['data']}: {error}")
    for name in OUTPUTS:                  # --overwrite: an older comparison's files go now
        if os.path.exists(os.path.join(args.out, name)):
            os.remove(os.path.join(args.out, name))
    written = []
    for note in notes:
        print(f"note: {note}", file=sys.stderr)

    command = shlex.join(["python", *argv])

    def write_seeds(result: dict, ranks: dict) -> None:
        """The seeds done so far, written: a comparison that stops keeps them."""
        write(args.out, {**result, "notes": notes, "command": command}, ranks, source, configs)
        written[:] = result["seeds"]

    def kept() -> str:
        return (f"{os.path.join(args.out, 'compare.md')} holds {seeds_named(written)}"
                if written else "no seed finished, nothing was written")
    try:
        result, ranks = compare(log, parts, configs, arms, args.seeds, seed_done=write_seeds)
        write_seeds(result, ranks)
    except ValueError as error:
        return cli.failed(f"{error}; {kept()}")
    except OSError as error:
        return cli.failed(f"--out {args.out}: the results could not be written ({error}); "
                          f"{kept()}")
    except KeyboardInterrupt:
        print(f"error: stopped; {kept()}", file=sys.stderr)
        return 130
    print(table({**result, "notes": notes, "command": command}), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
