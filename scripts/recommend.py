"""Prints a user's recommendations from served `retrieval` and `ranking` models.

    python scripts/recommend.py --user ID [--url http://127.0.0.1:8501 | --grpc HOST:PORT]
        [--n 10] [--movies items.csv] [--seen ID,ID,...]

`--movies` is a CSV with `item_id` and `title` columns, for titles beside the ids.
"""
import argparse
import csv
import sys


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
    parser.add_argument("--movies", default="", help="CSV with item_id,title columns")
    parser.add_argument("--retrieval_model", default="retrieval")
    parser.add_argument("--ranking_model", default="ranking")
    return parser.parse_args(argv)


def read_titles(path: str) -> dict[str, str]:
    if not path:
        return {}
    with open(path, newline="", encoding="utf-8") as f:
        rows = csv.DictReader(f)
        if not {"item_id", "title"} <= set(rows.fieldnames or ()):
            raise ValueError(f"{path} needs item_id and title columns, has {rows.fieldnames}")
        return {row["item_id"]: row["title"] for row in rows}


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
