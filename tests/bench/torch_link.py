#!/usr/bin/env python3
"""The torch.distributed.rpc peer of scripts/bench-link.sh: the same modules and step as
tests/bench/torch_peer.py, but with the two processes on either side of a network link, and
TensorPipe held to TCP.

  torch_link.py --role server --addr SERVER_IP --ifname DEV     (in the server's namespace)
  torch_link.py --role client --addr SERVER_IP --ifname DEV --link-dev DEV --cases ... --json F

The server is rank 0 (it hosts the rendezvous at SERVER_IP:PORT); the client is rank 1. Both
limit TensorPipe to its `uv` transport (TCP) and `basic` channel, so no shared memory and no
cross-memory attach: every byte crosses the link. TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME = DEV
make each side listen on its own end of the link. A step is a forward through rpc_sync, then dist_autograd's backward
of (y * g).sum(): the client sends the full output gradient g, the server returns grad_input.
--link-dev counts the bytes that interface moved (sent + received) over the measured steps.
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from torch_peer import make_module

_MODULES = {}


def _create(key, kind, d_in, d_out, ffn):
    _MODULES[key] = make_module(kind, d_in, d_out, ffn)


def _drop(key):
    _MODULES.pop(key, None)


def _forward(key, x):
    return _MODULES[key](x)


def link_bytes(dev):
    if not dev:
        return None
    stats = Path("/sys/class/net") / dev / "statistics"
    return sum(int((stats / f).read_text()) for f in ("tx_bytes", "rx_bytes"))


def options(addr, port):
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{addr}:{port}",
                                           _transports=["uv"], _channels=["basic"],
                                           rpc_timeout=600)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("server", "client"), required=True)
    p.add_argument("--addr", required=True, help="the server's address (rendezvous and rank 0)")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--ifname", required=True, help="the interface TensorPipe listens on")
    p.add_argument("--cases", default="linear:1024:1024:0:16", help="comma-separated kind:in:out:ffn:rows")
    p.add_argument("--duration", type=float, default=3.0, help="measured seconds per case")
    p.add_argument("--min-steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="intra-op threads")
    p.add_argument("--link-dev", help="count this interface's bytes over the measured steps")
    p.add_argument("--json")
    args = p.parse_args()
    # TensorPipe's listener and the Gloo group init_rpc makes: on this end of the link (Gloo
    # would otherwise take the address the host name resolves to, loopback here).
    os.environ["TP_SOCKET_IFNAME"] = args.ifname
    os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    torch.set_num_threads(args.threads)
    if args.role == "server":
        rpc.init_rpc("server", rank=0, world_size=2, rpc_backend_options=options(args.addr, args.port))
        rpc.shutdown()  # returns once the client has shut down too
        return

    rpc.init_rpc("client", rank=1, world_size=2, rpc_backend_options=options(args.addr, args.port))
    rows_out = []
    try:
        for i, case in enumerate(args.cases.split(",")):
            kind, d_in, d_out, ffn, rows = case.split(":")
            d_in, d_out, ffn, rows = int(d_in), int(d_out), int(ffn), int(rows)
            torch.manual_seed(1)
            x = torch.randn(rows, d_in, requires_grad=True)
            g = torch.randn(rows, d_out)
            key = f"m{i}"
            rpc.rpc_sync("server", _create, args=(key, kind, d_in, d_out, ffn))

            def step():
                with dist_autograd.context() as ctx:
                    y = rpc.rpc_sync("server", _forward, args=(key, x))
                    dist_autograd.backward(ctx, [(y * g).sum()])

            for _ in range(args.warmup):
                step()
            before = link_bytes(args.link_dev)
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < args.duration or n < args.min_steps:
                step()
                n += 1
            sps = n / (time.perf_counter() - start)
            after = link_bytes(args.link_dev)
            rpc.rpc_sync("server", _drop, args=(key,))
            row = {"kind": kind, "in": d_in, "out": d_out, "ffn": ffn, "rows": rows, "steps": n,
                   "rpc_steps_per_s": sps, "rpc_step_ms": 1e3 / sps}
            if before is not None:
                row["link_bytes_per_step"] = (after - before) / n
            rows_out.append(row)
            print(f"{kind:<7} {d_in}->{d_out} ffn {ffn:<5} rows {rows:<5} | torch.rpc (uv) "
                  f"{sps:8.2f} steps/s ({1e3 / sps:8.2f} ms)", flush=True)
    finally:
        rpc.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": args.threads,
                       "transports": ["uv"], "channels": ["basic"], "cases": rows_out}, f, indent=2)


if __name__ == "__main__":
    main()
