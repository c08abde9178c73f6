"""Host-side costs of moving one server-step tensor (Linear 4096x4096, 8192 rows: 128 MiB of f32)
between the host and the GPU, on the GPU machine: pageable and pinned copies each way, and the
cost of touching fresh host memory (page faults), which a response buffer pays when it is new.
Writes JSON (--json) and prints a table."""
import argparse
import json
import time

import torch


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    n = a.mib * 1024 * 1024 // 4
    dev = torch.randn(n, device="cuda")
    pageable = torch.randn(n)
    pinned = torch.empty(n, pin_memory=True)
    rows = {
        "h2d_pageable": timed(lambda: dev.copy_(pageable)),
        "h2d_pinned": timed(lambda: dev.copy_(pinned, non_blocking=True)),
        "d2h_pageable": timed(lambda: pageable.copy_(dev)),
        "d2h_pinned": timed(lambda: pinned.copy_(dev, non_blocking=True)),
        # a fresh host buffer each time, written once: what a new response's bytes cost
        "d2h_fresh_pageable": timed(lambda: torch.empty(n).copy_(dev)),
        "fresh_host_fill": timed(lambda: torch.empty(n).fill_(1.0)),
        "host_memcpy": timed(lambda: pageable.copy_(pinned)),
    }
    out = {"mib": a.mib, "torch": torch.__version__, "device": torch.cuda.get_device_name(0),
           "host_threads": torch.get_num_threads(), "seconds": rows,
           "gib_per_s": {k: a.mib / 1024 / v for k, v in rows.items()}}
    print(f"{'copy of %d MiB' % a.mib:24} {'ms':>8} {'GiB/s':>8}")
    for k, v in rows.items():
        print(f"{k:24} {v * 1e3:8.2f} {a.mib / 1024 / v:8.2f}")
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
