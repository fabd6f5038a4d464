"""What every script in bench/ shares: its `--smoke` mode and where its results go. A helper, not a bench.

`--smoke` runs a bench's own code path (the same functions, engines and trainers, the same table and
headline line) at tiny sizes with one or two repeats: seconds on 2 CPU cores. tests/test_bench.py runs
every bench so in the default tests, so an API change cannot break a bench silently. A smoke run's
numbers mean nothing, so they never land on the measured ones:

- a real run writes bench/results/<name>.json (the committed numbers docs/benchmarks.md quotes);
- a smoke run writes bench/results/<name>.smoke.json, which .gitignore leaves out;
- `--out PATH` writes PATH instead of either (the tests point it into their tmp_path).

    from bench import smoke                         # from the project's root, which every bench puts on sys.path:
                                                    # so also where a bench is loaded by its path, bench/ not on
                                                    # the path (tests/test_plan.py loads bench/memory.py)
    args = smoke.parse_args(ap, SMOKE)              # SMOKE: {argparse dest: its tiny value}
    smoke.write_results(args, "loss", results)      # the JSON, where the mode says
"""

from __future__ import annotations

import argparse
import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parse_args(ap: argparse.ArgumentParser, smoke: dict) -> argparse.Namespace:
    """ap's arguments plus --smoke and --out. With --smoke, `smoke` (argparse dest -> value) replaces
    ap's defaults, so a value given on the command line still wins over a smoke size."""
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: tiny sizes, one repeat, the same code path; results to <name>.smoke.json "
                         "(tests/test_bench.py runs it)")
    ap.add_argument("--out", default="", help="results JSON (default: bench/results/<name>.json, "
                                              "or <name>.smoke.json with --smoke)")
    args = ap.parse_args()
    if args.smoke:
        unknown = sorted(set(smoke) - set(vars(args)))
        assert not unknown, f"smoke sizes for arguments the bench does not have: {unknown}"
        ap.set_defaults(**smoke)
        args = ap.parse_args()
    return args


def results_path(args: argparse.Namespace, name: str) -> str:
    """Where bench `name` writes its results JSON (module docstring); its folder is made if missing."""
    path = args.out or os.path.join(RESULTS, f"{name}.smoke.json" if args.smoke else f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def write_results(args: argparse.Namespace, name: str, results: dict) -> str:
    """results as JSON at results_path(args, name); returns the path."""
    path = results_path(args, name)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    return path
