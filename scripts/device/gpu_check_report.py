#!/usr/bin/env python3
"""Writes cuda-stage2.json for scripts/device/gpu-check.sh from what its steps left so far.

gpu-check.sh runs this after every step, so the JSON always holds everything that has run: a run
cut off by its time limit still returns its results. Reads the work folder (logs, the benchmark
JSONs, steps.tsv) and never fails on a missing or half-written file: what is absent is null.

    gpu_check_report.py WORK_DIR OUT_JSON [--final]
"""
import datetime
import glob
import json
import os
import re
import sys

# gtest's per-test result lines carry the time; the summary at the end repeats the names without.
RESULT = re.compile(r"^\[ +(OK|FAILED|SKIPPED) +\] (\S+?)(?:,.*)? \(\d+ ms\)$")
RUN = re.compile(r"^\[ RUN +\] (\S+)")


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def load_json(path):
    text = read(path)
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        # The demo prints one JSON line after its progress: take the last line that parses.
        for line in reversed(text.strip().splitlines()):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def gtest_counts(path, rc=None):
    """Passed/failed/skipped from a gtest text log. A test that started and never finished (a
    crash, an abort, the step's timeout) counts as failed, named in `unfinished`."""
    text = read(path)
    if text is None:
        return None
    out = {"passed": 0, "failed": 0, "skipped": 0, "failed_tests": [], "skip_reason": None,
           "unfinished": None, "rc": rc, "redrawn": 0}
    running = None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("[ redrawn  ]"):  # the parity harness drew a module case again
            out["redrawn"] += 1
            continue
        m = RUN.match(line)
        if m:
            running = m.group(1)
            continue
        m = RESULT.match(line)
        if m:
            kind, name = m.groups()
            running = None
            if kind == "OK":
                out["passed"] += 1
            elif kind == "FAILED":
                out["failed"] += 1
                if len(out["failed_tests"]) < 40:
                    out["failed_tests"].append(name)
            else:
                out["skipped"] += 1
            continue
        if out["skip_reason"] is None and line.endswith(": Skipped") and i + 1 < len(lines):
            out["skip_reason"] = lines[i + 1].strip()[:300]
    if running is not None:
        out["failed"] += 1
        out["unfinished"] = running
        out["failed_tests"].append(running + " (did not finish)")
    elif rc not in (None, 0) and out["failed"] == 0:
        # Exited badly without a failed test: before the first test, or in teardown.
        out["failed"] += 1
        out["failed_tests"].append(f"(exit status {rc} outside any test)")
    return out


def rc_of(work, name):
    text = read(os.path.join(work, name + ".rc"))
    try:
        return int(text.strip()) if text else None
    except ValueError:
        return None


def steps(work):
    rows = []
    for line in (read(os.path.join(work, "steps.tsv")) or "").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3:
            rows.append({"step": parts[0], "status": parts[1], "seconds": float(parts[2]),
                         "note": parts[3] if len(parts) > 3 else ""})
    return rows


def number(text):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def kv_file(path, numbers=False):
    out = {}
    for line in (read(path) or "").splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = number(v.strip()) if numbers else v.strip()
    return out


def machine(work):
    info = kv_file(os.path.join(work, "machine.txt"))
    gpu = None
    text = read(os.path.join(work, "gpu.csv"))
    if text:
        lines = [l for l in text.strip().splitlines() if l.strip()]
        if len(lines) >= 2:
            keys = [k.strip() for k in lines[0].split(",")]
            vals = [v.strip() for v in lines[1].split(",")]
            gpu = dict(zip(keys, vals))
    torch = kv_file(os.path.join(work, "torch.txt"))
    return info, gpu, torch


def demo(work):
    out = {}
    for model in ("linear", "mlp"):
        row = {}
        for device in ("cpu", "cuda"):
            j = load_json(os.path.join(work, f"demo-{model}-{device}.json"))
            row[device] = j.get("final_loss") if isinstance(j, dict) else None
            if isinstance(j, dict):
                row[device + "_initial"] = j.get("initial_loss")
                row[device + "_steps_per_s"] = j.get("steps_per_s")
        out[model] = row
    return out


WIRE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "fp8": 1, "e4m3": 1, "e5m2": 1}


def server_step(work, name="server-step"):
    j = load_json(os.path.join(work, name + ".json"))
    if not isinstance(j, dict):
        return None
    runs = {r.get("mode"): r for r in j.get("runs", [])}
    remote = runs.get("remote") or runs.get("remote-shm")  # the latter: --shared-memory
    local, empty = runs.get("in-process"), runs.get("empty-rpc")
    rows, fin, fout = j.get("rows", 0), j.get("in_features", 0), j.get("out_features", 0)
    out = {
        "rows": rows, "in_features": fin, "out_features": fout, "wire_dtype": j.get("wire_dtype"),
        "transport": "shared memory" if "remote-shm" in runs else "grpc",
        "remote_steps_per_s": remote and remote.get("requests_per_s"),
        "inprocess_steps_per_s": local and local.get("requests_per_s"),
        "empty_rpc_per_s": empty and empty.get("requests_per_s"),
        "remote_p50_ms": remote and remote["latency"]["p50_ms"],
        "inprocess_p50_ms": local and local["latency"]["p50_ms"],
        "remote_server_compute_ms_mean": remote and remote.get("server_compute_ms_mean"),
        "remote_codes": remote and remote.get("codes"),
        # Both ways: input and grad_output to the server, output and grad_input back.
        "wire_payload_bytes_per_s": remote and remote.get("payload_bytes_per_s"),
        "server_view": j.get("server_view"),
    }
    size = WIRE_BYTES.get(j.get("wire_dtype"))
    if remote and size and out["remote_steps_per_s"]:
        # What reaches the GPU through the wire per step: the input and grad_output.
        out["wire_to_gpu_bytes_per_s"] = out["remote_steps_per_s"] * rows * (fin + fout) * size
    r, l = out["remote_steps_per_s"], out["inprocess_steps_per_s"]
    out["remote_vs_inprocess"] = r / l if r and l else None
    return out


def batching(work):
    """The CUDA rows of the batched-forward bit test and the 1-row load with batching off/on."""
    rc = (read(os.path.join(work, "core-batch.rc")) or "").strip()
    out = {"bit_test_rc": int(rc) if rc.lstrip("-").isdigit() else None}
    for mode in ("off", "on"):
        j = load_json(os.path.join(work, f"batch-{mode}.json"))
        run = (j.get("runs") or [None])[0] if isinstance(j, dict) else None
        out[mode] = run and {
            "requests_per_s": run.get("requests_per_s"),
            "p50_ms": run["latency"]["p50_ms"], "p99_ms": run["latency"]["p99_ms"],
            "codes": run.get("codes"), "batch_requests": run.get("batch_requests"),
        }
    on, off = out.get("on"), out.get("off")
    if on and off and off.get("requests_per_s"):
        out["on_vs_off"] = on["requests_per_s"] / off["requests_per_s"]
    return out if any(v is not None for v in out.values()) else None


def staging(work):
    rc = (read(os.path.join(work, "staged-parity.rc")) or "").strip()
    log = read(os.path.join(work, "staged-parity.log")) or ""
    out = {
        "parity_rc": int(rc) if rc.lstrip("-").isdigit() else None,
        "parity_passed": len(re.findall(r"^\[       OK \]", log, re.M)),
        "parity_skipped": len(re.findall(r"^\[  SKIPPED \].*\(\d+ ms\)$", log, re.M)),
        "step_breakdown": load_json(os.path.join(work, "step-breakdown-staged.json")),
        "server_step": server_step(work, "server-step-staged"),
    }
    return out if any(v is not None for v in out.values()) else None


def bench(work):
    merged = load_json(os.path.join(work, "bench.json"))  # ours next to PyTorch
    ours = load_json(os.path.join(work, "ours.json"))  # ours alone, if PyTorch's side failed
    if isinstance(merged, dict):
        return merged.get("gemm", []), merged.get("modules", []), True
    if isinstance(ours, dict):
        return ours.get("gemm", []), ours.get("modules", []), False
    return [], [], False


def cuda_graphs(work):
    ours = load_json(os.path.join(work, "ours.json"))
    rows = ours.get("graphs") if isinstance(ours, dict) else None
    if not rows:
        return None
    for r in rows:
        for kind in ("", "_host"):
            eager, graph = r.get(f"eager{kind}_ms"), r.get(f"graph{kind}_ms")
            r[f"graph_saves{kind}"] = 1 - graph / eager if eager and graph is not None else None
    return rows


def target(met, detail):
    return {"met": met, "detail": detail}


def targets(parity, service, kernels, demo_rows, step, gemm, modules, with_torch):
    t = {}
    if parity is None:
        t["parity_all_pass_none_skipped"] = target(None, "not run")
    else:
        ok = parity["failed"] == 0 and parity["skipped"] == 0 and parity["passed"] > 0
        t["parity_all_pass_none_skipped"] = target(
            ok, f"{parity['passed']} passed, {parity['failed']} failed, "
                f"{parity['skipped']} skipped (a skip counts as a failure)")
    if service is None:
        t["service_all_pass_none_skipped"] = target(None, "not run")
    else:
        ok = service["failed"] == 0 and service["skipped"] == 0 and service["passed"] > 0
        t["service_all_pass_none_skipped"] = target(
            ok, f"{service['passed']} passed, {service['failed']} failed, "
                f"{service['skipped']} skipped")
    # The kernel tests: every binary ran, and none failed or skipped (a skip there means no GPU
    # or the wrong architecture).
    if not kernels:
        t["kernel_tests_all_pass_none_skipped"] = target(None, "not run")
    else:
        bad = [n for n, k in kernels.items()
               if k["rc"] != 0 or k["failed"] or k["skipped"] or not k["passed"]]
        t["kernel_tests_all_pass_none_skipped"] = target(
            not bad, ", ".join(f"{n} {k['passed']} passed, {k['failed']} failed, "
                               f"{k['skipped']} skipped, rc {k['rc']}" for n, k in kernels.items()))
    verdicts, details = [], []
    for model, row in demo_rows.items():
        cpu, gpu = row.get("cpu"), row.get("cuda")
        if cpu is None or gpu is None:
            verdicts.append(None if cpu is None and gpu is None else False)
            details.append(f"{model}: cpu {cpu} cuda {gpu}")
            continue
        ok = abs(gpu - cpu) <= 0.05 * abs(cpu)
        verdicts.append(ok)
        details.append(f"{model}: cpu {cpu:.5f} cuda {gpu:.5f} ({100 * (gpu - cpu) / cpu:+.1f}%)")
    met = None if all(v is None for v in verdicts) else all(v is True for v in verdicts)
    t["demo_within_5pct"] = target(met, "; ".join(details))
    if not gemm or not with_torch:
        t["gemm_ge_1x_scaled_mm_every_shape"] = target(
            None, "no PyTorch side" if gemm else "not run")
    else:
        ratios = [(f"{g['m']}x{g['n']}x{g['k']}", g.get("ours_vs_scaled_mm")) for g in gemm]
        met = all(r is not None and r >= 1.0 for _, r in ratios)
        t["gemm_ge_1x_scaled_mm_every_shape"] = target(
            met, ", ".join(f"{s} {r:.2f}x" if r is not None else f"{s} ?" for s, r in ratios))
    if not step or step.get("remote_vs_inprocess") is None:
        t["server_step_ge_0.85_inprocess"] = target(None, "not run" if not step else "incomplete")
    else:
        r = step["remote_vs_inprocess"]
        t["server_step_ge_0.85_inprocess"] = target(
            r >= 0.85, f"{step['remote_steps_per_s']:.3f} / {step['inprocess_steps_per_s']:.3f} "
                       f"steps/s = {r:.3f}")
    # The module-step targets belong to the GPU fast-path work; recorded as they stand.
    # linear_bf16: the same Linear with bf16 activations and gradients in and out, as the fast
    # path moves them (gradwire-cuda-bench composes it; the server casts bf16 in, but its GEMMs
    # still write fp32 y and dx).
    for name, want in (("linear", 1.7), ("linear_bf16", 1.7), ("layernorm_mlp", 1.6)):
        row = next((m for m in modules if m.get("name") == name), None)
        key = f"{name}_step_ge_{want}x_bf16 (fast-path work, recorded only)"
        if row is None or "speedup_step" not in row:
            t[key] = target(None, "not run" if row is None else "no PyTorch side")
        else:
            t[key] = target(row["speedup_step"] >= want, f"{row['speedup_step']:.2f}x")
    return t


def main():
    work, out_path = sys.argv[1], sys.argv[2]
    final = "--final" in sys.argv[3:]
    info, gpu, torch = machine(work)
    parity = gtest_counts(os.path.join(work, "parity.log"), rc_of(work, "parity"))
    suites = {}
    for log in sorted(glob.glob(os.path.join(work, "svc-*.log"))):
        name = os.path.basename(log)[4:-4]
        suites[name] = gtest_counts(log, rc_of(work, "svc-" + name))
    service = None
    if suites:
        service = {k: sum(s[k] for s in suites.values()) for k in ("passed", "failed", "skipped")}
        service["failed_tests"] = [f"{n}: {t}" for n, s in suites.items()
                                   for t in s["failed_tests"]][:60]
        service["suites"] = {n: {k: s[k] for k in ("passed", "failed", "skipped", "rc")}
                             for n, s in suites.items()}
        reasons = [s["skip_reason"] for s in suites.values() if s["skip_reason"]]
        service["skip_reason"] = reasons[0] if reasons else None
    kernels = {}
    for log in sorted(glob.glob(os.path.join(work, "kt-*.log"))):
        name = os.path.basename(log)[3:-4]
        c = gtest_counts(log, rc_of(work, "kt-" + name))
        kernels[name] = {k: c[k] for k in ("passed", "failed", "skipped", "rc", "failed_tests",
                                           "skip_reason")}
    demo_rows = demo(work)
    step = server_step(work)
    gemm, modules, with_torch = bench(work)
    build = kv_file(os.path.join(work, "build.txt"), numbers=True)
    for key in ("built", "missing"):
        if isinstance(build.get(key), str):
            build[key] = build[key].split()
    started = info.get("started_epoch")
    now = datetime.datetime.now(datetime.timezone.utc)
    report = {
        "command": "scripts/device/gpu-check.sh",
        # GW_CHECK_STEPS: a first call's steps, a second call's, or a choice.
        "steps_asked": info.get("steps_asked"),
        "complete": final,
        "updated": now.isoformat(timespec="seconds"),
        "elapsed_s": round(now.timestamp() - float(started), 1) if started else None,
        "device": gpu.get("name") if gpu else None,
        "driver": gpu.get("driver_version") if gpu else None,
        "cuda": info.get("nvcc"),
        "torch": torch.get("torch"),
        "torch_cuda": torch.get("cuda"),
        "machine": {
            "hostname": info.get("hostname"),
            "cpu": info.get("cpu"),
            "cores": number(info["cores"]) if "cores" in info else None,
            "memory_gib": number(info["memory_gib"]) if "memory_gib" in info else None,
            "os": info.get("os"),
            "gpu": gpu,
            "torch_cuda_available": torch.get("available"),
            "torch_cxx11_abi": torch.get("cxx11_abi"),
            "no_gpu_reason": info.get("no_gpu"),
            "commit": info.get("commit"),
            "uncommitted_changes": info.get("tree_changes"),
            # Files that differ from the tree deps.sh hashed at that commit (0: the commit ran).
            "files_changed_since_deps": info.get("files_changed_since_deps"),
        },
        "build": build or None,
        "parity": parity and {k: parity[k] for k in ("passed", "failed", "skipped", "redrawn",
                                                      "rc", "failed_tests", "skip_reason",
                                                      "unfinished")},
        # Only after a parity failure: the same rows with GRADWIRE_CUDA_COPY_STREAM=0.
        "parity_one_stream": gtest_counts(os.path.join(work, "parity-one-stream.log"),
                                          rc_of(work, "parity-one-stream")),
        "service": service,
        "kernel_tests": kernels or None,
        "demo": demo_rows,
        "server_step": step,
        # The same step with FP8 on the wire (not a target: what the wire format is worth).
        "server_step_fp8_wire": server_step(work, "server-step-fp8"),
        # With bf16 on the wire (half the bytes; the input reaches the cast as bf16).
        "server_step_bf16_wire": server_step(work, "server-step-bf16"),
        # The f32 step with the tensors through shared memory (a client on the server's host).
        "server_step_shared_memory": server_step(work, "server-step-shm"),
        # Host<->GPU copies of one step tensor, pageable and pinned (scripts/device/host_copies.py).
        "host_copies": load_json(os.path.join(work, "host-copies.json")),
        # ModuleHost's step on the GPU next to its GEMMs and wire crossings (step_breakdown).
        "step_breakdown": load_json(os.path.join(work, "step-breakdown.json")),
        # The same with the wire copies on the compute stream (GRADWIRE_CUDA_COPY_STREAM=0).
        "step_breakdown_one_stream": load_json(os.path.join(work, "step-breakdown-one-stream.json")),
        "batching": batching(work),
        # Pinned staging (--cuda-staging-mib): parity through 1 MiB slots, then 8 MiB slots.
        "staging": staging(work),
        "gemm": gemm,
        "modules": modules,
        # A fixed-shape Linear step as one CUDA graph against its kernels launched one by one.
        "cuda_graphs": cuda_graphs(work),
        "targets": targets(parity, service, kernels, demo_rows, step, gemm, modules, with_torch),
        "steps": steps(work),
    }
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    os.replace(tmp, out_path)  # a reader (or a cut-off run) never sees half a file
    if "--print" in sys.argv[3:]:
        for name, t in report["targets"].items():
            verdict = {True: "MET", False: "NOT MET", None: "not run"}[t["met"]]
            print(f"  {verdict:8} {name}: {t['detail']}")


if __name__ == "__main__":
    main()
