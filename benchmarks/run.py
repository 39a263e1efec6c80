"""filterjit's benchmarks against `jax.jit`, `equinox.filter_jit` and `flax.nnx.jit`.

    python benchmarks/run.py            # full run, with PASS/MISS against the targets
    python benchmarks/run.py --quick    # smoke run with few repetitions (CI)
    python benchmarks/run.py --check    # exit 1 if a target is missed
    python benchmarks/run.py --sections dispatch,nested
    python benchmarks/run.py --profile  # where a filterjit call spends its time
    python benchmarks/run.py --plot docs/performance.svg  # and chart the ratios
    python benchmarks/run.py --plot docs/performance.svg --record benchmarks/results.md
                                        # and keep the run: what the docs quote

Every implementation is measured in this one process, in interleaved rounds, so
that drift of the machine hits all of them alike; the memory section alone runs
each implementation in a subprocess of its own. The output is markdown.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


# Run as a script, this directory is on sys.path already; imported otherwise
# (`python -m benchmarks.run`, tests), it may not be.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _async  # noqa: E402
import _dispatch  # noqa: E402
import _harness as harness  # noqa: E402
import _libraries  # noqa: E402
import _memory  # noqa: E402
import _module  # noqa: E402
import _nested  # noqa: E402
import _patched  # noqa: E402
import _plot  # noqa: E402
import _profile  # noqa: E402
import _programs  # noqa: E402
import _specialise  # noqa: E402
import _stateful  # noqa: E402
import _varying  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402

import filterjit  # noqa: E402


SECTIONS: dict[str, Callable[[harness.Settings], harness.Section]] = {
    "dispatch": _dispatch.run,
    "module": _module.run,
    "programs": _programs.run,
    "stateful": _stateful.run,
    "nested": _nested.run,
    "async": _async.run,
    "memory": _memory.run,
    "specialisation": _specialise.run,
    "varying": _varying.run,
    "libraries": _libraries.run,
    "patched": _patched.run,
}

# The sections that `--plot` charts, each with the title of its panel.
CHARTED = {
    "dispatch": "Dispatch by leaf count: tree -> tree + k, N float32[4] leaves",
    "programs": "Real programs",
    "libraries": "Library entry points",
}


def _revision() -> str:
    """The git commit of the working tree, `+` if it has changes; or n/a."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "filterjit"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return harness.NA
    return commit + ("+" if status else "")


def _environment() -> str:
    nnx = harness.optional_nnx()
    flax_version = harness.NA
    if nnx is not None:
        import flax

        flax_version = flax.__version__
    load = os.getloadavg()[0]
    return (
        f"Python {platform.python_version()}, jax {jax.__version__}, "
        f"equinox {eqx.__version__}, flax {flax_version}, "
        f"filterjit {filterjit.__version__} (commit {_revision()}); backend "
        f"{jax.default_backend()} ({jax.devices()[0].device_kind}), "
        f"{platform.machine()} with "
        f"{os.cpu_count()} CPUs, load average {load:.2f} at the start."
    )


def _summary(targets: list[harness.Target]) -> str:
    headers = ["section", "measure", "filterjit", "target", "result"]
    rows = [
        [
            t.section,
            t.measure,
            f"{harness.fmt_number(t.value)}{t.unit}",
            t.describe(),
            t.verdict,
        ]
        for t in targets
    ]
    return harness.markdown_table(headers, rows, left=2)


def _chart(sections: dict[str, harness.Section], caption: str) -> str:
    """The SVG chart of this run's ratios to jax.jit: a panel per charted
    section, and a note for each that was not run or was skipped."""
    panels = []
    for name, title in CHARTED.items():
        section = sections.get(name)
        if section is None:
            panels.append(
                _plot.Panel(title, [], f"{name}: not run, not among --sections")
            )
        elif not section.ratios:
            panels.append(_plot.Panel(title, [], section.header))
        else:
            panels.append(_plot.Panel(title, section.ratios))
    return _plot.render(
        "filterjit: time per call ÷ jax.jit",
        caption,
        panels,
        [
            harness.JAX,
            harness.EQX,
            harness.NNX,
            harness.FILTERJIT,
            harness.FILTERJIT_JIT,
        ],
    )


def _record(
    path: Path,
    command: str,
    run_date: str,
    run_line: str,
    sections: dict[str, harness.Section],
    targets: list[harness.Target],
    total: float,
) -> None:
    """Writes the run to `path` (markdown, as printed, headings one level down) and
    its figures to `path` with the suffix `.json`: the run that the docs quote and
    that `tests/test_readme.py` checks their figures against."""
    parts = [
        f"The run recorded by `{command}` on {run_date}, at commit {_revision()}.",
        "",
        run_line,
    ]
    for section in sections.values():
        parts += ["", "#" + section.render(True)]
    if targets:
        parts += ["", "### targets", "", _summary(targets)]
    parts += ["", f"Total {total:.1f} s."]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    figures = {
        "command": command,
        "date": run_date,
        "commit": _revision(),
        "environment": run_line,
        "ratios": {
            name: [
                {"label": r.label, "ratios": dict(r.ratios), "limit": r.limit}
                for r in section.ratios
            ]
            for name, section in sections.items()
        },
        "targets": [
            {"section": t.section, "measure": t.measure, "value": t.value}
            for t in targets
        ],
        "total_s": round(total, 1),
    }
    path.with_suffix(".json").write_text(
        json.dumps(figures, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run with few repetitions; targets are not checked",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the targets (in quick mode too) and exit 1 if one is missed",
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of: {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print a cProfile of top-level filterjit calls instead",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        type=Path,
        help=(
            "after the run, write an SVG chart of its ratios to jax.jit to PATH "
            f"(sections {', '.join(CHARTED)}; e.g. docs/performance.svg)"
        ),
    )
    parser.add_argument(
        "--record",
        metavar="PATH",
        type=Path,
        help=(
            "after the run, write it to PATH (markdown) and its figures to PATH with "
            "the suffix .json (e.g. benchmarks/results.md, which the docs quote)"
        ),
    )
    parser.add_argument("--memory-child", metavar="NAME", help=argparse.SUPPRESS)
    parser.add_argument("--iterations", type=int, default=300, help=argparse.SUPPRESS)
    parser.add_argument(
        "--ownership-child", action="store_true", help=argparse.SUPPRESS
    )
    parser.add_argument("--classes", type=int, default=30, help=argparse.SUPPRESS)
    parser.add_argument("--lambdas", type=int, default=100, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.memory_child is not None:
        print(json.dumps(_memory.child(args.memory_child, args.iterations)))
        return 0
    if args.ownership_child:
        print(
            json.dumps(_memory.ownership_child(args.classes, args.lambdas, args.warmup))
        )
        return 0
    if args.profile:
        if args.plot is not None or args.record is not None:
            parser.error("--plot and --record keep a benchmark run, not --profile")
        quick = {"sizes": (1,), "calls": 200} if args.quick else {}
        print(_profile.profile(**quick))
        return 0

    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(
            f"unknown section(s) {', '.join(unknown)}; choose from "
            f"{', '.join(SECTIONS)}"
        )
    settings = harness.Settings(quick=args.quick, targets=args.check or not args.quick)
    mode = "quick (smoke run, no targets)" if args.quick else "full"
    run_line = f"Mode: {mode}. {_environment()}"
    run_date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print("# filterjit benchmarks")
    print()
    print(run_line)
    start = time.perf_counter()
    targets: list[harness.Target] = []
    sections: dict[str, harness.Section] = {}
    for name in chosen:
        section_start = time.perf_counter()
        section = SECTIONS[name](settings)
        elapsed = time.perf_counter() - section_start
        print()
        print(section.render(settings.targets))
        print(f"\n({name}: {elapsed:.1f} s)", flush=True)
        targets += section.targets
        sections[name] = section
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        args.plot.write_text(
            _chart(sections, f"Run of {run_date}. {run_line}"), encoding="utf-8"
        )
        print(f"Chart of this run written to {args.plot}.", file=sys.stderr)
    total = time.perf_counter() - start
    if args.record is not None:
        command = " ".join(["python benchmarks/run.py", *(argv or sys.argv[1:])])
        _record(args.record, command, run_date, run_line, sections, targets, total)
        print(f"This run written to {args.record}.", file=sys.stderr)
    print()
    if settings.targets and targets:
        print("## targets")
        print()
        print(
            "filterjit against the targets of the issue (ratios are to jax.jit in "
            "this run, for programs to each row's jax.jit baseline; informational "
            "unless --check is given)."
        )
        print()
        print(_summary(targets))
        print()
        missed = [t for t in targets if not t.passed]
        verdict = f"{len(targets) - len(missed)}/{len(targets)} targets met"
        print(f"{verdict}. Total {total:.1f} s.")
        if args.check and missed:
            return 1
    else:
        print(f"Total {total:.1f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
