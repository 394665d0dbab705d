"""Before and after: benchmarks/run.py for two revisions of the core, interleaved.

::

    .venv/bin/python benchmarks/compare.py BEFORE [AFTER] [--rounds 4] [-- RUN.PY OPTIONS]
    .venv/bin/python benchmarks/compare.py main HEAD -- --only drain --concurrency 16

Runs ``benchmarks/run.py --core REV --runs 1`` for each revision, round after
round, and alternates which one goes first (before, after; then after,
before; ...), so that what drifts on a shared machine over a sitting
(checkpoints, autovacuum, a neighbour's load) falls on both alike. Two runs
of the same round are minutes apart; a whole run of one revision and then a
whole run of the other are not comparable so, on a 2-core VM. The number of
rounds is even, so that each revision goes first in half of them: the run
that goes second follows the first one's writes (autovacuum and checkpoints
of its tables), and with three rounds the reference loops of the revision
that went second twice came out 0.73 to 0.92 of the other's, where four
rounds of the same revisions gave 0.94 to 1.21.

Prints Markdown: per figure, the median of each revision over the rounds and
the median of the per-round ratios (after / before, each round's pair
measured back to back), with the lowest and highest of them. The raw psycopg
reference loops run the same code for both revisions, so their ratios show
how much the machine drifted between the two runs of a round. A figure
worse by more than ``--tolerance`` (10%) is flagged SLOWER (for latency and
memory: higher). Exit 1 when a run fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The reference loops: the same code whichever core is measured.
CONTROLS = ("drain-textbook-", "drain-grouped-session-", "drain-batch-", "enqueue-raw", "enqueue-async-insert-",
            "outbox-raw-", "bulk-copy", "bulk-orm", "latency-batch-")
# Times and sizes: a higher figure is worse (the outbox's are µs that an enqueue adds to a transaction).
LOWER_IS_BETTER = ("latency-", "rss-first", "rss-total", "outbox-")


def run_once(rev: str, rest: list[str], out: Path) -> dict[str, list[float]]:
    command = [sys.executable, str(HERE / "run.py"), "--core", rev, "--runs", "1", "--json", str(out), *rest]
    print(f"# {' '.join(command[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"benchmarks/run.py failed for {rev} (exit {done.returncode})")
    figures: dict[str, list[float]] = json.loads(out.read_text())["values"]
    return figures


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def label(name: str) -> str:
    if name.startswith("drain-"):  # drain-a-4, drain-async-b-asyncpg-4
        *kind, c = name.split("-")[1:]
        return f"drain {' '.join(kind)}, C={c}"
    return name


def report(before: str, after: str, rounds: list[tuple[dict[str, list[float]], dict[str, list[float]]]],
           tolerance: float, rest: list[str]) -> str:
    names = [n for n in rounds[0][0] if n in rounds[0][1]]
    out = [f"## {after} against {before}, {len(rounds)} interleaved round(s)", "",
           f"- command: `python benchmarks/compare.py {before} {after} --rounds {len(rounds)}"
           + (f" -- {' '.join(rest)}" if rest else "") + "`",
           "- ratio: after / before of each round's pair, median (lowest to highest); "
           "above 1 is faster, except latency, RSS and the outbox's µs (above 1 is higher)", "",
           "| figure | before | after | ratio | range | verdict |", "| --- | ---: | ---: | ---: | --- | --- |"]
    for name in names:
        b = [r[0][name][0] for r in rounds if r[0].get(name)]
        a = [r[1][name][0] for r in rounds if r[1].get(name)]
        ratios = [r[1][name][0] / r[0][name][0] for r in rounds if r[0].get(name) and r[1].get(name)
                  and r[0][name][0]]
        if not ratios:
            continue
        mid = statistics.median(ratios)
        lower = name.startswith(LOWER_IS_BETTER)
        if name.startswith(CONTROLS):
            verdict = "reference loop (drift)"
        elif (mid > 1 + tolerance) if lower else (mid < 1 - tolerance):
            verdict = "HIGHER" if lower else "SLOWER"
        else:
            verdict = "ok"
        out.append(f"| {label(name)} | {median(b):,.1f} | {median(a):,.1f} | {mid:.2f} | "
                   f"{min(ratios):.2f} to {max(ratios):.2f} | {verdict} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, rest = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("before", help="the revision measured as before (a git rev)")
    parser.add_argument("after", nargs="?", default="HEAD", help="the revision measured as after (HEAD)")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each revision, an even number (4)")
    parser.add_argument("--tolerance", type=float, default=0.10, help="worse by more than this is flagged (0.10)")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.rounds % 2:
        parser.error(f"--rounds must be an even number, at least 2, so that each revision goes first in half "
                     f"of them; got {args.rounds}")
    if "--runs" in rest or "--core" in rest or "--json" in rest:
        parser.error("--runs, --core and --json are compare.py's to set")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="sajq-compare-") as tmp:
        for number in range(args.rounds):
            first_after = number % 2 == 1
            order = [args.after, args.before] if first_after else [args.before, args.after]
            got = [run_once(rev, rest, Path(tmp) / f"{number}-{i}.json") for i, rev in enumerate(order)]
            rounds.append((got[1], got[0]) if first_after else (got[0], got[1]))
    print(report(args.before, args.after, rounds, args.tolerance, rest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
