"""Merge the accuracy-cost rows a ``gradsync sweep`` wrote (``OUT/accuracy_costs.json``) into
``benchmarks/data/accuracy_costs.json``, the quality model's data (a row of the same model, world
size, entry and command is replaced; :func:`gradsync.bench.accuracy_costs.merge_rows`).

    python benchmarks/merge_accuracy_costs.py runs/kjv-adam/sweep/accuracy_costs.json [--into FILE]

Then ``benchmarks/probe_quality.py`` measures the new rows' start-up errors and
``benchmarks/fit_quality_model.py`` refits.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweeps", nargs="+", help="accuracy_costs.json files written by gradsync sweep")
    p.add_argument("--into", default=str(HERE / "data" / "accuracy_costs.json"))
    args = p.parse_args(argv)
    from gradsync.bench.accuracy_costs import SCHEMA, merge_rows

    data = json.loads(Path(args.into).read_text())
    for path in args.sweeps:
        new = json.loads(Path(path).read_text())
        if new.get("schema") != SCHEMA:
            raise SystemExit(f"{path}: schema {new.get('schema')!r}, expected {SCHEMA!r}")
        data["rows"] = merge_rows(data["rows"], new["rows"])
        print(f"{path}: {len(new['rows'])} rows merged")
    Path(args.into).write_text(json.dumps(data, indent=1) + "\n")
    print("wrote", args.into)


if __name__ == "__main__":
    main()
