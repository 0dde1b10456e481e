"""Benchmark (not a test): one benchmark module on two revisions of the code, side by side.

Checks the base revision out into a temporary git worktree, then runs the benchmark module
alternately on the base and on the working tree (``--runs`` times each, base first), each
run a fresh process with that tree first on ``PYTHONPATH`` and the same virtualenv. Every
run's output is printed as it comes; at the end, the lines matching ``--keep`` (a regular
expression) are printed again, grouped by revision, so the figures sit side by side.
Alternating runs share whatever else the machine was doing, which a before-then-after pair
does not.

    .venv/bin/python -m tests.bench.revisions --base baf09b2 --runs 3 \\
        --keep 'EPP |ratio' -- tests.bench.extproc_overhead --requests 3000
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tree: Path, module: str, args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    completed = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if completed.returncode != 0:
        sys.stderr.write(completed.stderr)
        raise SystemExit(f"{module} failed in {tree} with exit code {completed.returncode}")
    return completed.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--runs", type=int, default=3, help="runs per revision, alternating")
    parser.add_argument("--keep", default=".", help="regex of output lines to summarise")
    parser.add_argument("module", help="the benchmark module, e.g. tests.bench.extproc_overhead")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    ns = parser.parse_args()
    args = [a for a in ns.args if a != "--"]
    keep = re.compile(ns.keep)
    with tempfile.TemporaryDirectory(prefix="epp-base-") as tmp:
        base_tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_tree), ns.base],
            check=True,
            capture_output=True,
        )
        kept: dict[str, list[str]] = {"base": [], "current": []}
        try:
            for run in range(ns.runs):
                for label, tree in (("base", base_tree), ("current", ROOT)):
                    print(
                        f"=== {label} ({ns.base if label == 'base' else 'working tree'}), "
                        f"run {run + 1}/{ns.runs}",
                        flush=True,
                    )
                    output = _run(tree, ns.module, args)
                    print(output, flush=True)
                    kept[label].extend(
                        f"run {run + 1}: {line}"
                        for line in output.splitlines()
                        if keep.search(line)
                    )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)],
                check=False,
                capture_output=True,
            )
    for label, lines in kept.items():
        print(f"--- {label}")
        for line in lines:
            print(line)


if __name__ == "__main__":
    main()
