"""Serves SavedModels over TF Serving's gRPC and REST APIs, with TF Serving's flags.

    python scripts/serve.py --model_config_file=RUN/export/models.config
    python scripts/serve.py --model_name=retrieval --model_base_path=RUN/export/retrieval
        [--port=8500] [--rest_api_port=8501] [--host=127.0.0.1]
        [--file_system_poll_wait_seconds=1] [--model_config_file_poll_wait_seconds=0]
        [--rest_api_timeout_in_ms=30000]
        [--max_request_bytes=67108864] [--max_rows_per_request=N]
        [--max_elements_per_request=N] [--max_request_bytes_in_flight=N]
        [--allowed_model_roots=DIR,...] [--shutdown_grace_seconds=10]
        [--enable_batching [--max_batch_size=32] [--batch_timeout_micros=1000]
         [--num_batch_threads=N] [--max_enqueued_batches=10]
         [--enable_large_batch_splitting]]

SIGTERM or Ctrl-C stops accepting requests and lets those in flight finish for the grace period.
A model with no version yet is served anyway (its requests answer NOT_FOUND) and its base path
polled until one appears; a warning at start names the path (TF Serving would not start
serving until one appeared). As TF Serving does, the server does not start when a model's
latest version cannot load or a label names a version not loaded.
"""
import argparse
import errno
import logging
import os
import re
import shlex
import sys

import tworec
from tworec.console import exit_without_finalizing
from tworec.serving.errors import ServingError
from tworec.serving.layout import list_versions
from tworec.serving.limits import default_max_elements, default_max_rows
from tworec.pipeline import cli

# What makes a run's config file: RUN/export/models.config and models_scann.config.
RUN_ADVICE = ("; a run writes it (make demo, or python scripts/pipeline.py --out RUN), and make "
              "serve RUN=FOLDER serves another run's")


def parse_args(argv):
    parser = cli.parser_for(__doc__)
    parser.add_argument("--port", type=int, default=8500, help="gRPC port (0: a free one)")
    parser.add_argument("--rest_api_port", type=int, default=8501,
                        help="REST port; 0 turns REST off, as in TF Serving")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--model_config_file", default="",
                        help="a text ModelServerConfig (model_config_list)")
    parser.add_argument("--model_name", help="with --model_base_path (default: default)")
    parser.add_argument("--model_base_path", default="", help="folder of integer versions")
    parser.add_argument("--file_system_poll_wait_seconds", type=float, default=1.0,
                        help="seconds between polls for new versions; 0 polls once")
    parser.add_argument("--model_config_file_poll_wait_seconds", type=float, default=0,
                        help="seconds between checks of --model_config_file; 0 never")
    parser.add_argument("--rest_api_timeout_in_ms", type=int, default=30000)
    parser.add_argument("--max_request_bytes", type=int, default=64 << 20,
                        help="larger REST bodies and gRPC messages are refused")
    parser.add_argument("--max_rows_per_request", type=int, default=default_max_rows(),
                        help="an input with more rows (dimension 0) is refused; the default "
                        "(and 0) is a quarter of physical memory at 1 MiB per row")
    parser.add_argument("--max_elements_per_request", type=int,
                        default=default_max_elements(),
                        help="a request whose inputs have more elements together is refused; "
                        "the default (and 0) is a quarter of physical memory at 256 bytes per "
                        "element")
    parser.add_argument("--max_request_bytes_in_flight", type=int, default=None,
                        help="request bytes held at once over both APIs; a request beyond is "
                        "refused (503 / UNAVAILABLE: retry later) unless nothing else, not "
                        "even an unread answer, is held; the default is 1/64 of physical "
                        "memory, at least --max_request_bytes")
    parser.add_argument("--allowed_model_roots", default="",
                        help="comma-separated folders under which HandleReloadConfigRequest may "
                        "load models, besides the base paths the server starts with")
    parser.add_argument("--max_concurrent_requests", type=int, default=256,
                        help="requests served at a time on each API (REST answers 503 beyond)")
    parser.add_argument("--http_header_timeout_seconds", type=float, default=10.0,
                        help="a REST request head must arrive within this long")
    parser.add_argument("--http_body_timeout_seconds", type=float, default=30.0,
                        help="a REST request body must arrive within this long (408)")
    parser.add_argument("--http_body_stall_seconds", type=float, default=5.0,
                        help="a REST request body none of which arrives for this long is "
                        "refused (408), releasing its share of --max_request_bytes_in_flight")
    parser.add_argument("--http_write_stall_seconds", type=float, default=5.0,
                        help="a REST connection whose client reads none of its answer for this "
                        "long is aborted, its unsent answer dropped")
    parser.add_argument("--http_write_timeout_seconds", type=float, default=60.0,
                        help="a REST connection whose client has not taken all but the last 64 "
                        "KiB of its answer out of the server within this long is aborted, its "
                        "unsent answer dropped (60 s is 480 MB at 64 Mbit/s); a gRPC Predict "
                        "whose answer is not sent within it is cancelled")
    parser.add_argument("--shutdown_grace_seconds", type=float, default=10.0,
                        help="on SIGTERM or Ctrl-C, how long requests in flight may finish")
    parser.add_argument("--max_num_load_retries", type=int, default=5,
                        help="attempts after a failed model load before giving it up")
    parser.add_argument("--load_retry_interval_micros", type=int, default=60_000_000,
                        help="wait between those attempts")
    parser.add_argument("--enable_batching", type=_bool, nargs="?", const=True, default=False,
                        help="merge concurrent predict requests into one session run")
    parser.add_argument("--max_batch_size", type=int, default=32,
                        help="with --enable_batching: rows that close a batch")
    parser.add_argument("--batch_timeout_micros", type=int, default=1000,
                        help="with --enable_batching: how long a batch waits to fill")
    parser.add_argument("--num_batch_threads", type=int, default=0,
                        help="with --enable_batching: batches run at a time (0: the cores)")
    parser.add_argument("--max_enqueued_batches", type=int, default=10,
                        help="with --enable_batching: full batches that may wait; beyond, "
                        "requests are refused (UNAVAILABLE)")
    parser.add_argument("--enable_large_batch_splitting", type=_bool, nargs="?", const=True,
                        default=False, help="with --enable_batching: split a request larger "
                        "than --max_batch_size instead of refusing it")
    args = parser.parse_args(argv)
    if args.model_config_file and (args.model_base_path or args.model_name):
        parser.error("--model_config_file names every model itself; leave out --model_name "
                     "and --model_base_path, or serve one model with those two alone")
    if not (args.model_config_file or args.model_base_path):
        parser.error("give --model_config_file, or --model_name with --model_base_path")
    if args.model_config_file and not os.path.isfile(args.model_config_file):
        parser.error(f"--model_config_file {args.model_config_file}: "
                     + ("a folder, not a file" if os.path.isdir(args.model_config_file)
                        else "no such file" + RUN_ADVICE * is_run_config(args.model_config_file)))
    for flag, zero in (("port", "a free one"), ("rest_api_port", "REST off")):
        if not 0 <= getattr(args, flag) <= 65535:
            parser.error(f"--{flag} must be a port from 0 to 65535 (0: {zero}), got "
                         f"{getattr(args, flag)}")
    if args.port and args.port == args.rest_api_port:     # TF Serving skips REST instead
        parser.error(f"--port and --rest_api_port are both {args.port}; give gRPC and REST "
                     "a port each")
    batching = args.enable_batching
    for flag, least, checked in (("max_concurrent_requests", 1, True),
                                 ("max_request_bytes", 1, True),
                                 ("max_rows_per_request", 0, True),
                                 ("max_elements_per_request", 0, True),
                                 ("max_request_bytes_in_flight", 1,
                                  args.max_request_bytes_in_flight is not None),
                                 ("max_num_load_retries", 0, True),
                                 ("load_retry_interval_micros", 0, True),
                                 ("max_batch_size", 1, batching),
                                 ("max_enqueued_batches", 1, batching),
                                 ("batch_timeout_micros", 0, batching),
                                 ("num_batch_threads", 0, batching)):
        if checked and getattr(args, flag) < least:
            parser.error(f"--{flag} must be at least {least}, got {getattr(args, flag)}")
    for flag in ("http_header_timeout_seconds", "http_body_timeout_seconds",
                 "http_body_stall_seconds", "http_write_stall_seconds",
                 "http_write_timeout_seconds"):
        if not getattr(args, flag) > 0:          # 0 would cut every connection off at once
            parser.error(f"--{flag} must be more than 0, got {getattr(args, flag):g}")
    return args


def _bool(text: str) -> bool:
    """TF Serving's boolean flag values: --flag, --flag=true, --flag=false."""
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")


def batcher(args):
    """The `Batcher` the batching flags ask for; None without --enable_batching."""
    if not args.enable_batching:
        return None
    from tworec.serving.batching import Batcher
    return Batcher(args.max_batch_size, args.batch_timeout_micros,
                   args.num_batch_threads or None, args.max_enqueued_batches,
                   args.enable_large_batch_splitting)


def is_run_config(path: str) -> bool:
    """Whether `path` is named as a run writes the configs it serves from its own folder
    (RUN/export/models.config, models_scann.config; not models.docker.config, whose paths
    are a container's)."""
    return (os.path.basename(os.path.dirname(os.path.abspath(path))) == "export"
            and os.path.basename(path) in ("models.config", "models_scann.config"))


def moved_run(path: str, configs: list) -> str | None:
    """What is wrong with a run's config file none of whose models is served from the folder
    beside it of its name, though that folder is there (the run folder was moved or copied,
    and its absolute base paths name the old place), or None (a config that serves some
    models of another folder on purpose included)."""
    here = os.path.dirname(os.path.abspath(path))
    beside = {config.name: os.path.join(here, os.path.basename(os.path.normpath(
        config.base_path))) for config in configs}
    if not configs or any(not os.path.isdir(beside[config.name]) or (
            os.path.exists(config.base_path) and os.path.samefile(beside[config.name],
                                                                  config.base_path))
            for config in configs):
        return None
    first = configs[0]
    old = os.path.dirname(os.path.normpath(first.base_path))
    return (f"model {first.name} is served from {first.base_path}, not from "
            f"{beside[first.name]} beside the file: the run folder was moved or copied; name "
            f"its own exports with {sed_line(old, here, path)}")


def sed_line(old: str, new: str, path: str) -> str:
    """The shell command that replaces the folder `old` by `new` in the config file `path`
    (whose strings text_format wrote C-escaped: `it's` as `it\\'s`)."""
    from google.protobuf import text_encoding
    old, new = (text_encoding.CEscape(folder, as_utf8=True) for folder in (old, new))
    pattern = re.sub(r"([\\.*\[\]^$#])", r"\\\1", old)
    replacement = re.sub(r"([\\&#])", r"\\\1", new)
    return f"sed -i {shlex.quote(f's#{pattern}/#{replacement}/#')} {shlex.quote(path)}"


def model_configs(args) -> list:
    """The `ModelConfig`s of --model_config_file, or of --model_name and --model_base_path."""
    from tworec.serving.manager import ModelConfig, parse_config
    if not args.model_base_path:
        with open(args.model_config_file) as f:
            return parse_config(f.read())
    return [ModelConfig(args.model_name or "default", args.model_base_path)]


def no_versions_warning(name: str, base_path: str, poll_seconds: float) -> str | None:
    """The warning for a model whose base path holds no version yet; None when it has one."""
    if list_versions(base_path):
        return None
    reason = ("the folder does not exist" if not os.path.isdir(base_path) else
              f"a version is a folder named by an integer, e.g. {os.path.join(base_path, '1')}")
    polling = (f"polling every {poll_seconds:g} s for one" if poll_seconds > 0 else
               "not polling (--file_system_poll_wait_seconds=0)")
    return (f"warning: no versions of model {name} found under {base_path} ({reason}); "
            f"the server starts without it, {polling}")


def main(argv=None) -> int:
    args = parse_args(argv)
    # Before TensorFlow loads: it gives its own logger a handler of its own when the root
    # logger has none yet, and every TensorFlow warning was then printed twice.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if not tworec.verbose_requested():       # gRPC's C core logs what serve.py reports itself
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    from tworec.serving.manager import ModelManager
    from tworec.serving.model import settle_native_logs
    from tworec.serving.server import ModelServer
    try:
        configs = model_configs(args)
    except (OSError, UnicodeDecodeError, ServingError) as error:    # OSError: gone since
        reason = ("not text; give a text ModelServerConfig"           # the check, unreadable
                  if isinstance(error, UnicodeDecodeError) else getattr(error, "strerror", None)
                  or error)
        print(f"error: --model_config_file {args.model_config_file}: {reason}", file=sys.stderr)
        return 2
    moved = args.model_config_file and is_run_config(args.model_config_file) and \
        moved_run(args.model_config_file, configs)
    if moved:
        print(f"error: --model_config_file {args.model_config_file}: {moved}", file=sys.stderr)
        return 2
    manager = ModelManager(configs, args.file_system_poll_wait_seconds,
                           max_load_retries=args.max_num_load_retries,
                           load_retry_seconds=args.load_retry_interval_micros / 1e6,
                           allowed_roots=[r for r in args.allowed_model_roots.split(",") if r])
    server = ModelServer(manager,
                         host=args.host, grpc_port=args.port,
                         rest_port=args.rest_api_port or None,
                         rest_timeout_seconds=(args.rest_api_timeout_in_ms / 1000   # <= 0:
                                               if args.rest_api_timeout_in_ms > 0 else None),
                         max_request_bytes=args.max_request_bytes,
                         batcher=batcher(args), max_rows=args.max_rows_per_request,
                         max_concurrent_requests=args.max_concurrent_requests,
                         header_timeout_seconds=args.http_header_timeout_seconds,
                         body_timeout_seconds=args.http_body_timeout_seconds,
                         body_stall_seconds=args.http_body_stall_seconds,
                         write_stall_seconds=args.http_write_stall_seconds,
                         write_timeout_seconds=args.http_write_timeout_seconds,
                         grace_seconds=args.shutdown_grace_seconds,
                         max_elements=args.max_elements_per_request,
                         max_request_bytes_in_flight=args.max_request_bytes_in_flight)
    try:
        settle_native_logs()
        server.start()                       # stops what it started when it fails
    except KeyboardInterrupt:                # Ctrl-C while the models load
        print("error: stopped (Ctrl-C) while the models loaded, before serving", file=sys.stderr)
        return 130
    except ServingError as error:            # a model or label TF Serving would refuse
        print(f"error: cannot start: {error}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as error:
        ports = f"--port={args.port}" + (f", --rest_api_port={args.rest_api_port}"
                                         if args.rest_api_port else "")
        reason = (str(error) or type(error).__name__).splitlines()[0].split(";")[0]
        in_use = getattr(error, "errno", None) == errno.EADDRINUSE or "Failed to bind" in reason
        print(f"error: cannot open {ports} on {args.host} ({reason})"
              + (": is another server using it? pass free ports (0 picks one)" if in_use else ""),
              file=sys.stderr)
        return 1
    if args.model_config_file and args.model_config_file_poll_wait_seconds > 0:
        server.manager.watch_config_file(args.model_config_file,
                                         args.model_config_file_poll_wait_seconds)
    for config in configs:
        print(f"model {config.name}: {config.base_path}")
        warning = no_versions_warning(config.name, config.base_path,
                                      args.file_system_poll_wait_seconds)
        if warning:
            print(warning, file=sys.stderr)
    server.handle_signals()                  # before the readiness line: a SIGTERM on it stops
    rest = f", REST on http://{args.host}:{server.rest_port}" if server.rest_port else ""
    print(f"serving gRPC on {args.host}:{server.grpc_port}{rest}; Ctrl-C or SIGTERM stops",
          flush=True)
    server.wait()
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main())     # finalizing would cancel the server's C++ threads
