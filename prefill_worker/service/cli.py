"""Command line: ``prefill-worker serve | check-config | print-config | drain | config-docs |
version``.
(The reference decode peer, a test and demo tool, runs as
``python -m prefill_worker.testing.decode_peer``.)

The CLI parses arguments, resolves the configuration and hands it to the daemon; it owns no
state. A bad configuration prints one line per problem to stderr and exits 78 (EX_CONFIG).
``check-config`` also reads the checkpoint's config.json when ``model.path`` is here
(``service/checkmodel.py``); ``drain`` asks a running worker to drain (``POST /drain``), as a
Kubernetes preStop hook does.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from prefill_worker import __version__
from prefill_worker.service.config import EX_CONFIG, Config, ConfigError, dump_yaml, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefill-worker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("serve", "run the worker until SIGTERM"),
        ("check-config", "validate a configuration and exit (0 valid, 78 invalid)"),
        ("print-config", "print the resolved configuration as YAML"),
        ("drain", "ask the worker this configuration describes to drain (POST /drain)"),
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
        if name == "check-config":
            cmd.add_argument(
                "--require-model",
                action="store_true",
                help="fail when model.path is absent (by default only a note: configurations "
                "are often checked where the checkpoint is not)",
            )
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


def main(
    argv: Sequence[str] | None = None,
    *,
    build_model: Callable[..., Any] | None = None,
    rank_command: Sequence[str] | None = None,
) -> int:
    """``build_model`` and ``rank_command``: the daemon's seams (``service.daemon.Daemon``),
    for test tools (``prefill_worker.testing.tp_ranks``); unset, the real ones."""
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
        return _check(config, args.require_model)
    if args.command == "drain":
        return _drain(config)
    if args.command == "print-config":
        sys.stdout.write(dump_yaml(config))
        return 0
    return _serve(config, build_model, rank_command)


def _check(config: Config, require_model: bool) -> int:
    from prefill_worker.service.checkmodel import check_model, layout_note

    check = check_model(config, require_model)
    check.notes.insert(0, layout_note(config))
    for line in check.problems:
        print(f"config error: {line}", file=sys.stderr)
    if check.problems:
        for line in check.notes:  # the arithmetic still helps to size what is wrong
            print(f"  {line}", file=sys.stderr)
        return EX_CONFIG
    print("config ok")
    for line in check.notes:
        print(f"  {line}")
    return 0


def _drain(config: Config) -> int:
    """POST /drain to the worker on ``metrics.bind`` with the admin token; 0 once it drains.
    The worker exits by itself when idle or at ``daemon.drain_timeout_s``."""
    import urllib.error
    import urllib.request
    from pathlib import Path

    host, _, port = config.metrics.bind.rpartition(":")
    host = "127.0.0.1" if host in ("", "0.0.0.0") else host
    request = urllib.request.Request(f"http://{host}:{port}/drain", method="POST")
    if config.metrics.admin_token_file:
        token = Path(config.metrics.admin_token_file).read_text().strip()
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            print(response.read().decode().strip())
            return 0
    except urllib.error.HTTPError as exc:
        print(f"drain refused: {exc.code} {exc.read().decode().strip()}", file=sys.stderr)
    except OSError as exc:
        print(f"drain failed: {host}:{port}: {exc}", file=sys.stderr)
    return 1


def _serve(
    config: Config, build_model: Callable[..., Any] | None, rank_command: Sequence[str] | None
) -> int:
    from prefill_worker.service.daemon import Daemon, run_daemon
    from prefill_worker.service.dp_leader import DpLeader
    from prefill_worker.service.teardown import prepare_exit

    kind = DpLeader if config.parallel.dp_size > 1 else Daemon
    code = run_daemon(config, build_model=build_model, rank_command=rank_command, kind=kind)
    prepare_exit()  # serve is a process's main: what is left is the interpreter's teardown
    return code


if __name__ == "__main__":
    sys.exit(main())
