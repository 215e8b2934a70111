"""The ``epochcache`` command: one entry point, a subcommand per job.

Exit status: 0 success, 1 a failure at run time, 2 bad usage, bad config, or a source that is
unreachable at start (nothing was started). argparse already exits 2 on bad usage.

Logging goes to stderr, at INFO by default; ``-v`` is DEBUG for epochcache (``-vv`` for the
libraries too), ``-q`` WARNING, before or after the subcommand. stdout carries only what a
command prints (``status --json`` pipes into ``jq``). Log lines and error messages have the
credentials inside URLs masked (:mod:`epochcache.redact`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .errors import CacheError, ConfigError, EpochcacheError, SourceUnavailable
from .redact import install_log_redaction, scrub_urls

log = logging.getLogger("epochcache")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

#: Subcommand modules register themselves here: (module, function adding the parser).
_EXTENSIONS: list[tuple[str, str]] = [
    ("epochcache.demo", "add_demo_data_parser"),
    ("epochcache.run", "add_run_parser"),
    ("epochcache.run", "add_config_parser"),
    ("epochcache.plot", "add_plot_parser"),
]


def _version() -> str:
    from . import __version__

    return __version__


def _open_cache_readonly(path: str) -> Any:
    from .store import SampleStore

    if not os.path.isdir(path):
        raise CacheError(f"{path}: no such directory (is this the cache.dir of your config?)")
    return SampleStore(path, readonly=True)


def _cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from .store.status import collect_stats, render

    cache = _open_cache_readonly(args.cache_dir)
    try:
        if args.json:
            print(json.dumps(collect_stats(cache), indent=2, sort_keys=True))
            return EXIT_OK
        console = Console()
        if not args.watch:
            console.print(render(collect_stats(cache)))
            return EXIT_OK
        with Live(render(collect_stats(cache)), console=console, refresh_per_second=2) as live:
            try:
                while True:
                    time.sleep(args.interval)
                    live.update(render(collect_stats(cache)))
            except KeyboardInterrupt:
                return EXIT_OK
    finally:
        cache.close()


def _cmd_daemon(args: argparse.Namespace) -> int:
    from .config import load_config
    from .ingest.daemon import run_daemon

    config = load_config(args.config)
    if args.metrics_port is not None:
        config.daemon.metrics_port = args.metrics_port
    return run_daemon(config)


def _cmd_verify(args: argparse.Namespace) -> int:
    from .store.verify import verify_cache

    if not os.path.isdir(args.cache_dir):
        raise CacheError(f"{args.cache_dir}: no such directory")
    report = verify_cache(args.cache_dir, repair=args.repair)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return EXIT_OK if report.ok else EXIT_FAILURE
    print(f"{report.path}: checked {report.checked:,} samples ({report.checked_bytes:,} bytes) in "
          f"{report.transactions:,} read transactions")
    for item in report.corrupt[:50]:
        print(f"  corrupt sample {item['seq']} ({item['key']!r}): {item['error']}")
    for name, (stored, actual) in report.counter_mismatches.items():
        print(f"  counter {name}: stored {stored}, records say {actual}")
    for problem in report.index_problems[:50]:
        print(f"  index: {problem}")
    done = [f"{count} {what.replace('_', ' ')}" for what, count in report.repairs.items() if count]
    if done:
        print(f"  repaired: {', '.join(done)}")
    if report.ok:
        print("consistent after the repair" if report.found_problems else "clean")
    elif args.repair:
        print("PROBLEMS REMAIN after the repair")
    else:
        print("PROBLEMS FOUND (run with --repair to fix)")
    return EXIT_OK if report.ok else EXIT_FAILURE


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epochcache",
        description="A growing local sample cache for remote training datasets.",
    )
    _add_verbosity(parser, 0)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    status = sub.add_parser("status", help="fill, rates, evictions, quarantine, leases, daemon health")
    status.add_argument("cache_dir", help="the cache directory (cache.dir of a config)")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    status.set_defaults(func=_cmd_status)

    daemon = sub.add_parser(
        "daemon", help="run the sampler processes that fill the cache, until SIGTERM/SIGINT"
    )
    daemon.add_argument("config", help="YAML config with source, cache and sampler sections")
    daemon.add_argument("--metrics-port", type=_port, default=None, metavar="N",
                        help="serve Prometheus /metrics on port N (daemon.metrics_host, "
                             "default 127.0.0.1)")
    daemon.set_defaults(func=_cmd_daemon)

    verify = sub.add_parser("verify", help="check every stored sample and the counters")
    verify.add_argument("cache_dir", help="the cache directory (cache.dir of a config)")
    verify.add_argument("--repair", action="store_true",
                        help="remove corrupt samples, fix the key index and the counters")
    verify.add_argument("--json", action="store_true", help="print one JSON object")
    verify.set_defaults(func=_cmd_verify)

    import importlib

    for module_name, function in _EXTENSIONS:
        add: Callable[[Any], Any] = getattr(importlib.import_module(module_name), function)
        add(sub)
    for command in sub.choices.values():  # `epochcache status DIR -v` works too
        _add_verbosity(command, argparse.SUPPRESS)
    return parser


def _add_verbosity(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=default,
                        help="debug logging (-vv: the libraries' too)")
    parser.add_argument("-q", "--quiet", action="store_true",
                        default=False if default == 0 else argparse.SUPPRESS,
                        help="warnings and errors only")


def _setup_logging(verbose: int, quiet: bool) -> None:
    """INFO by default; ``-v`` DEBUG for epochcache, ``-vv`` for every library; ``-q`` WARNING."""
    from rich.console import Console
    from rich.logging import RichHandler

    ours = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.DEBUG if verbose >= 2 else logging.INFO,
        format="%(message)s",
        datefmt="[%X]",
        # stderr: stdout carries what commands print (`status --json` pipes into jq).
        handlers=[RichHandler(show_path=False, rich_tracebacks=False,
                              console=Console(stderr=True))],
    )
    logging.getLogger("epochcache").setLevel(ours)
    install_log_redaction()  # libraries log URLs, credentials and all
    if verbose < 2:
        for noisy in ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "asyncio"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose, args.quiet)
    log.debug("epochcache %s on Python %s: %s", _version(), sys.version.split()[0],
              " ".join(sys.argv[1:] if argv is None else argv))
    try:
        return int(args.func(args))
    except (ConfigError, SourceUnavailable) as exc:
        print(f"epochcache {args.command}: {scrub_urls(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except EpochcacheError as exc:
        print(f"epochcache {args.command}: {scrub_urls(str(exc))}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt as exc:  # 143 for a run's SIGTERM that came during its clean-up
        return int(getattr(exc, "exit_status", 130))


if __name__ == "__main__":
    raise SystemExit(main())
