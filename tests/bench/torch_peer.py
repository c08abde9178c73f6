#!/usr/bin/env python3
"""The PyTorch peers of gradwire's CPU step benchmark (scripts/bench-cpu.sh).

For each case (Linear IN->OUT at several row counts, LayerNormMLP IN/FFN), times a training step
(forward, then backward of a random gradient) in fp32:

  local   the module in this process (what a PyTorch user has without any server)
  rpc     the module in a second process on loopback, called through torch.distributed.rpc with
          dist_autograd (the PyTorch way to run a layer remotely), one step at a time

Prints a table and writes JSON (--json). Run it with the BLAS the comparison names (OpenBLAS:
Debian's libopenblas0-pthread, which scripts/install-deps.sh installs).
"""
import argparse
import json
import os
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp


def make_module(kind, d_in, d_out, ffn):
    torch.manual_seed(0)
    if kind == "linear":
        return torch.nn.Linear(d_in, d_out)
    return torch.nn.Sequential(torch.nn.LayerNorm(d_in), torch.nn.Linear(d_in, ffn),
                               torch.nn.GELU(approximate="tanh"), torch.nn.Linear(ffn, d_out))


def timed(step, duration, warmup=2):
    for _ in range(warmup):
        step()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < duration:
        step()
        n += 1
    return n / (time.perf_counter() - start)


# --- the rpc server side -----------------------------------------------------------------------
_MODULES = {}


def _create(key, kind, d_in, d_out, ffn):
    _MODULES[key] = make_module(kind, d_in, d_out, ffn)


def _forward(key, x):
    return _MODULES[key](x)


def _serve(rank, port, threads):
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc("server", rank=rank, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}"))
    rpc.shutdown()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="linear:1024:1024:0:16,linear:1024:1024:0:256,"
                   "linear:1024:1024:0:4096,mlp:1024:1024:4096:256",
                   help="comma-separated kind:in:out:ffn:rows")
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds per case and mode")
    p.add_argument("--threads", type=int, default=torch.get_num_threads() or 1,
                   help="intra-op threads of each process")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    server = mp.get_context("spawn").Process(target=_serve, args=(1, args.port, args.threads))
    server.start()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    rpc.init_rpc("client", rank=0, world_size=2,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{args.port}"))
    rows_out = []
    try:
        for i, case in enumerate(args.cases.split(",")):
            kind, d_in, d_out, ffn, rows = case.split(":")
            d_in, d_out, ffn, rows = int(d_in), int(d_out), int(ffn), int(rows)
            # The input needs its gradient, as a layer inside a model does (gradwire returns grad_input).
            x = torch.randn(rows, d_in, requires_grad=True)
            g = torch.randn(rows, d_out)
            local = make_module(kind, d_in, d_out, ffn)

            def local_step():
                local(x).backward(g)

            key = f"m{i}"
            rpc.rpc_sync("server", _create, args=(key, kind, d_in, d_out, ffn))

            def rpc_step():
                with dist_autograd.context() as ctx:
                    y = rpc.rpc_sync("server", _forward, args=(key, x))
                    dist_autograd.backward(ctx, [(y * g).sum()])

            local_sps = timed(local_step, args.duration)
            rpc_sps = timed(rpc_step, args.duration)
            row = {"kind": kind, "in": d_in, "out": d_out, "ffn": ffn, "rows": rows,
                   "local_steps_per_s": local_sps, "local_step_ms": 1e3 / local_sps,
                   "rpc_steps_per_s": rpc_sps, "rpc_step_ms": 1e3 / rpc_sps}
            rows_out.append(row)
            print(f"{kind:<7} {d_in}->{d_out} ffn {ffn:<5} rows {rows:<5} | local {local_sps:8.2f} "
                  f"steps/s ({1e3 / local_sps:8.2f} ms) | torch.rpc {rpc_sps:8.2f} steps/s "
                  f"({1e3 / rpc_sps:8.2f} ms)", flush=True)
    finally:
        rpc.shutdown()
        server.join()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "threads": args.threads,
                       "blas": "see torch.__config__.show()", "cases": rows_out}, f, indent=2)


if __name__ == "__main__":
    main()
