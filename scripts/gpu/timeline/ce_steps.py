#!/usr/bin/env python3
"""Per-op view of the copy-engine dispatch / combine in a timeline of bench_intranode (CSV of
ep_timeline.c): for every `intranode_ce_*` kernel on --device, the kernel's span and every copy
and wait kernel of that device that runs inside the op (from the kernel's start to the end of
its last copy), in us from the kernel's start. Ends with the medians over the ops of each name.

  python3 scripts/gpu/timeline/ce_steps.py tl.csv --device 0 --kernel ce_dispatch --skip 3
"""

import argparse
import csv
import statistics
from collections import defaultdict


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--kernel", default="intranode_ce_dispatch")
    ap.add_argument("--skip", type=int, default=3, help="warm-up ops to drop")
    ap.add_argument("--ops", type=int, default=10)
    ap.add_argument("--show", type=int, default=2, help="ops printed in full")
    a = ap.parse_args()
    rows = []
    with open(a.csv) as f:
        for r in csv.DictReader(f):
            if int(r["device"]) != a.device:
                continue
            r["start"] = int(r["start_ns"]) / 1e3
            r["end"] = int(r["end_ns"]) / 1e3
            rows.append(r)
    rows.sort(key=lambda r: r["start"])
    anchors = [r for r in rows if r["kind"] == "kernel" and a.kernel in r["name"]]
    anchors = anchors[a.skip : a.skip + a.ops]
    summary = defaultdict(list)
    for n, k in enumerate(anchors):
        t0 = k["start"]
        nxt = [r["start"] for r in rows if r["kind"] == "kernel" and r["start"] > k["end"]
               and r["stream"] == k["stream"]]
        limit = min(nxt) if nxt else k["end"] + 1e4
        inside = [r for r in rows if r is not k and r["start"] >= t0 - 50 and r["start"] < limit
                  and r["stream"] != k["stream"]]
        end = max([k["end"]] + [r["end"] for r in inside])
        summary["kernel_end"].append(k["end"] - t0)
        summary["op_end"].append(end - t0)
        copies = [r for r in inside if r["kind"] != "kernel"]
        if copies:
            summary["first_copy_start"].append(min(r["start"] for r in copies) - t0)
            summary["last_copy_end"].append(max(r["end"] for r in copies) - t0)
            summary["copy_busy_sum"].append(sum(r["end"] - r["start"] for r in copies))
        if n < a.show:
            print(f"op {n}: kernel {k['name'][:40]} stream {k['stream']} 0.0 .. {k['end'] - t0:.1f} us; op ends {end - t0:.1f}")
            for r in inside:
                mb = int(r["bytes"]) / 1e6
                gbs = mb * 1e3 / max(r["end"] - r["start"], 1e-3)
                print(f"  {r['kind']:8} s{r['stream']:>4} {r['start'] - t0:8.1f} .. {r['end'] - t0:8.1f}"
                      f"  {mb:7.2f} MB {gbs:7.1f} GB/s  {r['name'][:40]}")
    print(f"medians over {len(anchors)} ops (us from the kernel's start):")
    for key, v in summary.items():
        print(f"  {key:18} {statistics.median(v):8.1f}  (min {min(v):.1f}, max {max(v):.1f})")


if __name__ == "__main__":
    main()
