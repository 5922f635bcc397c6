"""Checks dear-bench --samples against the run's own --json, independently of the benchmark.

usage: check_samples.py SAMPLES.csv RESULT.json ITERS [ROWS oop|ip]

Every size and placement in the JSON must have exactly ITERS samples, numbered 0..ITERS-1 in
order, each a positive time; and the JSON's p50/p99 (rank 0's) must be the nearest-rank
percentiles of those samples, recomputed here. With ROWS and a placement (a run with
--placement), the JSON must hold ROWS rows in which only that placement was timed, each with
0 wrong elements, and the other placement is null.
"""
import csv
import json
import math
import sys


def nearest_rank(values, p):
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100.0 * len(ordered))) - 1]


def main():
    samples_path, json_path, iters = sys.argv[1], sys.argv[2], int(sys.argv[3])
    only = sys.argv[5] if len(sys.argv) > 5 else None
    with open(samples_path, newline="") as f:
        rows = list(csv.reader(f))
    if rows[0] != ["size", "placement", "iteration", "us"]:
        sys.exit(f"bad header: {rows[0]}")
    series = {}
    for row in rows[1:]:
        size, placement, iteration, us = int(row[0]), row[1], int(row[2]), float(row[3])
        if placement not in ("oop", "ip"):
            sys.exit(f"bad placement in {row}")
        if us <= 0:
            sys.exit(f"non-positive time in {row}")
        got = series.setdefault((size, placement), [])
        if iteration != len(got):
            sys.exit(f"iteration {iteration} out of order for {size} {placement}")
        got.append(us)
    with open(json_path) as f:
        report = json.load(f)
    if only is not None:
        if len(report["rows"]) != int(sys.argv[4]):
            sys.exit(f"{len(report['rows'])} rows, expected {sys.argv[4]}")
        for row in report["rows"]:
            timed = row[only]
            if timed is None or timed["wrong"] != 0:
                sys.exit(f"--placement {only}: {only} not timed or not correct in {row}")
            if row["ip" if only == "oop" else "oop"] is not None:
                sys.exit(f"--placement {only}: the other placement was timed in {row}")
    expected = set()
    for row in report["rows"]:
        for placement in ("oop", "ip"):
            cell = row[placement]
            if cell is None or cell.get("p50_us") is None:
                continue
            key = (row["size"], placement)
            expected.add(key)
            values = series.get(key, [])
            if len(values) != iters:
                sys.exit(f"{key}: {len(values)} samples, expected {iters}")
            # The JSON holds the figures as the report printed them; compare to 1 ns.
            for p, field in ((50, "p50_us"), (99, "p99_us")):
                want = nearest_rank(values, p)
                if abs(want - cell[field]) > 1e-3:
                    sys.exit(f"{key}: {field} {cell[field]} but the samples give {want}")
    if set(series) != expected:
        sys.exit(f"samples for {sorted(set(series) - expected)} not in the report")
    print(f"{len(rows) - 1} samples over {len(expected)} size/placement cells agree with the report")


if __name__ == "__main__":
    main()
