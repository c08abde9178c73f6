"""Same-host shared memory against the wire, side by side on one server: the Python client's
Linear 1024 -> 1024 training step (forward + backward) with shared_memory="auto" and "off",
interleaved round by round, at each --rows; then gradwire-load's step with --shared-memory on and
off, interleaved the same way. Prints a table and writes JSON with the machine.

  python3 tests/bench/shm_ab.py --server HOST:PORT --load build/client/gradwire-load \\
      --rows 256,4096 --seconds 5 --rounds 3 --json docs/perf/shm-ab.json
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "client", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "lib"))
from gradwire import Client  # noqa: E402
from gradwire.v1 import module_pb2  # noqa: E402
from machine import describe  # noqa: E402


def python_rates(server, rows, seconds, rounds):
    clients = {"shared memory": Client(server, timeout=120),
               "wire": Client(server, timeout=120, shared_memory="off")}
    spec = module_pb2.ModuleSpec(kind=module_pb2.LINEAR, in_features=1024, out_features=1024,
                                 bias=True, seed=1)
    module_id = clients["shared memory"].create_module(spec).module_id
    clients["wire"]._modules[module_id] = spec
    x, g = torch.randn(rows, 1024), torch.randn(rows, 1024)
    done = {k: [0, 0.0] for k in clients}
    for _ in range(rounds):
        for name, c in clients.items():
            def step():
                _, ctx, _ = c.forward(module_id, x, True)
                c.backward(ctx, g)
            step()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                step()
                n += 1
            done[name][0] += n
            done[name][1] += time.perf_counter() - t0
    used = clients["shared memory"].shared_memory_calls
    clients["shared memory"].delete_module(module_id)
    for c in clients.values():
        c.close()
    if used == 0:
        raise SystemExit("shm_ab: the client did not use shared memory (not on the server's host?)")
    return {k: n / t for k, (n, t) in done.items()}


def load_rates(load, server, rows, seconds, rounds):
    done = {"on": [0, 0.0], "off": [0, 0.0]}
    for _ in range(rounds):
        for mode in done:
            out = subprocess.run(
                [load, "--server", server, "--kind", "linear", "--in", "1024", "--out", "1024",
                 "--rows", str(rows), "--flow", "step", "--warmup", "1", "--duration",
                 str(seconds), "--shared-memory", mode, "--json", "-"],
                check=True, capture_output=True, text=True).stdout
            report = json.loads(out[out.index("{"):])
            run = [r for r in report["runs"] if r["mode"].startswith("remote")][0]
            done[mode][0] += run["requests"]
            done[mode][1] += run["seconds"]
    return {("shared memory" if k == "on" else "wire"): n / t for k, (n, t) in done.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--load", default="build/client/gradwire-load")
    p.add_argument("--rows", default="256,4096")
    p.add_argument("--seconds", type=float, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args()
    cases = []
    print(f"{'client':<8} {'rows':>6} {'shm steps/s':>12} {'wire steps/s':>13} {'shm / wire':>11}")
    for rows in (int(r) for r in a.rows.split(",")):
        for client, rates in (("python", python_rates(a.server, rows, a.seconds, a.rounds)),
                              ("c++", load_rates(a.load, a.server, rows, a.seconds, a.rounds))):
            ratio = rates["shared memory"] / rates["wire"]
            cases.append({"client": client, "rows": rows, "in": 1024, "out": 1024,
                          "shm_steps_per_s": rates["shared memory"],
                          "wire_steps_per_s": rates["wire"], "shm_vs_wire": ratio})
            print(f"{client:<8} {rows:>6} {rates['shared memory']:>12.2f} "
                  f"{rates['wire']:>13.2f} {ratio:>11.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": describe(allocator="glibc"), "command": " ".join(sys.argv),
                       "unit": "training steps per second (forward + backward), Linear "
                               "1024 -> 1024, one client, rounds interleaved",
                       "cases": cases}, f, indent=2)
        print(f"shm_ab: wrote {a.json}")


if __name__ == "__main__":
    main()
