"""Prints one JSON object describing a log: counts, split sizes, dropped rows by reason and
notes (a log whose ties are listed by item id).

    python scripts/describe_data.py --data SOURCE [--split temporal|random|global[:Q]|latest|none]
        [--columns user=..,item=..,time=..]
        [--delimiter ';'] [--summary-only] [--memory-limit 1GB]

Parquet shards (a folder or a glob) are always summarised without loading them (counts, time
range, rows per shard, by DuckDB under --memory-limit) and without the split, which needs the
whole log; --summary-only does the same for one .parquet file and skips the split elsewhere.
"""
import json
import sys

from tworec.features import DataError, load, shards, split
from tworec.features.inputs import DataConfig
from tworec.features.sources import DELIMITER_HELP, parse_columns, tie_order_notes
from tworec.pipeline import cli


def main(argv=None) -> int:
    parser = cli.parser_for(__doc__)
    parser.add_argument("--data", default="synthetic",
                        help="synthetic[:PRESET], tfds:NAME, a GroupLens folder or .zip, a "
                             ".csv/.tsv/.parquet log, or Parquet shards (a folder of .parquet "
                             "files or a glob such as 'logs/part-*.parquet')")
    parser.add_argument("--split", default=None,
                        help="the split whose sizes to count, as the pipeline's --split: "
                             "temporal (the default), random, global[:Q], latest or none")
    parser.add_argument("--columns", default="", help="column mapping for generic logs, "
                        "e.g. user=uid,item=sku,time=ts,rating=stars")
    parser.add_argument("--delimiter", default=None, help=DELIMITER_HELP)
    parser.add_argument("--data-dir", default=None, help="TFDS data directory")
    parser.add_argument("--summary-only", action="store_true",
                        help="counts and time range without the split; a .parquet log is then "
                             "counted by DuckDB without loading it (always so for shards)")
    parser.add_argument("--memory-limit", default="1GB",
                        help="DuckDB's memory limit when it counts Parquet files (default 1GB; "
                             "beyond it DuckDB spills to a temporary folder)")
    args = parser.parse_args(argv)
    try:
        shards.memory_bytes(args.memory_limit)
    except ValueError as error:
        return cli.fail(f"--memory-limit: {error}")
    try:
        if args.split is not None:
            DataConfig(split=args.split).validate()        # before the log loads
        columns = parse_columns(args.columns)
        found = shards.find(args.data)
        summary_only = args.summary_only or found is not None
        if summary_only and args.split is not None:
            return cli.fail(f"--split: {args.data} is summarised without the split (it needs "
                            "the whole log in memory); leave out --split"
                            + ("" if found is not None else " or --summary-only"))
        if summary_only and (found is not None or args.data.endswith(".parquet")):
            if args.delimiter is not None:
                return cli.fail(f"--delimiter: {args.data} is Parquet; the option applies only "
                                "to .csv/.tsv/.txt logs")
            print(json.dumps(shards.describe(args.data, columns, args.memory_limit)))
            return 0
        interactions = load(args.data, columns=columns, data_dir=args.data_dir,
                            delimiter=args.delimiter)
        parts = None if summary_only else split(interactions, args.split or "temporal")
    except DataError as error:
        return cli.fail(str(error))
    except KeyboardInterrupt:
        print("error: stopped (Ctrl-C)", file=sys.stderr)
        return 130
    summary = interactions.summary()
    summary["time_range"] = [int(interactions.timestamp.min()), int(interactions.timestamp.max())]
    if parts is not None:
        summary.update(split=args.split or "temporal", split_sizes=parts.sizes(),
                       test_users=int(len(set(interactions.user[parts.test].tolist()))),
                       short_users=parts.short_users, notes=tie_order_notes(interactions))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
