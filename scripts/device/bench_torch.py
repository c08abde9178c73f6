#!/usr/bin/env python3
"""The PyTorch side of scripts/device/stage1.sh.

Reads the C++ benchmark's JSON (--ours), times the same shapes with torch._scaled_mm (FP8,
fast accumulation, bf16 out) and bf16 torch.matmul, and the same module steps with bf16 PyTorch
autograd, then prints one table and writes one JSON (--json) with both sides and their ratios.
Times are CUDA-event averages after warm-up.
"""
import argparse
import json

import torch


def time_ms(fn, warmup=3, iters=20):
    for _ in range(warmup):
        fn()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / iters


def gemm_rows(shapes, iters):
    rows = []
    one = torch.tensor(1.0, device="cuda")
    for s in shapes:
        m, n, k = s["m"], s["n"], s["k"]
        a16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a8 = a16.to(torch.float8_e4m3fn)
        b8 = b16.to(torch.float8_e4m3fn)
        flops = 2.0 * m * n * k

        def scaled():
            # b8.t() is column-major [k, n]: the TN layout FP8 tensor cores take.
            return torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                    out_dtype=torch.bfloat16, use_fast_accum=True)

        ms_fp8 = time_ms(scaled, iters=iters)
        ms_bf16 = time_ms(lambda: a16 @ b16.t(), iters=iters)
        rows.append({
            "m": m, "n": n, "k": k,
            "ours_ms": s["ms"], "ours_tflops": s["tflops"],
            "scaled_mm_ms": ms_fp8, "scaled_mm_tflops": flops / ms_fp8 / 1e9,
            "bf16_ms": ms_bf16, "bf16_tflops": flops / ms_bf16 / 1e9,
        })
        rows[-1]["ours_vs_scaled_mm"] = rows[-1]["ours_tflops"] / rows[-1]["scaled_mm_tflops"]
        rows[-1]["ours_vs_bf16"] = rows[-1]["ours_tflops"] / rows[-1]["bf16_tflops"]
        del a16, b16, a8, b8
        torch.cuda.empty_cache()
    return rows


def module_for(row):
    h, ffn = row["hidden"], row["ffn"]
    if row["name"] in ("linear", "linear_bf16"):  # the same bf16 module for both of ours
        return torch.nn.Linear(h, h, bias=False)
    return torch.nn.Sequential(torch.nn.LayerNorm(h), torch.nn.Linear(h, ffn),
                               torch.nn.GELU(approximate="tanh"), torch.nn.Linear(ffn, h))


def module_rows(modules, iters):
    rows = []
    for r in modules:
        mod = module_for(r).to(device="cuda", dtype=torch.bfloat16)
        x = torch.randn(r["tokens"], r["hidden"], device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        g = torch.randn(r["tokens"], r["hidden"], device="cuda", dtype=torch.bfloat16)

        def fwd():
            return mod(x)

        def step():
            mod(x).backward(g)

        fwd_ms = time_ms(fwd, iters=iters)
        step_ms = time_ms(step, iters=iters)
        out = dict(r)
        out.update({
            "ours_fwd_ms": r["fwd_ms"], "ours_bwd_ms": r["bwd_ms"], "ours_step_ms": r["step_ms"],
            "torch_bf16_fwd_ms": fwd_ms, "torch_bf16_step_ms": step_ms,
            "torch_bf16_bwd_ms": step_ms - fwd_ms,
            "speedup_step": step_ms / r["step_ms"],
        })
        for key in ("fwd_ms", "bwd_ms", "step_ms"):
            out.pop(key)
        rows.append(out)
        del mod, x, g
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ours", required=True, help="JSON written by gradwire-cuda-bench")
    parser.add_argument("--json", required=True, help="where to write the merged JSON")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    with open(args.ours) as f:
        ours = json.load(f)
    gemms = gemm_rows(ours["gemm"], args.iters)
    modules = module_rows(ours["modules"], args.iters)
    merged = {"device": ours["device"], "torch": torch.__version__,
              "torch_device": torch.cuda.get_device_name(0), "gemm": gemms, "modules": modules}
    with open(args.json, "w") as f:
        json.dump(merged, f, indent=2)

    print(f"device: {ours['device']}  torch {torch.__version__}\n")
    print(f"{'M':>6} {'N':>6} {'K':>6} | {'ours TF/s':>10} {'_scaled_mm':>10} {'bf16 mm':>10} |"
          f" {'ours/fp8':>8} {'ours/bf16':>9}")
    for r in gemms:
        print(f"{r['m']:>6} {r['n']:>6} {r['k']:>6} | {r['ours_tflops']:>10.1f} "
              f"{r['scaled_mm_tflops']:>10.1f} {r['bf16_tflops']:>10.1f} | "
              f"{r['ours_vs_scaled_mm']:>8.2f} {r['ours_vs_bf16']:>9.2f}")
    print(f"\n{'module':<14} {'tokens':>6} {'hidden':>6} {'ffn':>6} | {'ours fwd':>8} "
          f"{'ours step':>9} | {'bf16 fwd':>8} {'bf16 step':>9} | {'speedup':>7}  (ms)")
    for r in modules:
        print(f"{r['name']:<14} {r['tokens']:>6} {r['hidden']:>6} {r['ffn']:>6} | "
              f"{r['ours_fwd_ms']:>8.3f} {r['ours_step_ms']:>9.3f} | "
              f"{r['torch_bf16_fwd_ms']:>8.3f} {r['torch_bf16_step_ms']:>9.3f} | "
              f"{r['speedup_step']:>7.2f}")


if __name__ == "__main__":
    main()
