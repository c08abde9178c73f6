#!/usr/bin/env python3
"""The report of scripts/profile-forwards.sh: perf samples of the empty RPC and of 1-row forwards,
as CPU microseconds per request by process and by what ran, a table and a JSON with the machine.

  profile_classes.py TMP_DIR SERVER_PID SECONDS OUT_JSON

TMP_DIR holds, for each flow (empty, forward), FLOW.samples (`perf script -F comm,pid,ip,sym,dso`),
FLOW.json (gradwire-load's results) and FLOW.loadpid (the load tool's process id).
"""
import json
import os
import re
import sys
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import describe  # noqa: E402

FREQ = 997  # perf record -F, per CPU
CLASSES = [
    # (name, test on (dso, sym)), first match wins
    ("fp8 gemm", lambda d, s: "OrderedGemm" in s or "Kernel<" in s),
    ("gradwire other", lambda d, s: "gradwire" in d or "gradwire" in s),
    ("grpc", lambda d, s: re.search(r"lib(grpc|gpr|absl|upb|address_sorting|cares|re2)", d)),
    ("protobuf", lambda d, s: "libprotobuf" in d),
    ("libtorch", lambda d, s: re.search(r"lib(torch|c10)", d)),
    ("blas", lambda d, s: "blas" in d),
    ("c library", lambda d, s: re.search(r"lib(c|m|pthread|stdc\+\+)[.-]", d) or "ld-linux" in d),
    ("kernel", lambda d, s: "kernel" in d or d.startswith("[")),
]
# `perf script -F comm,pid,ip,sym,dso`: COMM PID IP SYMBOL (DSO); symbols may hold spaces.
LINE = re.compile(r"^\s*(.*?)\s+(\d+)\s+([0-9a-f]+)\s+(.*)\s+\((.*)\)\s*$")


def classify(dso, sym):
    for name, test in CLASSES:
        if test(dso, sym):
            return name
    return "other"


def read_samples(path, server_pid, load_pid, symbols=None):
    """Samples per (process, class): process is server, load, idle or other. `symbols`, when
    given, counts the server's samples per (class, symbol)."""
    counts = Counter()
    for line in open(path, errors="replace"):
        m = LINE.match(line)
        if not m:
            continue
        pid, sym, dso = int(m.group(2)), m.group(4), m.group(5)
        if pid == 0:
            proc = "idle"
        elif pid == server_pid:
            proc = "server"
        elif pid == load_pid:
            proc = "load"
        else:
            proc = "other"
        cls = classify(dso, sym) if proc in ("server", "load") else proc
        counts[(proc, cls)] += 1
        if symbols is not None and proc == "server":
            symbols[(cls, sym)] += 1
    return counts


def main():
    tmp, server_pid, secs, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    flows = {}
    for flow in ("empty", "forward"):
        load = json.load(open(os.path.join(tmp, flow + ".json")))
        rate = float(load["runs"][0]["requests_per_s"])
        load_pid = int(open(os.path.join(tmp, flow + ".loadpid")).read())
        symbols = Counter()
        counts = read_samples(os.path.join(tmp, flow + ".samples"), server_pid, load_pid, symbols)
        window = secs - 0.5
        requests = rate * window
        per_req = {f"{p}/{c}": n / FREQ / requests * 1e6 for (p, c), n in counts.items()}
        by_proc = defaultdict(float)
        for (p, _), n in counts.items():
            by_proc[p] += n / FREQ / requests * 1e6
        total_samples = sum(counts.values())
        batch = load["runs"][0].get("batch_requests", {}).get("mean")
        flows[flow] = {"requests_per_s": rate, "samples": total_samples, "mean_batch": batch,
                       "latency_ms": load["runs"][0].get("latency"),
                       "server_top_symbols_us_per_request": [
                           {"class": c, "symbol": sym[:160], "us": n / FREQ / requests * 1e6}
                           for (c, sym), n in symbols.most_common(40)],
                       "cpu_us_per_request": dict(sorted(per_req.items())),
                       "cpu_us_per_request_by_process": dict(by_proc),
                       "idle_share": counts_share(counts, "idle")}
    names = sorted({k for f in flows.values() for k in f["cpu_us_per_request"]
                    if not k.startswith(("idle", "other"))})
    print(f"{'CPU us per request':28s} {'empty RPC':>10s} {'forward':>10s} {'extra':>10s}")
    for k in names:
        e = flows["empty"]["cpu_us_per_request"].get(k, 0.0)
        f = flows["forward"]["cpu_us_per_request"].get(k, 0.0)
        print(f"{k:28s} {e:10.1f} {f:10.1f} {f - e:10.1f}")
    for p in ("server", "load"):
        e = flows["empty"]["cpu_us_per_request_by_process"].get(p, 0.0)
        f = flows["forward"]["cpu_us_per_request_by_process"].get(p, 0.0)
        print(f"{p + ' total':28s} {e:10.1f} {f:10.1f} {f - e:10.1f}")
    busy = {k: sum(v for p, v in flows[k]["cpu_us_per_request_by_process"].items()
                   if p in ("server", "load")) for k in flows}
    for k in flows:
        batch = flows[k]["mean_batch"]
        print(f"{k}: {flows[k]['requests_per_s']:.0f} req/s, idle {flows[k]['idle_share']:.1%}, "
              f"server + load {busy[k]:.1f} CPU us per request"
              + (f", mean batch {batch:.1f} requests" if batch else ""))
    print("server's top symbols in the forward flow (CPU us per request):")
    for row in flows["forward"]["server_top_symbols_us_per_request"][:25]:
        print(f"  {row['us']:6.1f}  {row['class']:15s} {row['symbol'][:90]}")
    ratio = flows["forward"]["requests_per_s"] / flows["empty"]["requests_per_s"]
    print(f"forward / empty RPC rate: {ratio:.2f}; empty / forward CPU per request: "
          f"{busy['empty'] / busy['forward']:.2f}")
    json.dump({"machine": describe(), "command": "scripts/profile-forwards.sh",
               "what": "perf record -a at 997 Hz over the measured window of gradwire-load -c 32 "
                       "(1-row inference forwards of a Linear 1024->1024, and empty RPCs) against "
                       "one default server; CPU microseconds per request by process/class",
               "flows": flows, "forward_over_empty_rate": ratio,
               "empty_over_forward_cpu": busy["empty"] / busy["forward"]},
              open(out, "w"), indent=2)
    print(f"profile-forwards: wrote {out}")


def counts_share(counts, proc):
    total = sum(counts.values())
    return sum(n for (p, _), n in counts.items() if p == proc) / total if total else 0.0


if __name__ == "__main__":
    main()
