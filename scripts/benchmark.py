"""Side-by-side performance figures; each part compares ours with a reference in one process.

    python scripts/benchmark.py [--only input,...] [--json] [--smoke]

With --json the last line is one JSON object keyed by part; a part that compares two things
carries `ratio` (ours over the reference). The parts live in `tworec.pipeline.benchmark`.
"""
import json
import sys

import tworec
from tworec import console
from tworec.pipeline import benchmark, cli


def main(argv=None) -> int:
    parser = cli.parser_for(__doc__)
    parser.add_argument("--only", default=",".join(benchmark.PARTS),
                        help=f"parts: {','.join(benchmark.PARTS)}")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--smoke", action="store_true",
                        help="every part on small data, in seconds: checks that it runs; its "
                             "figures mean nothing")
    args = parser.parse_args(argv)
    if not tworec.verbose_requested():
        console.filter_native_logs()
    try:
        results = benchmark.run([name for name in args.only.split(",") if name], args.smoke)
    except ValueError as error:
        parser.error(str(error))
    if args.json:
        print(json.dumps(results))
    else:
        for name, figures in results.items():
            print(name, json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
