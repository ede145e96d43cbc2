#!/usr/bin/env python3
"""Per-step tables of a GPU timeline recorded by ep_timeline.c (CSV rows: kind, device, stream,
start_ns, end_ns, correlation, bytes, name).

A step is found by its anchor, a kernel whose name matches --anchor (by default the normal-mode
combine): step j runs from the end of step j-1 to the end of the first kernel that starts on
the step's busiest stream after anchor j ends (the layer's last add, which waits for the
combine). The first --steps anchors on --device are taken (a benchmark's warm-up and timed
layer steps come first); --skip drops the first ones (warm-ups).

For each step: every kernel with its stream, start and end in us from the step's first kernel,
and a short name; then the steps' median per category (by name) and per stream, and the time
each stream was busy.

  python3 scripts/gpu/timeline/timeline.py tl.1234.csv --device 0 --steps 7 --skip 2
"""

import argparse
import csv
import re
import statistics
import subprocess
from collections import defaultdict

# Categories by name, first match wins (names demangled where c++filt is present).
CATEGORIES = [
    ("notify", r"notify"),
    ("dispatch", r"intranode_dispatch|rings_dispatch|ce_.*dispatch|dispatch"),
    ("combine", r"intranode_combine|combine"),
    ("layout", r"layout"),
    ("permute", r"expert_order|permute|scatter|gather"),
    ("grouped_gemm", r"grouped|ep_gemm|GroupedGemm|cutlass.*Grouped|sm90_gemm"),
    ("router", r"topk|router|softmax|sigmoid"),
    ("gemm_cublas", r"nvjet|gemm|Gemm|cublas|cutlass"),
    ("elementwise", r"badd|bmul|affine|silu|cast|copy|ucopy|unary|binary|fill|where"),
]


def demangle(names):
    names = list(names)
    try:
        out = subprocess.run(
            ["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True
        ).stdout.splitlines()
        if len(out) == len(names):
            return dict(zip(names, out))
    except (OSError, subprocess.CalledProcessError):
        pass
    return {n: n for n in names}


def short(name, width=60):
    n = re.sub(r"\(.*$", "", name)
    n = re.sub(r"<.*>", "<>", n)
    return n[:width]


def category(name):
    for cat, pat in CATEGORIES:
        if re.search(pat, name):
            return cat
    return "other"


def load(path, device, driver_min_us=None):
    rows = []
    calls = []
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["kind"] == "driver" and driver_min_us is not None:
                calls.append(r)
                continue
            if int(r["device"]) != device:
                continue
            rows.append(
                {
                    "kind": r["kind"],
                    "stream": int(r["stream"]),
                    "start": int(r["start_ns"]),
                    "end": int(r["end_ns"]),
                    "name": r["name"],
                    "corr": int(r["correlation"]),
                }
            )
    if calls:
        # The host threads that launched this device's work, and their slow driver calls.
        mine = {r["corr"] for r in rows}
        threads = {int(c["stream"]) for c in calls if int(c["correlation"]) in mine}
        for c in calls:
            start, end = int(c["start_ns"]), int(c["end_ns"])
            if int(c["stream"]) in threads and (end - start) >= driver_min_us * 1e3:
                rows.append(
                    {
                        "kind": "driver",
                        "stream": int(c["stream"]) % 100000,
                        "start": start,
                        "end": end,
                        "name": c["name"],
                        "corr": int(c["correlation"]),
                    }
                )
    names = demangle({r["name"] for r in rows})
    for r in rows:
        r["name"] = names.get(r["name"], r["name"])
        r["cat"] = category(r["name"]) if r["kind"] == "kernel" else r["kind"]
    rows.sort(key=lambda r: r["start"])
    return rows


def steps(rows, anchor, count):
    gpu = [r for r in rows if r["kind"] != "driver"]
    anchors = [r for r in gpu if r["kind"] == "kernel" and re.search(anchor, r["name"])][:count]
    out = []
    begin = None
    for a in anchors:
        lo = begin if begin is not None else a["start"] - 20_000_000
        inside = [r for r in gpu if lo < r["start"] <= a["end"]]
        if not inside:
            continue
        # The compute stream: the one that ran most of the step's kernels.
        counts = defaultdict(int)
        for r in inside:
            counts[r["stream"]] += 1
        first_stream = max(counts, key=counts.get)
        tail = [r for r in gpu if r["start"] >= a["end"] and r["stream"] == first_stream]
        end = tail[0]["end"] if tail else a["end"]
        step = [r for r in rows if lo < r["start"] <= end]
        out.append(step)
        begin = end
    return out


def busy(intervals):
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--anchor", default=r"intranode_combine|combine")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--quiet", action="store_true", help="summaries only")
    ap.add_argument(
        "--driver",
        type=float,
        metavar="US",
        help="also list the driver calls of this device's host threads that took at least US us"
        " (recorded with EP_TIMELINE_DRIVER=1; the stream column then holds the thread)",
    )
    args = ap.parse_args()
    rows = load(args.csv, args.device, args.driver)
    all_steps = steps(rows, args.anchor, args.steps)[args.skip:]
    per_cat = defaultdict(list)
    per_stream = defaultdict(list)
    totals = []
    compute_busy = []
    for j, step in enumerate(all_steps):
        gpu_ops = [r for r in step if r["kind"] != "driver"]
        t0 = gpu_ops[0]["start"]
        t1 = max(r["end"] for r in gpu_ops)
        totals.append((t1 - t0) / 1e3)
        if not args.quiet:
            print(f"\n## step {j + args.skip}: {(t1 - t0) / 1e3:.1f} us, {len(step)} ops")
            print(f"{'stream':>7} {'start':>8} {'end':>8} {'us':>7}  category      name")
            for r in step:
                print(
                    f"{r['stream']:>7} {(r['start'] - t0) / 1e3:8.1f} {(r['end'] - t0) / 1e3:8.1f}"
                    f" {(r['end'] - r['start']) / 1e3:7.1f}  {r['cat']:<13} {short(r['name'])}"
                )
        cats = defaultdict(list)
        streams = defaultdict(list)
        for r in gpu_ops:
            cats[r["cat"]].append((r["start"], r["end"]))
            streams[r["stream"]].append((r["start"], r["end"]))
        for c, iv in cats.items():
            first = min(s for s, _ in iv)
            last = max(e for _, e in iv)
            per_cat[c].append((busy(iv) / 1e3, (first - t0) / 1e3, (last - t0) / 1e3))
        for s, iv in streams.items():
            per_stream[s].append(busy(iv) / 1e3)
        compute_busy.append(max(busy(iv) for iv in streams.values()) / 1e3)
    if not all_steps:
        print("no steps found")
        return
    print(f"\n# {len(all_steps)} steps on device {args.device}: median {statistics.median(totals):.1f} us"
          f" (min {min(totals):.1f}, max {max(totals):.1f})")
    print(f"{'category':<14} {'busy us':>8} {'first':>8} {'last':>8}   (medians over steps)")
    for c, v in sorted(per_cat.items(), key=lambda kv: statistics.median(x[1] for x in kv[1])):
        print(
            f"{c:<14} {statistics.median(x[0] for x in v):8.1f} {statistics.median(x[1] for x in v):8.1f}"
            f" {statistics.median(x[2] for x in v):8.1f}"
        )
    print(f"{'stream':<14} {'busy us':>8}")
    for s, v in sorted(per_stream.items()):
        print(f"{s:<14} {statistics.median(v):8.1f}")
    # The compute stream (the busiest) idle within its step: the time it waited for the
    # communication stream or the host, i.e. what was exposed on this rank's critical path.
    idle = [t - b for t, b in zip(totals, compute_busy)]
    print(
        f"compute stream idle: median {statistics.median(idle):.1f} us"
        f" ({100 * statistics.median(i / t for i, t in zip(idle, totals)):.1f} % of the step;"
        f" min {min(idle):.1f}, max {max(idle):.1f})"
    )


if __name__ == "__main__":
    main()
