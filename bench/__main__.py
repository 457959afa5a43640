"""`python -m bench [NAME ...]`: run the benchmarks and write docs/benchmarks.md.

Owns: the list of benchmark modules and the report layout. Sections come from each module's
`run()`; with names given, only those run and the report holds only them, unless `--replace`:
then their sections replace the same sections of the report and the rest stays. The soak
(bench/soak.py, `make soak`) runs alone and always replaces only its own section, which the
other runs keep. A benchmark that fails (its traceback printed) is left out and the others'
sections are written all the same; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

from bench import Section, machine

MODULES = ["bench_topology", "bench_preferred", "bench_baseline", "bench_events", "bench_plugin", "bench_floor", "bench_health", "bench_state", "bench_doctor", "bench_mig",
           "bench_metrics", "bench_hung", "bench_faults", "bench_sharing", "bench_dra", "bench_e2e", "bench_storm"]
REPORT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
# The rule for code that exists only for speed (issue 37), and the pieces it keeps.
RULE = [
    "- Code that exists only for speed (or memory) stays only if it buys at least 5% on a",
    "  figure a user sees (Allocate latency against the gRPC floor, start → registered,",
    "  scrape time, load + reconcile of 10,000 records, idle CPU, RSS), measured with and",
    "  without it in one run;",
    "  each piece kept is named here with what it buys, its rows (\"without ...\") in the",
    "  sections below:",
    "  - Allocate's answers kept by the request's bytes (`agent/kubelet/plugin.py`, the",
    "    one answer cache): Allocate latency (gRPC-floor section);",
    "  - `agent/deferred.py` (modules `run` never uses load on first use): start →",
    "    registered and RSS after start (device-plugin section);",
    "  - `agent/gcpause.py` (the collector paused while objects are made by the thousand",
    "    and kept): load + reconcile (allocation-state section); its start → registered",
    "    rows are in the device-plugin section;",
    "  - `agent/arenas.py` (glibc's malloc held to one arena): RSS after 10,000",
    "    Allocates (gRPC-floor section).",
    "- Passing the rule does not keep a piece that its own rule removes: the compiled",
    "  journal replay (`agent/_fast/entries.pyx`) bought 48% on load + reconcile (84 ms",
    "  against 162 ms in one run) and went, because the journal has one codec (msgpack's",
    "  own, and zlib's CRC-32), and 162 ms met the ≤ 250 ms target on the machine of that",
    "  run (not on a slower one: the allocation-state section).",
]


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
        *RULE,
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


def _kept(text: str, title: str) -> str:
    """The section titled `title` of the report `text` ("" if none): the soak's, which
    `make bench` does not run (it takes 10 minutes) but keeps, or one a --replace run remakes."""
    head = f"## {title}\n"
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
    parser.add_argument("--replace", action="store_true",
                        help="replace only the named benchmarks' sections of the report, "
                             "keeping the rest (the soak always does)")
    args = parser.parse_args(argv)
    names = args.names or MODULES
    if "soak" in names and names != ["soak"]:
        parser.error("run the soak alone: python -m bench soak (make soak)")
    if args.replace and not args.names:
        parser.error("--replace needs the names of the benchmarks to run again")
    from bench import soak

    old = args.output.read_text() if args.output.exists() else ""
    sections, failed = [], []
    for name in names:
        module = importlib.import_module(f"bench.{name}")
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            sections.append(module.run())
        except Exception:  # noqa: BLE001 - one failure keeps the other benchmarks' figures
            traceback.print_exc()
            failed.append(name)
    if names == ["soak"] or args.replace:  # these sections replace theirs; the rest stays
        text = old or render([])
        for section in sections:
            if names != ["soak"]:
                section.notes.append(f"This section was run again alone on "
                                     f"{time.strftime('%Y-%m-%d %H:%M %Z')} (`python -m bench "
                                     f"--replace`); the date at the top is the full run's.")
            new = "## " + render([section]).split("\n## ", 1)[1]
            before = _kept(old, section.title)
            if before:  # followed by another section: the blank line before its title kept
                text = text.replace(before, new.rstrip("\n") + "\n" + (
                    "\n" if before.endswith("\n\n") else ""))
            else:
                text = text.rstrip("\n") + "\n\n" + new
    else:  # the soak's section, which this run did not make, is kept as it was
        old_soak = _kept(old, soak.TITLE)
        text = render(sections) + ("\n" + old_soak if old_soak else "")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}", file=sys.stderr)
    if failed:
        print(f"failed: {' '.join(failed)}: not in {args.output} (their old sections kept with "
              f"--replace); once mended: python -m bench {' '.join(failed)} --replace",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
