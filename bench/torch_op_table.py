#!/usr/bin/env python3
"""Markdown tables from bench/torch_op_bench.py's JSON, as the README shows them.

  python bench/torch_op_table.py docs/plots/torch_op_bench.json [more.json ...]

One row per (dtype, V, N, threads): each path's best wall time and peak extra memory
(the fastest in bold), then lce's time over the plain path's (best of the interleaved
repetitions, and their medians) and the plain path's extra memory over lce's.
"""
import json
import sys

ORDER = ["plain", "torch_chunked", "lce", "lce_2sweep"]
TITLES = {"lce_2sweep": "lce 2-sweep"}  # the others titled by their names


def ratio_text(x):
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"  # two significant digits below 0.1


def seconds_text(x):
    return f"{x:.3f} s" if x < 1 else f"{x:.2f} s"  # three significant digits at least


def table(results):
    rows = {}
    for r in results:
        rows.setdefault((r["dtype"], r["vocab"], r["tokens"], r["threads"]), {})[r["path"]] = r
    seen = {p for cells in rows.values() for p in cells}
    paths = [p for p in ORDER if p in seen] + sorted(seen - set(ORDER))
    # Warm-allocator runs do not measure memory: no memory column then.
    with_memory = any(r["peak_extra_bytes"] is not None for r in results)
    lines = ["| dtype | V | N | threads | " + " | ".join(TITLES.get(p, p) for p in paths) +
             " | lce / plain time (min; median) |" + (" plain / lce memory |" if with_memory else ""),
             "|---|---:|---:|---:|" + "---:|" * len(paths) + "---:|" + ("---:|" if with_memory else "")]
    for (dtype, v, n, threads), cells in rows.items():
        fastest = min(c["wall_s"] for c in cells.values())
        shown = []
        for p in paths:
            c = cells.get(p)
            if c is None:
                shown.append("")
                continue
            text = seconds_text(c['wall_s'])
            if c["peak_extra_bytes"] is not None:
                text += f", {c['peak_extra_bytes'] / 2**20:.0f} MiB"
            shown.append(f"**{text}**" if c["wall_s"] == fastest else text)
        lce, plain = cells.get("lce"), cells.get("plain")
        ratio = memory = ""
        if lce and plain:
            ratio = ratio_text(lce['wall_s'] / plain['wall_s'])
            if "median_wall_s" in lce and "median_wall_s" in plain:
                ratio += "; " + ratio_text(lce['median_wall_s'] / plain['median_wall_s'])
            if plain["peak_extra_bytes"] is not None and lce["peak_extra_bytes"] is not None:
                memory = f"{plain['peak_extra_bytes'] / max(lce['peak_extra_bytes'], 1):.1f}x"
        lines.append(f"| {dtype} | {v:,} | {n:,} | {threads} | " + " | ".join(shown) + f" | {ratio} |" +
                     (f" {memory} |" if with_memory else ""))
    return "\n".join(lines)


def main():
    for path in sys.argv[1:]:
        with open(path) as f:
            data = json.load(f)
        allocator = data["info"].get("allocator", "fresh")
        print(f"<!-- {path}: allocator {allocator}; {data['info'].get('blas', '')[:80]}... -->")
        print(table(data["results"]))
        print()


if __name__ == "__main__":
    main()
