#!/usr/bin/env python3
"""A stack of remote FP8 LayerNormMLP blocks, pipelined over micro-batches, on scikit-learn's
breast cancer dataset (Wisconsin diagnostic: 569 tumours, 30 features, benign or malignant; it
ships with Debian's python3-sklearn).

Model: a local Linear(30 -> 32) embedding, ``--blocks`` RemoteLayerNormMLP(32 -> 64 -> 32, GELU)
blocks chained by RemoteSequential (GPipe: ``--micro-batches`` micro-batches forward through every
block, then backward in reverse, on each server's Train stream), and a local Linear(32 -> 2) head.
With several servers (``--server A,B``) the blocks are placed round-robin and each backward goes
to the server of its forward.

The same model is trained locally in float32 from the same initial weights on the same batches;
both loss curves go to a PNG, and the wall-clock time of each is reported.

  PYTHONPATH=client/python python3 client/python/examples/mlp_stack.py \
      --server 127.0.0.1:50051 --epochs 15 --plot mlp-stack.png
"""

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split

import gradwire
from digits import LocalLayerNormMLP  # the float32 twin of a remote block (this folder)


def load_data(seed):
    data = load_breast_cancer()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, random_state=seed,
                                                        stratify=y)
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6  # standardise on the training split
    return (x_train - mean) / std, (x_test - mean) / std, y_train, y_test


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(dim=1) == y).float().mean().item()
    model.train()
    return correct


def build(where, blocks, micro_batches, lr, momentum, seed, recipe="current"):
    torch.manual_seed(seed)
    remote_blocks = [gradwire.RemoteLayerNormMLP(where, 32, 64, 32, seed=seed + i,
                                                 optimizer="sgd", lr=lr, momentum=momentum,
                                                 recipe=recipe, name=f"mlp_stack.block{i}")
                     for i in range(blocks)]
    embed, head = torch.nn.Linear(30, 32), torch.nn.Linear(32, 2)
    stack = gradwire.RemoteSequential(remote_blocks, micro_batches=micro_batches)
    remote = torch.nn.Sequential(embed, stack, head)
    local = torch.nn.Sequential(
        torch.nn.Linear(30, 32),
        torch.nn.Sequential(*[LocalLayerNormMLP(b.get_weights()) for b in remote_blocks]),
        torch.nn.Linear(32, 2))
    local[0].load_state_dict(embed.state_dict())
    local[2].load_state_dict(head.state_dict())
    return remote, stack, local


def train(where, epochs=15, batch=64, blocks=3, micro_batches=4, lr=0.01, momentum=0.9, seed=0,
          recipe="current", log=print):
    """Trains the remote model and its float32 twin; returns per-epoch results and timings."""
    x_train, x_test, y_train, y_test = load_data(seed)
    remote, stack, local = build(where, blocks, micro_batches, lr, momentum, seed, recipe)
    local_params = [p for i in (0, 2) for p in remote[i].parameters()]
    remote_opt = torch.optim.SGD(local_params, lr=lr, momentum=momentum)
    local_opt = torch.optim.SGD(local.parameters(), lr=lr, momentum=momentum)
    generator = torch.Generator().manual_seed(seed)
    history = {"epoch": [], "fp8_loss": [], "f32_loss": [], "fp8_acc": [], "f32_acc": [],
               "fp8_seconds": 0.0, "f32_seconds": 0.0}
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(x_train), generator=generator)
        fp8_losses, f32_losses = [], []
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            xb, yb = x_train[idx], y_train[idx]
            t0 = time.perf_counter()
            loss = F.cross_entropy(remote(xb), yb)
            remote_opt.zero_grad()
            loss.backward()  # the blocks' backwards run on the servers, pipelined
            remote_opt.step()
            stack.apply_gradients()
            t1 = time.perf_counter()
            ref = F.cross_entropy(local(xb), yb)
            local_opt.zero_grad()
            ref.backward()
            local_opt.step()
            t2 = time.perf_counter()
            history["fp8_seconds"] += t1 - t0
            history["f32_seconds"] += t2 - t1
            fp8_losses.append(loss.item())
            f32_losses.append(ref.item())
        history["epoch"].append(epoch)
        history["fp8_loss"].append(sum(fp8_losses) / len(fp8_losses))
        history["f32_loss"].append(sum(f32_losses) / len(f32_losses))
        history["fp8_acc"].append(accuracy(remote, x_test, y_test))
        history["f32_acc"].append(accuracy(local, x_test, y_test))
        log(f"epoch {epoch:2d}  loss fp8 {history['fp8_loss'][-1]:.4f} f32 "
            f"{history['f32_loss'][-1]:.4f}  test accuracy fp8 {100 * history['fp8_acc'][-1]:.1f}% "
            f"f32 {100 * history['f32_acc'][-1]:.1f}%")
    log(f"wall-clock training: remote {history['fp8_seconds']:.2f} s, "
        f"local float32 {history['f32_seconds']:.2f} s "
        f"({history['fp8_seconds'] / max(history['f32_seconds'], 1e-9):.1f}x)")
    return history


def plot(history, path, blocks):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(history["epoch"], history["fp8_loss"], marker="o",
            label=f"{blocks} remote FP8 LayerNormMLP blocks "
                  f"({history['fp8_seconds']:.1f} s)")
    ax.plot(history["epoch"], history["f32_loss"], marker="s",
            label=f"local float32 twin ({history['f32_seconds']:.1f} s)")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title("breast cancer: pipelined FP8 on gradwire vs float32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="127.0.0.1:50051",
                        help="gradwire-server address, or several separated by commas")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipe", choices=["current", "delayed", "block", "block-hybrid", "mxfp8"],
                        default="current", help="the blocks' FP8 scaling recipe")
    parser.add_argument("--wire-dtype", choices=["f32", "bf16", "f16", "fp8"], default="f32")
    parser.add_argument("--plot", default="mlp-stack-loss.png", help="PNG of the loss curves")
    parser.add_argument("--json", action="store_true", help="print the history as one JSON line")
    args = parser.parse_args()
    servers = [s for s in args.server.split(",") if s]
    where = (gradwire.Cluster(servers, wire_dtype=args.wire_dtype) if len(servers) > 1
             else gradwire.Client(servers[0], wire_dtype=args.wire_dtype))
    # Closing deletes the blocks the run created on the servers, whatever happened.
    with where:
        history = train(where, args.epochs, blocks=args.blocks, micro_batches=args.micro_batches,
                        lr=args.lr, momentum=args.momentum, seed=args.seed, recipe=args.recipe)
    plot(history, args.plot, args.blocks)
    print(f"loss curves: {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(history))


if __name__ == "__main__":
    main()
