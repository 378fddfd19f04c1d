"""Command line: ``prefill-worker serve | check-config | print-config | config-docs | version``.
(The reference decode peer, a test and demo tool, runs as
``python -m prefill_worker.testing.decode_peer``.)

The CLI parses arguments, resolves the configuration and hands it to the daemon; it owns no
state. A bad configuration prints one line per problem to stderr and exits 78 (EX_CONFIG).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from prefill_worker import __version__
from prefill_worker.service.config import EX_CONFIG, Config, ConfigError, dump_yaml, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefill-worker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("serve", "run the worker until SIGTERM"),
        ("check-config", "validate a configuration and exit (0 valid, 78 invalid)"),
        ("print-config", "print the resolved configuration as YAML"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("config_path", nargs="?", help="YAML configuration file")
        cmd.add_argument("--config", dest="config_flag", help="YAML configuration file")
        cmd.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override one setting (repeatable; wins over file and env)",
        )
        cmd.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
        cmd.add_argument("--log-format", choices=["text", "json"])
        cmd.add_argument("--ready-file", metavar="PATH", help="set daemon.ready_file")
    sub.add_parser("config-docs", help="print docs/config.md, generated from the models")
    sub.add_parser("version", help="print the version")
    return parser


def _resolve(args: argparse.Namespace) -> Config:
    if args.config_path and args.config_flag and args.config_path != args.config_flag:
        raise ConfigError(["give the configuration file once, as an argument or with --config"])
    overrides = list(args.overrides)
    if args.log_level:
        overrides.append(f"daemon.log_level={args.log_level}")
    if args.log_format:
        overrides.append(f"daemon.log_format={args.log_format}")
    if args.ready_file:
        overrides.append(f"daemon.ready_file={args.ready_file}")
    return load_config(args.config_path or args.config_flag, overrides=overrides)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "version":
        print(__version__)
        return 0
    if args.command == "config-docs":
        from prefill_worker.service.configdoc import render_config_doc

        sys.stdout.write(render_config_doc())
        return 0
    try:
        config = _resolve(args)
    except ConfigError as exc:
        for line in exc.problems:
            print(f"config error: {line}", file=sys.stderr)
        return EX_CONFIG
    if args.command == "check-config":
        print("config ok")
        return 0
    if args.command == "print-config":
        sys.stdout.write(dump_yaml(config))
        return 0
    return _serve(config)


def _serve(config: Config) -> int:
    from prefill_worker.service.daemon import run_daemon

    return run_daemon(config)


if __name__ == "__main__":
    sys.exit(main())
