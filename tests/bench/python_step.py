#!/usr/bin/env python3
"""Training steps per second through gradwire's Python client (scripts/bench-cpu.sh,
scripts/bench-link.sh).

Creates a module on a running gradwire-server, then repeats forward(training=True) and backward
of a random gradient for --duration seconds (and at least --min-steps steps); prints one line
and writes a JSON object to --json. --wire-dtype picks the client's wire form; --link-dev NAME
also counts the bytes that network interface moved (sent + received) during the measured steps.
Needs PYTHONPATH=client/python.
"""
import argparse
import json
import time
from pathlib import Path

import torch
from gradwire import Client
from gradwire.v1 import module_pb2


def link_bytes(dev):
    """Bytes sent + received by network interface ``dev`` so far (None without one)."""
    if not dev:
        return None
    stats = Path("/sys/class/net") / dev / "statistics"
    return sum(int((stats / f).read_text()) for f in ("tx_bytes", "rx_bytes"))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--server", required=True)
    p.add_argument("--cases", default="linear:1024:1024:0:16,linear:1024:1024:0:256,"
                   "linear:1024:1024:0:4096,mlp:1024:1024:4096:256",
                   help="comma-separated kind:in:out:ffn:rows")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--min-steps", type=int, default=1, help="measure at least this many steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    p.add_argument("--wire-dtype", default="f32", help="the client's wire form (Client(wire_dtype))")
    p.add_argument("--link-dev", help="count this network interface's bytes over the measured steps")
    p.add_argument("--insecure", action="store_true",
                   help="plaintext to a server that is not on loopback (a trusted test link)")
    p.add_argument("--json")
    args = p.parse_args()
    client = Client(args.server, timeout=120, wire_dtype=args.wire_dtype, insecure=args.insecure)
    results = []
    for case in args.cases.split(","):
        kind, d_in, d_out, ffn, rows = case.split(":")
        spec = module_pb2.ModuleSpec(
            kind=module_pb2.LINEAR if kind == "linear" else module_pb2.LAYERNORM_MLP,
            in_features=int(d_in), out_features=int(d_out), ffn_features=int(ffn), bias=True,
            seed=1)
        module_id = client.create_module(spec).module_id
        x = torch.randn(int(rows), int(d_in))
        g = torch.randn(int(rows), int(d_out))

        def step():
            _, ctx, _ = client.forward(module_id, x, True)
            client.backward(ctx, g)

        for _ in range(args.warmup):
            step()
        shm_before = client.shared_memory_calls
        bytes_before = link_bytes(args.link_dev)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.duration or n < args.min_steps:
            step()
            n += 1
        sps = n / (time.perf_counter() - start)
        bytes_after = link_bytes(args.link_dev)
        client.delete_module(module_id)
        result = {"kind": kind, "in": int(d_in), "out": int(d_out), "ffn": int(ffn),
                  "rows": int(rows), "wire_dtype": args.wire_dtype, "steps": n,
                  "python_steps_per_s": sps, "python_step_ms": 1e3 / sps,
                  # the client's default: shared memory by itself on the server's host
                  "path": ("shared memory" if client.shared_memory_calls > shm_before
                           else "gRPC")}
        if bytes_before is not None:
            result["link_bytes_per_step"] = (bytes_after - bytes_before) / n
        results.append(result)
        print(f"{kind:<7} {d_in}->{d_out} ffn {ffn:<5} rows {rows:<5} | python client "
              f"{sps:8.2f} steps/s ({1e3 / sps:8.2f} ms)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": results}, f, indent=2)


if __name__ == "__main__":
    main()
