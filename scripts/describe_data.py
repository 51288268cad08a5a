"""Prints one JSON object describing a log: counts, split sizes and dropped rows by reason.

    python scripts/describe_data.py --data SOURCE [--split temporal|random] [--columns user=..,item=..,time=..]
        [--delimiter ';']
"""
import json
import sys

from tworec.features import DataError, load, split
from tworec.features.sources import DELIMITER_HELP, parse_columns
from tworec.pipeline import cli


def main(argv=None) -> int:
    parser = cli.parser_for(__doc__)
    parser.add_argument("--data", default="synthetic",
                        help="synthetic[:PRESET], tfds:NAME, a GroupLens folder or .zip, or a "
                             ".csv/.tsv/.parquet log")
    parser.add_argument("--split", default="temporal", choices=["temporal", "random"])
    parser.add_argument("--columns", default="", help="column mapping for generic logs, "
                        "e.g. user=uid,item=sku,time=ts,rating=stars")
    parser.add_argument("--delimiter", default=None, help=DELIMITER_HELP)
    parser.add_argument("--data-dir", default=None, help="TFDS data directory")
    args = parser.parse_args(argv)
    try:
        interactions = load(args.data, columns=parse_columns(args.columns), data_dir=args.data_dir,
                            delimiter=args.delimiter)
        parts = split(interactions, args.split)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    summary = interactions.summary()
    summary.update(split=args.split, split_sizes=parts.sizes(),
                   test_users=int(len(set(interactions.user[parts.test].tolist()))),
                   short_users=parts.short_users)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
