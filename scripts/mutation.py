"""`make mutation`: mutation testing of the core modules, one module at a time with its own tests.

For each module, mutmut (pinned in requirements.lock) makes one-line changes to it (a
comparison flipped, a constant changed, an argument dropped) and runs the module's unit tests
against each: a mutant that no test fails "survived", a behaviour nothing pins. Each module
runs in a work folder of its own, ``.mutation/<module>/`` (git-ignored): a pyproject.toml that
tells mutmut which file to mutate and which tests to run, and links to the package and the
tests. mutmut keeps its verdicts there, so a second run tests only the functions that changed
(plus every survivor again, since a new test may kill it); ``--fresh`` starts over.

A survivor that no test can kill (the change does not alter behaviour) is listed with its
reason in tests/mutation-equivalents.txt. Per module the script prints one JSON line::

    {"module": "prefill_worker/kv/page_cache.py", "generated": 254, "killed": 250,
     "survived": 4, "equivalent": 4, "score": 1.0, "survivors": []}

    score = killed / (generated - equivalent)      ("survivors": unexplained ones)

and exits 1 when a module's score is below ``--goal`` (0.9 by default).

    python scripts/mutation.py [--changed-since REF] [--fresh] [--goal 0.9] [MODULE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutation"
EQUIVALENTS = ROOT / "tests" / "mutation-equivalents.txt"

_SCHEDULER = ["tests/unit/scheduler"]
_S = "tests/unit/scheduler/"
_POOL = [_S + "test_kv_bookkeeping.py", _S + "test_page_pool_model.py", _S + "test_aux_rows.py"]
_CACHE = [
    _S + "test_prefix_cache.py",
    _S + "test_prefix_cache_machine.py",
    _S + "test_prefix_cache_model.py",
    _S + "test_prefix_cache_edges.py",
    _S + "test_engine_prefix_cache.py",
    _S + "test_speculative_share.py",
]
_SLIDING = [_S + "test_sliding_pages.py", _S + "test_page_table_sliding.py"]
_EVENTS = ["tests/unit/kv_events", _S + "test_prefix_cache.py", _S + "test_prefix_cache_edges.py"]
_NESTED = "tests/unit/test_nested_decoders.py"
_INGRESS = [
    "tests/unit/ingress/test_messages.py",
    "tests/unit/ingress/test_v1_frames.py",
    "tests/unit/ingress/test_validate_bounds.py",
    "tests/unit/ingress/test_codec_edges.py",
    "tests/unit/ingress/test_protocol_doc.py",
]
_BOOTSTRAP = [
    "tests/unit/transfer/test_validate.py",
    "tests/unit/transfer/test_validate_bounds.py",
    "tests/unit/transfer/test_wire.py",
    "tests/unit/transfer/test_wire_v1_frames.py",
    "tests/unit/transfer/test_page_major.py",
]
_T = "tests/unit/transfer/"
_SENDER = _T + "test_push_sender.py"  # the push engine, once per dialect (native, SGLang)
_STATE = _T + "test_push_state.py"  # a hybrid model's state on the native push
_SWA = _T + "test_sglang_swa.py"  # a decode's hybrid SWA pool (SGLang's swa component)
_FRAMES = [
    _T + "test_sglang_frames.py",
    _T + "test_sglang_frames_pins.py",
    _T + "test_sglang_state_frames.py",
]
_GROUP = [
    _T + "test_group_backend.py",
    _T + "test_group_settle.py",
    _T + "test_group_pins.py",
    _T + "test_group_drop.py",
]
# The core: module -> the fast unit tests that own it (mutmut runs, per mutant, only those of
# them that reach the mutated function).
MODULES: dict[str, list[str]] = {
    "prefill_worker/kv/page_cache.py": _CACHE,
    "prefill_worker/kv/prefix_cache.py": [*_CACHE, _S + "test_engine.py"],
    "prefill_worker/kv/pages.py": _POOL,
    "prefill_worker/kv/tables.py": [*_POOL, *_CACHE, _S + "test_page_table_edges.py", *_SLIDING],
    "prefill_worker/kv/sliding.py": _SLIDING,
    "prefill_worker/kv/pins.py": [_S + "test_page_table_edges.py"],
    "prefill_worker/kv/block_hash.py": _EVENTS,
    "prefill_worker/kv/aux.py": [*_POOL, "tests/unit/transfer/test_pagemap.py"],
    "prefill_worker/kv/cache_events.py": _EVENTS,
    "prefill_worker/kv/state_layout.py": [_S + "test_state_slots.py", _STATE],
    "prefill_worker/kv/layout.py": [
        "tests/unit/transfer/test_pagemap.py",
        "tests/unit/transfer/test_layout_edges.py",
        *_BOOTSTRAP,
    ],
    "prefill_worker/scheduler/admission.py": _SCHEDULER,
    "prefill_worker/scheduler/chunking.py": _SCHEDULER,
    "prefill_worker/scheduler/costs.py": [_S + "test_costs.py"],
    "prefill_worker/scheduler/deadlines.py": _SCHEDULER,
    "prefill_worker/scheduler/queues.py": _SCHEDULER,
    "prefill_worker/scheduler/tracked.py": _SCHEDULER,
    "prefill_worker/scheduler/forward.py": _SCHEDULER,
    "prefill_worker/scheduler/engine.py": _SCHEDULER,
    "prefill_worker/scheduler/lifecycle.py": _SCHEDULER,
    "prefill_worker/scheduler/handoff.py": _SCHEDULER,
    "prefill_worker/scheduler/liveness.py": _SCHEDULER,
    "prefill_worker/scheduler/observer.py": _SCHEDULER,
    "prefill_worker/inbox.py": [*_SCHEDULER, "tests/unit/test_inbox_wake.py"],
    "prefill_worker/load.py": [*_SCHEDULER, "tests/unit/daemon/test_telemetry.py"],
    "prefill_worker/scheduler/warmup.py": _SCHEDULER,
    "prefill_worker/ingress/validate.py": _INGRESS,
    "prefill_worker/ingress/messages.py": _INGRESS,
    "prefill_worker/transfer/validate.py": _BOOTSTRAP,
    "prefill_worker/transfer/wire.py": [
        *_BOOTSTRAP,
        "tests/unit/transfer/test_schema_doc.py",
        _NESTED,
        _STATE,
        _T + "test_native_draft.py",
    ],
    # The peer-input bounds every decoder above relies on (issue #24).
    "prefill_worker/ingress/header.py": [
        *_INGRESS,
        _NESTED,
        "tests/unit/ingress/test_header_pins.py",
    ],
    "prefill_worker/msgpack_shape.py": [
        "tests/unit/test_msgpack_shape.py",
        "tests/unit/test_msgpack_table.py",
        _NESTED,
    ],
    "prefill_worker/zmq_parts.py": ["tests/unit/test_zmq_parts.py"],
    # The push engine and its dialects' frame parsing (issues #26, #31).
    "prefill_worker/transfer/push/refusals.py": [
        _T + "test_refusals.py",
        _T + "test_push_pins.py",
        _SENDER,
    ],
    "prefill_worker/transfer/push/rooms.py": [_T + "test_rooms.py", _T + "test_push_pins.py"],
    "prefill_worker/transfer/push/sender.py": [
        _SENDER,
        _T + "test_push_sender_pins.py",
        _T + "test_push_ranks.py",
        _STATE,
        _SWA,
        _T + "test_push_draft.py",
        _T + "test_push_paged_state.py",
    ],
    "prefill_worker/transfer/push/hub.py": [
        _SENDER,
        _T + "test_push_sender_pins.py",
        _T + "test_sglang_desk.py",
        _T + "test_push_hub_pins.py",
        _T + "test_push_hub_dp.py",
        _T + "test_hub_backend.py",
        _T + "test_push_ranks.py",
        _STATE,
    ],
    "prefill_worker/transfer/sglang/frames.py": [*_FRAMES, _T + "test_sglang_mailbox.py"],
    "prefill_worker/transfer/sglang/accept.py": [
        _T + "test_sglang_accept.py",
        _T + "test_sglang_accept_pins.py",
        _T + "test_sglang_group_desk.py",
        _T + "test_mla.py",
        _T + "test_sglang_draft.py",
        *_FRAMES,
    ],
    "prefill_worker/transfer/sglang/desk.py": [
        _T + "test_sglang_desk.py",
        _T + "test_sglang_desk_pins.py",
        _T + "test_sglang_group_desk.py",
        _SWA,
        _T + "test_sglang_draft.py",
        _T + "test_sglang_dsa.py",
        _T + "test_sglang_mamba.py",
    ],
    "prefill_worker/transfer/sglang/components.py": [
        _T + "test_sglang_desk.py",
        _SWA,
        _T + "test_sglang_dsa.py",
        _T + "test_sglang_mamba.py",
    ],
    "prefill_worker/transfer/native/desk.py": [
        _T + "test_native_desk.py",
        _T + "test_native_desk_tp.py",
        _T + "test_native_desk_state.py",
        _T + "test_native_draft.py",
        _T + "test_window_route.py",
    ],
    # A windowed sliding pool's window, read from its own pages (issue #43).
    "prefill_worker/transfer/push/window_route.py": [_T + "test_window_route.py", _SWA],
    # The tensor-parallel group's transfer mirror and its agreement (issue #27).
    "prefill_worker/transfer/group.py": _GROUP,
    "prefill_worker/tp/mirror.py": _GROUP,
}

# What the work folder links to; mutmut copies them beside its mutated package (tests read
# docs/ and configs/).
_LINKED = ("prefill_worker", "tests", "docs", "configs")

_NO_MUTANT_REACHED = "could not find any test case for any mutant"  # mutmut, on no mutants
_MIN_MODULE_S = 60  # a module is not started with less time left than this
_EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"  # git's empty tree: every file changed

# mutmut's verdicts, by its exit-code names: these count as killed (a test noticed).
_KILLED = ("killed", "timeout", "segfault", "caught by type check")


def main() -> int:
    args = _parse()
    modules = args.modules or list(MODULES)
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        sys.exit(f"not a core module: {', '.join(unknown)} (see MODULES in {__file__})")
    if args.changed_since:
        base = _base(args.changed_since)
        modules = [m for m in modules if m in _changed(base)]
        print(f"mutation: core modules changed since {base[:12]}: {len(modules)}", flush=True)
    equivalents = load_equivalents(EQUIVALENTS)
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    failed = []
    for module in modules:
        left_s = None if deadline is None else deadline - time.monotonic()
        if left_s is not None and left_s < _MIN_MODULE_S:
            print(json.dumps({"module": module, "skipped": "time budget spent"}), flush=True)
            continue
        report = run_module(module, equivalents, args.fresh, args.jobs, left_s)
        print(json.dumps(report, ensure_ascii=False), flush=True)
        if report.get("score", 1.0) < args.goal:
            failed.append(module)
    for module in failed:
        print(f"mutation: {module} scores below {args.goal:.0%}", file=sys.stderr)
    return 1 if failed else 0


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", help="core modules (default: all of MODULES)")
    parser.add_argument(
        "--changed-since",
        metavar="REF",
        help="only modules changed since REF; 'auto': the merge base with origin/main when "
        "HEAD is ahead of it, else HEAD~1 (the last commit: a merge commit's whole branch)",
    )
    parser.add_argument("--fresh", action="store_true", help="forget earlier verdicts")
    parser.add_argument("--goal", type=float, default=0.9, help="lowest passing score")
    parser.add_argument("--jobs", type=int, default=2, help="mutants tested at once")
    parser.add_argument(
        "--budget-s",
        type=float,
        help="stop after this many seconds: an unfinished module reports what it has and "
        "is not judged; modules not started are listed as skipped",
    )
    return parser.parse_args()


def _base(ref: str) -> str:
    if ref != "auto":
        return _git("rev-parse", ref)
    head = _git("rev-parse", "HEAD")
    merge_base = _git("merge-base", "HEAD", "origin/main", check=False)
    if merge_base and merge_base != head:
        return merge_base
    return _git("rev-parse", "HEAD~1", check=False) or _EMPTY_TREE


def _changed(base: str) -> set[str]:
    """Files under prefill_worker/ that differ between ``base`` and the working tree."""
    return set(_git("diff", "--name-only", base, "--", "prefill_worker").split())


def _git(*args: str, check: bool = True) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0 and check:
        sys.exit(f"mutation: git {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout.strip() if out.returncode == 0 else ""


def load_equivalents(path: Path) -> dict[str, str]:
    """``mutant name  # reason`` per line; blank lines and ``#`` lines are comments."""
    equivalents = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        name, _, reason = line.partition("#")
        if name.strip():
            assert reason.strip(), f"{path}: no reason given for {name.strip()}"
            equivalents[name.strip()] = reason.strip()
    return equivalents


def run_module(
    module: str, equivalents: dict[str, str], fresh: bool, jobs: int, left_s: float | None
) -> dict:
    work = _prepare(module, fresh)
    had_verdicts = (work / "mutants" / (module + ".meta")).exists()
    deadline = None if left_s is None else time.monotonic() + left_s
    is_complete = _mutmut_run(work, jobs, deadline)
    verdicts = _verdicts(work)
    if is_complete:  # mutmut stopped early when no test reached any mutant: none was killed
        verdicts = {name: v.replace("not checked", "no tests") for name, v in verdicts.items()}
    survivors = [name for name, verdict in verdicts.items() if verdict not in _KILLED]
    if is_complete and had_verdicts and survivors:  # a test added since may kill these now
        is_complete = _mutmut_run(work, jobs, deadline, *survivors)
        verdicts = _verdicts(work)
    report = summarize(module, verdicts, equivalents)
    if not is_complete:  # out of time: what was tested is shown, the module is not judged
        report["partial_score"] = report.pop("score")
        report["incomplete"] = "time budget spent"
    return report


def summarize(module: str, verdicts: dict[str, str], equivalents: dict[str, str]) -> dict:
    killed = [name for name, verdict in verdicts.items() if verdict in _KILLED]
    untested = [name for name, verdict in verdicts.items() if verdict == "not checked"]
    alive = [name for name in verdicts if name not in killed and name not in untested]
    equivalent = [name for name in alive if name in equivalents]
    generated = len(verdicts)
    tested = generated - len(untested) - len(equivalent)
    report = {
        "module": module,
        "generated": generated,
        "killed": len(killed),
        "survived": len(alive),
        "equivalent": len(equivalent),
        "score": round(len(killed) / tested, 4) if tested else 1.0,
        "survivors": sorted(set(alive) - set(equivalent)),
    }
    if untested:
        report["untested"] = len(untested)
    return report


def _prepare(module: str, fresh: bool) -> Path:
    """The module's work folder: links to the package and tests, and mutmut's settings."""
    work = WORK / module.removeprefix("prefill_worker/").removesuffix(".py").replace("/", ".")
    if fresh:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    for name in _LINKED:
        link = work / name
        if not link.is_symlink():
            link.symlink_to(ROOT / name)
    settings = _settings(module, MODULES[module])
    path = work / "pyproject.toml"
    if not path.exists() or path.read_text(encoding="utf-8") != settings:
        path.write_text(settings, encoding="utf-8")
    return work


def _settings(module: str, tests: list[str]) -> str:
    pytest_options = _toml_section(ROOT / "pyproject.toml", "[tool.pytest.ini_options]")
    return (
        "[tool.mutmut]\n"
        'source_paths = ["prefill_worker"]\n'
        'also_copy = ["docs", "configs"]\n'
        f"only_mutate = {json.dumps([module])}\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-m", "not slow and not interop"]\n'
        "use_git_change_detection = false\n\n" + pytest_options
    )


def _toml_section(path: Path, header: str) -> str:
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    start = lines.index(header + "\n")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    return "".join(lines[start:end])


def _mutmut_run(work: Path, jobs: int, deadline: float | None, *names: str) -> bool:
    """``mutmut run``; False when ``deadline`` came first (mutmut and its children are
    stopped, and the verdicts it reached are kept)."""
    timeout = None if deadline is None else max(1.0, deadline - time.monotonic())
    with subprocess.Popen(  # its own session: a timeout stops the forked children too
        [sys.executable, "-m", "mutmut", "run", f"--max-children={jobs}", *names],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return False
    if proc.returncode != 0 and _NO_MUTANT_REACHED not in out:  # that: nothing to mutate
        sys.stderr.write(out[-6000:])
        raise SystemExit(f"mutation: `mutmut run` failed in {work} ({proc.returncode})")
    return True


def _mutmut(work: Path, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "mutmut", *args],
        cwd=work,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-4000:])
        raise SystemExit(f"mutation: `mutmut {args[0]}` failed in {work} ({result.returncode})")
    return result.stdout


def _verdicts(work: Path) -> dict[str, str]:
    """Mutant name -> mutmut's verdict (killed, survived, no tests, timeout, ...)."""
    verdicts = {}
    for line in _mutmut(work, "results", "--all", "true").splitlines():
        name, sep, verdict = line.strip().rpartition(": ")
        if sep and name.startswith("prefill_worker."):
            verdicts[name] = verdict
    return verdicts


if __name__ == "__main__":
    sys.exit(main())
