"""Put the one-row winners of ``gemv_chain.py`` into a skinny-GEMM table.

For each shape of the chain's records, the fastest candidate whose PDL preload is what the step
runs at one row (on: ``EXECRT_PDL_PRELOAD`` unset) replaces the table's one-row tile if it beats
that tile's own chain time by at least ``--min-gain`` (default 5%; the H100's chain put a 3%
difference down to noise). The table keeps every other entry. It prints each change with both
times, and writes the table in place (or to ``--out``).

Usage (GPU run's JSON, any machine):
``python benchmarks/apply_gemv_chain.py gemv-chain-1.json [--table PATH] [--out PATH]``;
``--table`` defaults to this GPU's table in ``execrt/kernels/linear_configs`` named from the
records' ``gpu``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any

import torch

from execrt.kernels._triton import tuned_table_name
from execrt.kernels.triton_linear import CONFIG_DIR, PLAIN, SkinnyTile, load_table, tile_to_json


def _key(record: dict[str, Any]) -> str:
    variant = record["variant"] or PLAIN
    return f"{record['n']},{record['k']}" + (f",{variant}" if variant != PLAIN else "")


def _tile(record: dict[str, Any]) -> SkinnyTile:
    return SkinnyTile(
        record["block_n"],
        record["block_k"],
        use_dot=record["use_dot"],
        num_warps=record["warps"],
        num_stages=record["stages"],
        late_norm=bool(record.get("late_norm")),
        split_k=record.get("split_k", 1) or 1,
        fuse_norm=True,  # as a table's one-row tiles are (the chain runs each variant fused)
    )


def winners(records: list[dict[str, Any]], min_gain: float) -> dict[str, tuple[SkinnyTile, str]]:
    """``{table key: (tile, why)}`` for the shapes whose best one-row candidate beats the
    table's tile by ``min_gain`` (a fraction)."""
    out: dict[str, tuple[SkinnyTile, str]] = {}
    timed = [r for r in records if "us_per_call" in r]
    for key in dict.fromkeys(_key(r) for r in timed):
        rows = [r for r in timed if _key(r) == key]
        table = [r for r in rows if r["kind"] == "table"]
        # The step's one-row launch preloads (None: the table's row, run as the step runs it).
        cands = [r for r in rows if r["kind"] == "candidate" and r.get("preload") in (None, True)]
        if not table or not cands:
            continue
        best = min(cands, key=lambda r: r["us_per_call"])
        was = table[0]["us_per_call"]
        if best["us_per_call"] <= was * (1 - min_gain):
            why = f"{was:.2f} -> {best['us_per_call']:.2f} us per call in the chain"
            out[key] = (_tile(best), why)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("chains", nargs="+", help="gemv_chain.py --json outputs (one-row runs only)")
    ap.add_argument("--table", help="the table to update (default: the records' GPU's)")
    ap.add_argument("--out", help="where to write (default: --table, in place)")
    ap.add_argument("--min-gain", type=float, default=0.05)
    args = ap.parse_args(argv)
    records: list[dict[str, Any]] = []
    gpus = set()
    for path in args.chains:
        with open(path) as fh:
            data = json.load(fh)
        gpus.add(data.get("gpu"))
        records += [r for r in data["records"] if r.get("rows", 1) == 1]  # older runs: no rows
    table_path = args.table
    if table_path is None:
        if len(gpus) != 1 or None in gpus:
            named = sorted(map(str, gpus))
            print(f"apply_gemv_chain: records name GPUs {named}; pass --table", file=sys.stderr)
            return 2
        table_path = os.path.join(CONFIG_DIR, tuned_table_name(gpus.pop(), torch.bfloat16))
    if load_table(table_path) is None:  # also checks the file parses as a table
        print(f"apply_gemv_chain: no table at {table_path}", file=sys.stderr)
        return 2
    with open(table_path) as fh:
        data = json.load(fh)
    changes = winners(records, args.min_gain)
    for key, (tile, why) in changes.items():
        entry = data["shapes"].setdefault(key, {})
        new = tile_to_json(tile)
        if entry.get("1") == new:
            continue
        print(f"{key} M=1: {entry.get('1')} -> {tile} ({why})")
        entry["1"] = new
    if not changes:
        print(f"apply_gemv_chain: no one-row tile beats the table's by {args.min_gain:.0%}")
    data["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with open(args.out or table_path, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
