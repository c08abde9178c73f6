#!/usr/bin/env python3
"""The bits check of scripts/bench-link.sh --check: each wire form gives, across the network
link, exactly the results it gives over loopback.

  link_check.py reference --server 127.0.0.1:PORT --dir D --forms f32,fp8   (next to the server)
  link_check.py compare   --server LINK_ADDR:PORT --dir D --forms f32,fp8   (across the link)

`reference` creates the modules (seeded), draws the inputs and output gradients, and for each
form runs an inference forward and a training step (forward, backward) through a client with
that wire form over loopback without shared memory; it saves modules, inputs and results in D.
`compare` runs the same calls on the same modules through a client across the link (the
client's defaults otherwise, so it asks for shared memory and must be refused) and checks:
  - every output and grad_input equals the reference bit for bit;
  - no call went through shared memory;
  - a form in EQUALS_F32 gives f32's bits; a lossy form gives other bits than f32 (so the form
    really was on the wire).
Prints one "ok"/"FAIL" line per check and exits 1 when any failed. Needs PYTHONPATH=client/python.
"""
import argparse
import sys

import torch
from gradwire import Client
from gradwire.v1 import module_pb2

CASES = [("linear", 1024, 1024, 0, 16), ("linear", 1024, 1024, 0, 256), ("mlp", 1024, 1024, 4096, 16)]
# Forms that must change no result: their bits are f32's. The others are lossy by design.
EQUALS_F32 = {"f32", "exact"}


def spec(kind, d_in, d_out, ffn):
    return module_pb2.ModuleSpec(
        kind=module_pb2.LINEAR if kind == "linear" else module_pb2.LAYERNORM_MLP,
        in_features=d_in, out_features=d_out, ffn_features=ffn, bias=True, seed=7)


def run(client, module_id, x, g):
    """(inference output, training output, grad_input) of one case through ``client``."""
    y_inf, _, _ = client.forward(module_id, x, False)
    y, ctx, _ = client.forward(module_id, x, True)
    gx = client.backward(ctx, g)
    return [y_inf, y, gx]


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("reference", "compare"))
    p.add_argument("--server", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--forms", default="f32,fp8")
    args = p.parse_args()
    forms = args.forms.split(",")
    state_file = f"{args.dir}/reference.pt"

    if args.mode == "reference":
        admin = Client(args.server, timeout=120, shared_memory="off")
        gen = torch.Generator().manual_seed(3)
        cases = []
        for kind, d_in, d_out, ffn, rows in CASES:
            module_id = admin.create_module(spec(kind, d_in, d_out, ffn)).module_id
            x = torch.randn(rows, d_in, generator=gen)
            g = torch.randn(rows, d_out, generator=gen)
            results = {}
            for form in forms:
                c = Client(args.server, timeout=120, wire_dtype=form, shared_memory="off")
                results[form] = run(c, module_id, x, g)
                c.close()
            cases.append({"case": (kind, d_in, d_out, ffn, rows), "module_id": module_id,
                          "x": x, "g": g, "results": results})
        torch.save(cases, state_file)
        print(f"link_check: reference of {len(cases)} cases x {len(forms)} forms over loopback")
        return

    cases = torch.load(state_file)
    failed = 0

    def check(name, ok):
        nonlocal failed
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
        failed += 0 if ok else 1

    for form in forms:
        # The client's defaults (shared memory "auto"), in plaintext on the script's own link.
        c = Client(args.server, timeout=120, wire_dtype=form, insecure=True)
        for case in cases:
            kind, d_in, d_out, ffn, rows = case["case"]
            name = f"{form}: {kind} {d_in}->{d_out}" + (f"/{ffn}" if ffn else "") + f" x{rows}"
            got = run(c, case["module_id"], case["x"], case["g"])
            ref = case["results"][form]
            check(f"{name}: output, training output and grad_input across the link = loopback, "
                  "bit for bit", all(same_bits(a, b) for a, b in zip(got, ref)))
            if "f32" in case["results"] and form != "f32":
                f32 = case["results"]["f32"]
                equal = all(same_bits(a, b) for a, b in zip(got, f32))
                if form in EQUALS_F32:
                    check(f"{name}: the f32 wire's bits", equal)
                else:
                    check(f"{name}: lossy, other bits than the f32 wire", not equal)
        check(f"{form}: no call went through shared memory across the link",
              c.shared_memory_calls == 0)
        c.close()
    admin = Client(args.server, timeout=120, insecure=True)
    for case in cases:
        admin.delete_module(case["module_id"])
    admin.close()
    print(f"link_check: {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
