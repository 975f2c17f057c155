"""Group a `TRITON_KEYLOG` file (sitecustomize.py beside this file) by process and launch site.

    python3 examples/triton_compile_log/summary.py /tmp/builds.jsonl [--timeline]

One line per (main process or not, launch site): how many builds, their summed seconds, the window they fell in
(seconds after the first build) and the kernel names; `--timeline` lists the main process's builds one by one.
"""

import collections
import json
import sys


def main(path: str, timeline: bool) -> None:
    records = []
    for line in open(path):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "t" in record:
            records.append(record)
    if not records:
        print(path, "no builds recorded")
        return
    main_pid = collections.Counter(r["pid"] for r in records).most_common(1)[0][0]
    t0 = min(r["t"] for r in records)
    groups = collections.defaultdict(list)
    for r in records:
        site = r["ours"] or (f"inductor {r['inductor']}" if r["inductor"] else "?")
        groups[(r["pid"] == main_pid, site.rsplit(":", 2)[0] if r["ours"] else site)].append(r)
    print(f"{path}: {len(records)} builds, {len({r['pid'] for r in records})} processes")
    for (is_main, site), rs in sorted(groups.items(), key=lambda kv: min(r["t"] for r in kv[1])):
        names = sorted(collections.Counter(r["name"] for r in rs).items())[:6]
        print(f"{'main ' if is_main else 'other'} {site[:70]:70s} n={len(rs):3d} sum={sum(r['s'] for r in rs):6.2f} s "
              f"window {min(r['t'] for r in rs) - t0:6.1f}..{max(r['t'] + r['s'] for r in rs) - t0:6.1f} s {names}")
    if timeline:
        for r in sorted(records, key=lambda r: r["t"]):
            if r["pid"] == main_pid:
                print(f"{r['t'] - t0:7.2f} {r['s']:5.2f} {r['thread'][:22]:22s} {r['name'][:28]:28s} "
                      f"{r['ours'][:50]:50s} {r['constexprs'][:100]}")


if __name__ == "__main__":
    main(sys.argv[1], "--timeline" in sys.argv[2:])
