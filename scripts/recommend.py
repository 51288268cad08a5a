"""Prints a user's recommendations from served `retrieval` and `ranking` models.

    python scripts/recommend.py --user ID [--url http://127.0.0.1:8501 | --grpc HOST:PORT]
        [--n 10] [--movies items.csv] [--seen ID,ID,...]

`--movies` is a CSV with an item id column (`item_id`, GroupLens's `movieId`, or another name
the loader knows) and a `title` column, for titles beside the ids: a GroupLens `movies.csv`
works as it is.
"""
import argparse
import csv
import sys

from tworec.features.sources import DEFAULT_COLUMNS
from tworec.serving.client import Client
from tworec.serving.errors import ServingError
from tworec.serving.recommender import PAD_ID, Recommender


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--user", required=True, help="the user id")
    parser.add_argument("--url", default="http://127.0.0.1:8501", help="REST address")
    parser.add_argument("--grpc", default="", help="gRPC HOST:PORT (instead of --url)")
    parser.add_argument("--n", type=int, default=10, help="how many items")
    parser.add_argument("--seen", default="", help="comma-separated item ids to leave out")
    parser.add_argument("--movies", default="",
                        help="CSV with an item id column (item_id, movieId, ...) and title")
    parser.add_argument("--retrieval_model", default="retrieval")
    parser.add_argument("--ranking_model", default="ranking")
    return parser.parse_args(argv)


def read_titles(path: str) -> dict[str, str]:
    """item id -> title from a CSV whose item id column has any name the loader knows."""
    if not path:
        return {}
    with open(path, newline="", encoding="utf-8") as f:
        rows = csv.DictReader(f)
        names = rows.fieldnames or ()
        ids = next((name for name in DEFAULT_COLUMNS["item"] if name in names), None)
        if ids is None or "title" not in names:
            raise ValueError(f"{path} needs an item id column (one of "
                             f"{', '.join(DEFAULT_COLUMNS['item'])}) and a title column; "
                             f"it has {', '.join(names)}")
        return {row[ids]: row["title"] for row in rows}


def main(argv=None) -> int:
    args = parse_args(argv)
    client = Client(grpc_target=args.grpc) if args.grpc else Client(url=args.url)
    seen = [args.seen.split(",")] if args.seen else None
    try:
        titles = read_titles(args.movies)
        result = Recommender(client, args.retrieval_model, args.ranking_model).recommend(
            [args.user], n=args.n, seen=seen)
    except (OSError, ValueError, ServingError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"recommendations for user {args.user}:")
    for rank, (item, score) in enumerate(zip(result["item_ids"][0], result["scores"][0]), 1):
        if item == PAD_ID:
            break
        item = item.decode("utf-8")
        print(f"{rank:3d}. {item:>12s}  {score:8.4f}  {titles.get(item, '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
