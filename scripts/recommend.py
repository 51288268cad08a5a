"""Prints a user's recommendations from served models, or writes every user's from an export.

    python scripts/recommend.py --user ID [--url http://127.0.0.1:8501 | --grpc HOST:PORT]
        [--n 10] [--movies items.csv] [--seen ID,ID,...]
    python scripts/recommend.py --all --export RUN/export/recommender [--version V]
        --out recs.parquet [--n 10] [--movies items.csv] [--batch-size 1024]

--user asks the served `retrieval` and `ranking` models. --all loads an export (recommender,
retrieval or retrieval_scann) and writes the top n of every user it knows to a Parquet file,
a batch at a time: columns user_id, rank (1-based), item_id, score, and title with --movies.

`--movies` is a CSV with an item id column (`item_id`, GroupLens's `movieId`, or another name
the loader knows) and a `title` column, for titles beside the ids: a GroupLens `movies.csv`
works as it is.

A mistake in the arguments stops with one line, `error: ...`, and exit code 2, before any
model loads; so does an export that turns out not to be scorable once loaded (no table of
known users, another signature). Any other failure exits with 1.
"""
import argparse
import os
import sys
import warnings

from tworec.features.interactions import DataError
from tworec.features.sources import read_titles
from tworec.pipeline import cli

# The flags of each way of running, to refuse those the other one would ignore.
SERVER_FLAGS = {"--url": "url", "--grpc": "grpc", "--seen": "seen",
                "--retrieval_model": "retrieval_model", "--ranking_model": "ranking_model"}
EXPORT_FLAGS = {"--export": "export", "--version": "version", "--out": "out",
                "--batch-size": "batch_size"}


def parse_args(argv) -> argparse.Namespace:
    parser = cli.parser_for(__doc__)
    parser.add_argument("--user", help="the user id, for one user's recommendations")
    parser.add_argument("--all", action="store_true",
                        help="every user an export knows, into --out (with --export)")
    parser.add_argument("--n", type=int, default=10, help="how many items per user")
    parser.add_argument("--movies", default="",
                        help="CSV with an item id column (item_id, movieId, ...) and title")
    parser.add_argument("--url", help="--user: REST address (default http://127.0.0.1:8501)")
    parser.add_argument("--grpc", help="--user: gRPC HOST:PORT (instead of --url)")
    parser.add_argument("--seen", help="--user: comma-separated item ids to leave out")
    parser.add_argument("--retrieval_model", help="--user: served name (default retrieval)")
    parser.add_argument("--ranking_model", help="--user: served name (default ranking)")
    parser.add_argument("--export", help="--all: an export folder, e.g. RUN/export/recommender")
    parser.add_argument("--version", type=int, help="--all: the version (default the latest)")
    parser.add_argument("--out", help="--all: the Parquet file to write")
    parser.add_argument("--batch-size", type=int, help="--all: users per batch (default 1024)")
    return parser.parse_args(argv)


def mistake(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, in one line naming the flag; None when nothing is."""
    if args.user and args.all:
        return ("--user and --all exclude each other: --user ID asks a server for one user, "
                "--all scores every user of --export")
    if not (args.user or args.all):
        return ("give --user ID (one user, from a server) or --all --export DIR --out FILE "
                "(every user of an export)")
    mode, other, flags = (("--all", "--user", SERVER_FLAGS) if args.all else
                          ("--user", "--all", EXPORT_FLAGS))
    ignored = [flag for flag, name in flags.items() if getattr(args, name) is not None]
    if ignored:
        verb = "goes" if len(ignored) == 1 else "go"
        return f"{', '.join(ignored)} {verb} with {other}, not {mode}"
    if args.n < 1:
        return f"--n must be at least 1, got {args.n}"
    if args.url and args.grpc:
        return ("--url and --grpc exclude each other: give the server's REST address or its "
                "gRPC one")
    if args.url and not args.url.startswith(("http://", "https://")):
        return f"--url {args.url}: give the scheme too, e.g. http://{args.url}"
    if args.grpc and (args.grpc.startswith(("http://", "https://")) or ":" not in args.grpc):
        address = args.grpc.split("://")[-1]
        return (f"--grpc {args.grpc}: give HOST:PORT, with no scheme and the port, e.g. "
                f"{address if ':' in address else address + ':8500'}")
    if not args.all:
        return None
    if not args.export:
        return "--all needs --export, an export folder such as RUN/export/recommender"
    if not args.out:
        return "--all needs --out, the Parquet file to write, e.g. --out recs.parquet"
    if os.path.isdir(args.out):
        return (f"--out {args.out} is a folder; give a file in it, e.g. "
                f"{os.path.join(args.out, 'recs.parquet')}")
    if not args.out.endswith(".parquet"):
        return (f"--out {args.out}: the file is written as Parquet; name it .parquet, e.g. "
                f"{os.path.splitext(args.out)[0]}.parquet")
    folder = os.path.dirname(args.out)
    if folder and not os.path.isdir(folder):
        return f"--out {args.out}: the folder {folder} does not exist"
    from tworec.serving.batch import ExportError, partial_file, saved_model_dir
    try:                                  # what recommend_all writes first, then renames
        os.unlink(partial_file(args.out))
    except OSError as error:
        return f"--out {args.out}: cannot write it here ({error.strerror or error})"
    if args.batch_size is not None and args.batch_size < 1:
        return f"--batch-size must be at least 1, got {args.batch_size}"
    try:
        saved_model_dir(args.export, args.version)
    except ExportError as error:
        return f"--export {error}"
    return None


def fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def server_hint(error: Exception, ranking_model: str) -> str:
    """'; ...' saying what would answer: a server where none listens, the ranking stage of a
    run served without one; '' for other errors."""
    code, text = getattr(error, "code", None), str(error)
    if code == "UNAVAILABLE" and any(words in text.lower() for words in ("connection refused",
                                                                         "failed to connect")):
        return ("; is a server running there? start one with python scripts/serve.py "
                "--model_config_file RUN/export/models_scann.config")
    if code == "NOT_FOUND" and f"({ranking_model})" in text:
        return (f"; the server serves no {ranking_model!r} model (a run of retrieval alone?): "
                "train its ranking with python scripts/train_ranking.py --retrieval-run RUN, "
                "or write retrieval's lists with --all --export RUN/export/retrieval --out "
                "recs.parquet")
    return ""


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = mistake(args)
    if problem:
        return fail(problem)
    try:
        titles = read_titles(args.movies) if args.movies else {}
    except DataError as error:
        return fail(f"--movies {error}")
    if args.all:
        return recommend_all(args, titles if args.movies else None)
    return recommend_one(args, titles)


def recommend_one(args: argparse.Namespace, titles: dict[str, str]) -> int:
    """Prints one user's top n from the served models."""
    from tworec.serving.client import Client
    from tworec.serving.errors import ServingError
    from tworec.serving.recommender import PAD_ID, Recommender
    client = (Client(grpc_target=args.grpc) if args.grpc else
              Client(url=args.url or "http://127.0.0.1:8501"))
    seen = [args.seen.split(",")] if args.seen else None
    try:
        with client:
            recommender = Recommender(client, args.retrieval_model or "retrieval",
                                      args.ranking_model or "ranking")
            result = recommender.recommend([args.user], n=args.n, seen=seen)
            try:
                known = recommender.known_users([args.user])
            except (OSError, ServingError):          # for a note only: the list stands
                known = None
    except (OSError, ValueError, ServingError) as error:
        return fail(f"{error}{server_hint(error, args.ranking_model or 'ranking')}", code=1)
    print(f"recommendations for user {args.user}:")
    items = [item.decode("utf-8") for item in result["item_ids"][0] if item != PAD_ID]
    for rank, (item, score) in enumerate(zip(items, result["scores"][0]), 1):
        print(f"{rank:3d}. {item:>12s}  {score:8.4f}  {titles.get(item, '')}")
    if len(items) < args.n:
        print(f"note: the served models returned {len(items)} items, fewer than the {args.n} "
              "asked for")
    if known is not None and not known[0]:
        print(f"note: the models were fit on no rows of user {args.user}: this is the list "
              "every user they do not know gets" + (", less the --seen items" if seen else ""))
    if titles and items and not any(item in titles for item in items):
        print(f"note: no item here has a title in --movies {args.movies} (another catalogue's "
              "ids?)")
    return 0


def recommend_all(args: argparse.Namespace, titles: dict[str, str] | None) -> int:
    """Writes every known user's top n of an export to --out."""
    import tworec
    from tworec import console
    if not tworec.verbose_requested():
        console.filter_native_logs()
    from tworec.serving.batch import ExportError, Progress, score_all
    from tworec.serving.errors import ServingError
    try:
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("ignore")              # only score_all's own notes
            warnings.filterwarnings("always", category=UserWarning,
                                    module=r"tworec\.serving\.batch")
            rows = score_all(args.export, args.out, n=args.n,
                             batch_size=args.batch_size or 1024, titles=titles,
                             version=args.version, progress=Progress())
    except ExportError as error:                         # the export cannot be scored
        return fail(f"--export {error}")
    except (OSError, ValueError, ServingError) as error:
        return fail((str(error) or type(error).__name__).splitlines()[0], code=1)
    for note in notes:
        print(f"note: {note.message}")
    print(f"wrote {rows:,} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
