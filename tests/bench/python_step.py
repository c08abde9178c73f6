#!/usr/bin/env python3
"""Training steps per second through gradwire's Python client (scripts/bench-cpu.sh).

Creates a module on a running gradwire-server, then repeats forward(training=True) and backward
of a random gradient for --duration seconds; prints one line and appends a JSON object to --json.
Needs PYTHONPATH=client/python.
"""
import argparse
import json
import time

import torch
from gradwire import Client
from gradwire.v1 import module_pb2


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--server", required=True)
    p.add_argument("--cases", default="linear:1024:1024:0:16,linear:1024:1024:0:256,"
                   "linear:1024:1024:0:4096,mlp:1024:1024:4096:256",
                   help="comma-separated kind:in:out:ffn:rows")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--json")
    args = p.parse_args()
    client = Client(args.server, timeout=120)
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

        for _ in range(2):
            step()
        shm_before = client.shared_memory_calls
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.duration:
            step()
            n += 1
        sps = n / (time.perf_counter() - start)
        client.delete_module(module_id)
        results.append({"kind": kind, "in": int(d_in), "out": int(d_out), "ffn": int(ffn),
                        "rows": int(rows), "python_steps_per_s": sps, "python_step_ms": 1e3 / sps,
                        # the client's default: shared memory by itself on the server's host
                        "path": ("shared memory" if client.shared_memory_calls > shm_before
                                 else "gRPC")})
        print(f"{kind:<7} {d_in}->{d_out} ffn {ffn:<5} rows {rows:<5} | python client "
              f"{sps:8.2f} steps/s ({1e3 / sps:8.2f} ms)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": results}, f, indent=2)


if __name__ == "__main__":
    main()
