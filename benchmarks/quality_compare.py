"""Pair two ``quality.py`` runs on the same sequences (two conversions, one split): is a row no worse?

For every row the two runs share, the paired-bootstrap 95% CI of KL(new) − KL(old), resampling whole
sequences; "no worse" is a CI that includes 0 or lies below it (the issue-23 test for r7 and r8). Refuses
runs whose sequences differ, since the pairing would then mean nothing. Usage::

    python benchmarks/quality_compare.py OLD.json NEW.json [--rows base2+r7,base2+r8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from quality import paired_bootstrap


def compare(old: dict, new: dict, rows: list[str] | None = None) -> dict[str, dict]:
    a, b = old["per_sequence"], new["per_sequence"]
    if a["ids"] != b["ids"] or a["tokens"] != b["tokens"]:
        raise ValueError("the two runs scored different sequences (split, prompts or --sequences differ)")
    shared = [r for r in a["kl_sum"] if r in b["kl_sum"]]
    rows = rows or shared
    missing = sorted(set(rows) - set(shared))
    if missing:
        raise ValueError(f"rows {missing} are not in both runs (shared: {shared})")
    n = np.array(a["tokens"], dtype=np.float64)
    out = {}
    for r in rows:
        ka, kb = np.array(a["kl_sum"][r]), np.array(b["kl_sum"][r])
        lo, hi = paired_bootstrap(kb, ka, n)
        out[r] = {
            "kl_old": ka.sum() / n.sum(),
            "kl_new": kb.sum() / n.sum(),
            "diff_ci95": [lo, hi],
            "no_worse": lo <= 0,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--rows", default=None)
    args = parser.parse_args()
    result = compare(
        json.loads(args.old.read_text()), json.loads(args.new.read_text()), args.rows and args.rows.split(",")
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
