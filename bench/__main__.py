"""`python -m bench [NAME ...]`: run the benchmarks and write docs/benchmarks.md.

Owns: the list of benchmark modules and the report layout. Sections come from each module's
`run()`; with names given, only those run and the report holds only them. The soak
(bench/soak.py, `make soak`) runs alone and replaces only its own section, which the other
runs keep.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from bench import Section, machine

MODULES = ["bench_topology", "bench_preferred", "bench_baseline", "bench_events", "bench_plugin", "bench_floor", "bench_health", "bench_state", "bench_doctor", "bench_mig",
           "bench_metrics", "bench_hung", "bench_faults"]
REPORT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def render(sections: list[Section]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`python -m bench`); do not edit by hand.",
        "",
        f"- Machine: {machine()}",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M %Z')}",
        "- Times are wall-clock; median and p99 by nearest rank. `cython` is the compiled",
        "  module, `python` its pure-Python twin (GPU_AGENT_PURE_PYTHON=1).",
        "",
    ]
    for s in sections:
        lines += [f"## {s.title}", "", s.method, ""]
        lines.append("| " + " | ".join(s.header) + " |")
        lines.append("|" + "---|" * len(s.header))
        lines += ["| " + " | ".join(row) + " |" for row in s.rows]
        lines.append("")
        lines += [f"- {n}" for n in s.notes]
        if s.notes:
            lines.append("")
    return "\n".join(lines)


def _kept(report: Path, title: str) -> str:
    """The section titled `title` of the report at `report` as it stands ("" if none): the
    soak's, which `make bench` does not run (it takes 10 minutes) but keeps."""
    if not report.exists():
        return ""
    text, head = report.read_text(), f"## {title}\n"
    start = text.find(head)
    if start < 0:
        return ""
    end = text.find("\n## ", start + len(head))
    return text[start:] if end < 0 else text[start:end + 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("names", nargs="*",
                        help=f"benchmarks to run (default: all of {MODULES}; `soak` runs alone "
                             f"and updates only its section)")
    parser.add_argument("--output", type=Path, default=REPORT, help="report path")
    args = parser.parse_args(argv)
    names = args.names or MODULES
    if "soak" in names and names != ["soak"]:
        parser.error("run the soak alone: python -m bench soak (make soak)")
    from bench import soak

    old_soak = _kept(args.output, soak.TITLE)
    sections = []
    for name in names:
        module = importlib.import_module(f"bench.{name}")
        print(f"running {name} ...", file=sys.stderr, flush=True)
        sections.append(module.run())
    if names == ["soak"]:  # its section replaces its old one; the rest of the report stays
        text = args.output.read_text() if args.output.exists() else render([])
        new = "## " + render(sections).split("\n## ", 1)[1]
        text = text.replace(old_soak, new) if old_soak else text.rstrip("\n") + "\n\n" + new
    else:  # the soak's section, which this run did not make, is kept as it was
        text = render(sections) + ("\n" + old_soak if old_soak else "")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
