"""The ``epochcache`` command: one entry point, a subcommand per job, all defined here.

Every subcommand's arguments are here (`build_parser`), and its handler is a small function
here that imports what it runs when it runs (the run, the plot, the demo data), so ``epochcache
--help`` and ``status`` load neither torch nor matplotlib.

Exit status: 0 success, 1 a failure at run time, 2 bad usage, bad config, a source that is
unreachable or a path that cannot be written at start, or a directory that holds no usable
cache (nothing was started): `USAGE_ERRORS`, translated in `main` only. argparse already exits 2
on bad usage.

Logging goes to stderr, at INFO by default; ``-v`` is DEBUG for epochcache (``-vv`` for the
libraries too), ``-q`` WARNING, before or after the subcommand. stdout carries only what a
command prints (``status --json`` pipes into ``jq``). Log lines and error messages have the
credentials inside URLs masked (`epochcache.redact`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import (
    CacheError,
    CacheUnusable,
    ConfigError,
    EpochcacheError,
    PathNotWritable,
    SourceUnavailable,
)
from .paths import check_writable, writing
from .redact import install_log_redaction, redact_url, scrub_urls

if TYPE_CHECKING:
    from .store import SampleStore

log = logging.getLogger("epochcache")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _version() -> str:
    from . import __version__

    return __version__


class UsageError(EpochcacheError):
    """A command's argument names nothing it can use (exit 2, one line, nothing done)."""


#: Errors that mean nothing was done, for a reason the user fixes in the command or config:
#: exit 2 with one line (the single place errors become exit statuses is `main`).
USAGE_ERRORS = (ConfigError, SourceUnavailable, PathNotWritable, CacheUnusable, UsageError)


def _existing_cache(path: str) -> str:
    """``path`` if it holds a cache, else `CacheUnusable` saying what to give instead (and
    naming a killed copy's leftover beside it)."""
    from .store.datafile import leftover_hint

    if not os.path.isdir(path):
        raise CacheUnusable(f"{path}: no such directory; point the command at the cache.dir "
                            f"of your config{leftover_hint(path)}")
    if not os.path.exists(os.path.join(path, "data.mdb")):
        raise CacheUnusable(f"{path}: no cache here (no data.mdb); point the command at the "
                            "cache.dir of a config, which `epochcache daemon CONFIG` or "
                            f"`epochcache run CONFIG` fills{leftover_hint(path)}")
    return path


def _open_cache_readonly(path: str) -> SampleStore:
    from .store import SampleStore

    return SampleStore(_existing_cache(path), readonly=True)


def _cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from .status import render, stats_with_coverage

    cache = _open_cache_readonly(args.cache_dir)
    try:
        if args.json:
            print(json.dumps(stats_with_coverage(cache), indent=2, sort_keys=True))
            return EXIT_OK
        console = Console()
        if not args.watch:
            console.print(render(stats_with_coverage(cache)))
            return EXIT_OK
        with Live(render(stats_with_coverage(cache)), console=console, refresh_per_second=2) as live:
            try:
                while True:
                    time.sleep(args.interval)
                    live.update(render(stats_with_coverage(cache)))
            except KeyboardInterrupt:
                return EXIT_OK
    finally:
        cache.close()


def _cmd_daemon(args: argparse.Namespace) -> int:
    from .config import load_config
    from .ingest.supervisor import run_daemon

    config = load_config(args.config)
    if args.metrics_port is not None:
        config.daemon.metrics_port = args.metrics_port
    return run_daemon(config)


def _cmd_verify(args: argparse.Namespace) -> int:
    from .store.verify import verify_cache

    report = verify_cache(_existing_cache(args.cache_dir), repair=args.repair)
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


def _cmd_copy(args: argparse.Namespace) -> int:
    from .store.copy_cache import check_destination, copy_cache
    from .units import format_count, format_size

    try:
        check_destination(os.path.realpath(args.dest))
    except CacheError as exc:  # nothing done: a usage error
        raise UsageError(str(exc)) from None
    cache = _open_cache_readonly(args.cache_dir)
    # SIGTERM (a scheduler, `timeout`) stops the copy as Ctrl-C does: its partial copy removed.
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        report = copy_cache(cache, args.dest)
    except KeyboardInterrupt as exc:
        print(f"epochcache copy: {exc or 'interrupted'}: stopped before the end; nothing was "
              f"written at {args.dest} (the partial copy was removed) and {args.cache_dir} "
              "was only read: run the copy again", file=sys.stderr)
        return 143 if str(exc) == "terminated" else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        cache.close()
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    print(f"copied {format_count(report['samples'], 'sample')} ({format_size(report['bytes'])}, "
          f"data file {format_size(report['file_bytes'])}) from {report['source']} to "
          f"{report['path']} in {report['seconds']:.1f}s; kept "
          f"{format_count(report['listings'], 'listing')} and "
          f"{format_count(report['ledgers'], 'coverage ledger')}, left "
          f"{format_count(report['leases_left_behind'], 'lease')} and "
          f"{format_count(report['states_left_behind'], 'daemon/job state document')} behind")
    return EXIT_OK


def _terminate(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt("terminated")


def _cmd_manifest(args: argparse.Namespace) -> int:
    from .coverage.manifests import epoch_keys, epoch_spans, manifests

    if not os.path.isdir(args.run_dir):
        raise UsageError(f"{args.run_dir}: no such directory; give the train.run_dir of a run")
    if args.output is not None and args.epoch is not None:
        from .ingest.manifest import detect_format

        if args.format == "auto" and detect_format(args.output) not in ("txt", "csv", "jsonl"):
            # source.manifest would read the file as what its name says (Parquet)
            raise UsageError(f"{args.output}: writes .txt, .csv or .jsonl (.gz compresses), "
                             "not Parquet: name a .csv or .jsonl file (and convert it)")
        check_writable(args.output, "the manifest (-o)", directory=False)
    if args.epoch is None:
        found = manifests(args.run_dir)
        if not found:
            print(f"{args.run_dir}: no manifests (runs write them with train.manifests: true)",
                  file=sys.stderr)
            return EXIT_FAILURE
        for epoch, ranks in sorted(found.items()):
            kept = epoch_spans(args.run_dir, epoch)
            counts = [sum(len(r.keys) for r in kept[rank]) for rank in ranks]
            print(f"epoch {epoch}: {sum(counts):,} samples, ranks "
                  f"{', '.join(f'{rank} ({count:,})' for rank, count in zip(ranks, counts))}")
        return EXIT_OK
    try:
        keys = epoch_keys(args.run_dir, args.epoch, args.rank, args.source)
    except FileNotFoundError as exc:
        raise CacheError(str(exc)) from None
    return _write_keys(keys, args.output, args.format)


def _write_keys(keys: list[str], output: str | None, fmt: str) -> int:
    """Print or write manifest keys in a format ``source.manifest`` reads back."""
    import csv
    import gzip
    import io

    if fmt == "auto":
        from .ingest.manifest import detect_format

        fmt = detect_format(output or "")  # as source.manifest reads it back
    comments = {key for key in keys if key.startswith("# sample ")}
    keys = [key for key in keys if not key.startswith("# sample ")] if fmt != "txt" else keys
    text = io.StringIO()
    if fmt == "csv":
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(["key"])
        writer.writerows([key] for key in keys)
    elif fmt == "jsonl":
        text.writelines(json.dumps({"key": key}) + "\n" for key in keys)
    else:
        odd = [key for key in keys if key not in comments and (
            "\n" in key or key != key.strip() or key.startswith("#"))]
        if odd:
            log.warning("%d keys would not read back from a text manifest (a newline, a leading "
                        "'#' or spaces at an end), e.g. %r: use --format jsonl (spaces at an end "
                        "are stripped by every manifest format)", len(odd), odd[0])
        text.writelines(key + "\n" for key in keys)
    if comments:
        log.warning("%d samples of the epoch have no recorded key (evicted, cached by an older "
                    "version)%s", len(comments),
                    ": kept as '#' comment lines" if fmt == "txt" else ": left out")
    data = text.getvalue()
    if output is None:
        sys.stdout.write(data)
        return EXIT_OK
    raw = data.encode("utf-8", "surrogateescape")
    with writing(output, "the manifest (-o)"):
        os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
        with open(output, "wb") as f:
            f.write(gzip.compress(raw) if output.endswith(".gz") else raw)
    log.info("wrote %d keys to %s", len(keys) - (len(comments) if fmt == "txt" else 0), output)
    return EXIT_OK


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return port


def _cmd_run(args: argparse.Namespace) -> int:
    from .config import load_config
    from .run import run_training

    config = load_config(args.config)
    if args.epochs is not None:
        config.train.epochs = args.epochs
    return run_training(config, resume=args.resume or config.train.resume)


def _cmd_config(args: argparse.Namespace) -> int:
    from .config import load_config

    print(load_config(args.config).redacted_yaml(), end="")
    return 0


def _storage_option(text: str) -> tuple[list[str], Any]:
    """``KEY=VALUE`` of ``--storage-option``: the key's path and the value read as YAML."""
    import yaml

    name, sep, value = text.partition("=")
    path = name.strip().split(".")
    if not sep or not all(path):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. anon=true), got {text!r}")
    try:
        parsed = yaml.safe_load(value) if value else ""
    except yaml.YAMLError:
        parsed = value
    return path, value if isinstance(parsed, (dict, list)) or parsed is None else parsed


def _options_of(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for path, value in args.storage_options:
        node = options
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    if args.endpoint_url:
        options["endpoint_url"] = args.endpoint_url
    return options


def _cmd_demo_data(args: argparse.Namespace) -> int:
    from .demo import write_demo_data

    summary = write_demo_data(
        args.url,
        args.samples,
        args.layout,
        _options_of(args) or None,
        sample_bytes=args.sample_bytes,
        samples_per_shard=args.samples_per_shard,
        seed=args.seed,
        kind=args.kind,
    )
    for name, info in summary["layouts"].items():
        print(
            f"{name}: {info['keys']} keys, {info['objects']} objects, {info['bytes']} bytes at "
            f"{redact_url(info['url'])}"
        )
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from .plot import INSTALL_HINT, available, plot_cache

    if not available():
        print(f"epochcache plot: needs matplotlib ({INSTALL_HINT})", file=sys.stderr)
        return 2
    from .coverage import history as coverage_history

    cache = _open_cache_readonly(args.cache_dir)
    try:
        check_writable(args.output, "the plot (-o)", directory=False)
        history = cache.history()
    finally:
        cache.close()
    with writing(args.output, "the plot (-o)"):
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        plot_cache(history, args.output, title=f"epochcache {cache.path}",
                   coverage=coverage_history(cache.path))
    print(f"wrote {args.output} ({len(history)} stats rows)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epochcache",
        description="A growing local sample cache for remote training datasets.",
    )
    parser.add_argument("--version", action="version", version=f"epochcache {_version()}")
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

    copy = sub.add_parser(
        "copy", help="a consistent compacted copy of a cache, to start another node warm")
    copy.add_argument("cache_dir", help="the cache to copy (its daemon and trainers may run)")
    copy.add_argument("dest", help="a new or empty directory for the copy")
    copy.add_argument("--json", action="store_true", help="print one JSON object")
    copy.set_defaults(func=_cmd_copy)

    manifest = sub.add_parser(
        "manifest", help="the sample keys an epoch of a run trained on, in order")
    manifest.add_argument("run_dir", help="the run's directory (train.run_dir)")
    manifest.add_argument("--epoch", type=int, default=None,
                          help="the epoch (without it: list the epochs and ranks recorded)")
    manifest.add_argument("--rank", type=int, default=None,
                          help="one rank's keys (default: every rank's, in rank order)")
    manifest.add_argument("--source", default=None, metavar="NAME",
                          help="only this sources: entry's keys, without their NAME/ prefix "
                               "(a manifest for that source's source.manifest)")
    manifest.add_argument("-o", "--output", default=None,
                          help="write to this file (.txt, .csv, .jsonl; .gz compresses) instead "
                               "of stdout")
    manifest.add_argument("--format", choices=("auto", "txt", "csv", "jsonl"), default="auto",
                          help="output format (auto: by --output's extension, else txt)")
    manifest.set_defaults(func=_cmd_manifest)

    demo_data = sub.add_parser("demo-data",
                               help="write a small synthetic dataset to any fsspec URL")
    demo_data.add_argument("url", help="destination, e.g. file:///tmp/demo or s3://bucket/demo")
    demo_data.add_argument("--samples", type=int, default=1000,
                           help="number of samples (default 1000)")
    demo_data.add_argument("--layout", choices=["files", "tar", "both"], default="both")
    demo_data.add_argument("--sample-bytes", type=int, default=None,
                           help="approximate bytes per sample")
    demo_data.add_argument("--samples-per-shard", type=int, default=100)
    demo_data.add_argument("--kind", choices=["npy", "jpg"], default="npy",
                           help="npy arrays (default) or jpg images of shapes")
    demo_data.add_argument("--seed", type=int, default=0)
    demo_data.add_argument(
        "--endpoint-url", default=None, metavar="URL",
        help="an S3-compatible store's endpoint (MinIO, Ceph, R2, ...): the storage option "
             "endpoint_url; credentials come from the environment, ~/.aws or an instance role")
    demo_data.add_argument(
        "--storage-option", action="append", default=[], type=_storage_option,
        metavar="KEY=VALUE", dest="storage_options",
        help="a storage option for the URL's filesystem, as source.storage_options takes it "
             "(repeatable; VALUE is read as YAML: anon=true; a dotted KEY nests: "
             "client_kwargs.region_name=eu-west-1); never put a secret on a command line")
    demo_data.set_defaults(func=_cmd_demo_data)

    run = sub.add_parser("run", help="a YAML-configured training run")
    run.add_argument("config", help="YAML config (see configs/demo.yaml)")
    run.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    run.add_argument("--epochs", type=int, default=None, help="override train.epochs")
    run.set_defaults(func=_cmd_run)

    config = sub.add_parser("config", help="print the resolved config, secrets redacted")
    config.add_argument("config", help="YAML config to print, resolved, with secrets masked")
    config.set_defaults(func=_cmd_config)

    plot = sub.add_parser("plot", help="plot cache fill, ingest rate and evictions over time")
    plot.add_argument("cache_dir", help="the cache directory (cache.dir of a config)")
    plot.add_argument("-o", "--output", default="fill.png", help="PNG file to write")
    plot.set_defaults(func=_cmd_plot)

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
    except EpochcacheError as exc:
        print(f"epochcache {args.command}: {scrub_urls(str(exc))}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, USAGE_ERRORS) else EXIT_FAILURE
    except KeyboardInterrupt as exc:  # 143 for a run's SIGTERM that came during its clean-up
        return int(getattr(exc, "exit_status", 130))


if __name__ == "__main__":
    raise SystemExit(main())
