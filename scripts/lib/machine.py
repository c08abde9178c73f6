#!/usr/bin/env python3
"""What a benchmark ran on, as one JSON object: every benchmark JSON of this project embeds it,
because a figure holds only on the machine that produced it.

  python3 scripts/lib/machine.py [--allocator NAME] [--blas NAME] [--server-describe TEXT]

Fields: cpu_model, isa (the SIMD flags that matter to the CPU loops), logical_cpus,
physical_cores, memory_gib, kernel, thp (transparent huge pages setting), blas (the library
libblas.so.3 resolves to, or what --blas says), allocator, torch, gpu (nvidia-smi's name and
driver, or null), virtualised (hypervisor flag).
"""
import argparse
import json
import os
import platform
import subprocess


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def cpu_info():
    text = read("/proc/cpuinfo")
    model, flags, cores = None, set(), set()
    physical = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and model is None:
            model = value
        elif key == "flags" and not flags:
            flags = set(value.split())
        elif key == "physical id":
            physical = value
        elif key == "core id":
            cores.add((physical, value))
    wanted = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
              "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"]
    return {
        "cpu_model": model,
        "isa": [f for f in wanted if f in flags],
        "logical_cpus": os.cpu_count(),
        "physical_cores": len(cores) or None,
        "virtualised": "hypervisor" in flags,
    }


def blas():
    for alt in ("/etc/alternatives/libblas.so.3-x86_64-linux-gnu",
                "/etc/alternatives/libblas.so.3-aarch64-linux-gnu"):
        if os.path.exists(alt):
            target = os.path.realpath(alt)
            for name in ("openblas-pthread", "openblas-openmp", "openblas-serial", "blis", "atlas",
                         "mkl"):
                if name in target:
                    return f"{name} ({target})"
            return target
    return None


def torch_version():
    try:
        out = subprocess.run(["/usr/bin/python3", "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def gpu():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def commit():
    """The checkout's short commit, marked when the tree differs from it: what a figure ran on."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    if subprocess.run(["git", "diff", "--quiet", "HEAD"]).returncode != 0:
        head += "+uncommitted changes"
    return head


def describe(allocator=None, blas_name=None, server=None):
    mem = 0
    for line in read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) / (1 << 20)
    thp = read("/sys/kernel/mm/transparent_hugepage/enabled").strip() or None
    info = cpu_info()
    info.update({
        "memory_gib": round(mem, 1),
        "kernel": platform.release(),
        "thp": thp,
        "blas": blas_name or blas(),
        "allocator": allocator,
        "torch": torch_version(),
        "gpu": gpu(),
    })
    if server:
        info["server_backend"] = server
    return info


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allocator", help="the allocator the measured processes used")
    parser.add_argument("--blas", help="the BLAS, when not libblas.so.3's")
    parser.add_argument("--server-describe", help="the server's own description of its backend")
    args = parser.parse_args()
    print(json.dumps(describe(args.allocator, args.blas, args.server_describe), indent=2))


if __name__ == "__main__":
    main()
