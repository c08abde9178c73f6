#!/usr/bin/env python3
"""Follows the project's own #include "..." lines transitively from each file given and prints,
for every file that reaches a forbidden header, the chain that reaches it:

    server/rpc/x.cc -> server/core/y.h -> <ATen/core/Tensor.h>

Used by tests/layering_check.sh: a rule about what a layer may include holds for what its headers
include too. Exit status 1 when any file reaches one.

Usage: include_closure.py --forbid REGEX FILE...   (REGEX matches the include's path as written)
"""
import argparse
import os
import re
import sys

ROOTS = [".", "wire/include", "kernels/include", "storage/include", "client/include",
         "client/torch/include"]
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def resolve(name, including):
    for root in [os.path.dirname(including)] + ROOTS:
        path = os.path.normpath(os.path.join(root, name))
        if os.path.isfile(path):
            return path
    return None  # a system or generated header


def first_chain(start, forbid):
    """The chain from `start` to the first forbidden include found (depth first), or None."""
    parent = {start: None}
    stack = [start]
    while stack:
        current = stack.pop()
        with open(current, errors="replace") as f:
            text = f.read()
        for _, name in INCLUDE.findall(text):
            if forbid.search(name):
                chain = [f"<{name}>", current]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])
                return list(reversed(chain))
            path = resolve(name, current)
            if path is not None and path not in parent:
                parent[path] = current
                stack.append(path)
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--forbid", required=True)
    parser.add_argument("files", nargs="*")
    args = parser.parse_args()
    forbid = re.compile(args.forbid)
    status = 0
    for f in args.files:
        chain = first_chain(f, forbid)
        if chain:
            print(" -> ".join(chain))
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
