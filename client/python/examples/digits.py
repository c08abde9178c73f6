#!/usr/bin/env python3
"""Handwritten digits (scikit-learn's 8x8 digits) with a remote FP8 LayerNormMLP hidden block.

Model: RemoteLayerNormMLP(64 -> 128 -> 64, GELU) on the server, trained by the server's SGD
(``optimizer="sgd"``, stepped with ``apply_gradients()``), then a local Linear(64 -> 10) trained
by a local SGD.
The same model is trained locally in float32 from the same initial weights on the same batches,
and both test accuracies are printed per epoch; a PNG of both loss curves is saved.

  PYTHONPATH=client/python python3 client/python/examples/digits.py \
      --server 127.0.0.1:50051 --epochs 12 --plot digits.png
"""

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import gradwire


class LocalLayerNormMLP(torch.nn.Module):
    """The float32 twin of the remote block (GELU with the tanh approximation, as the server)."""

    def __init__(self, weights):
        super().__init__()
        self.p = torch.nn.ParameterDict(
            {k: torch.nn.Parameter(v.clone()) for k, v in weights.items()})

    def forward(self, x):
        p = self.p
        h = F.layer_norm(x, (x.shape[-1],), p["layer_norm_weight"], p["layer_norm_bias"], 1e-5)
        h = F.gelu(F.linear(h, p["fc1_weight"], p["fc1_bias"]), approximate="tanh")
        return F.linear(h, p["fc2_weight"], p["fc2_bias"])


def load_data(seed):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed,
                                                        stratify=y)
    return x_train, x_test, y_train, y_test


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(dim=1) == y).float().mean().item()
    model.train()
    return correct


def train(client, epochs=10, batch=64, lr=0.02, momentum=0.9, seed=0, recipe="current",
          log=print):
    """Trains the remote model and its float32 twin; returns a dict of per-epoch results."""
    torch.manual_seed(seed)
    x_train, x_test, y_train, y_test = load_data(seed)
    block = gradwire.RemoteLayerNormMLP(client, 64, 128, 64, recipe=recipe, seed=seed,
                                        optimizer="sgd", lr=lr, momentum=momentum,
                                        name="digits.block")
    head = torch.nn.Linear(64, 10)
    remote = torch.nn.Sequential(block, head)
    local = torch.nn.Sequential(LocalLayerNormMLP(block.get_weights()), torch.nn.Linear(64, 10))
    local[1].load_state_dict(head.state_dict())
    head_opt = torch.optim.SGD(head.parameters(), lr=lr, momentum=momentum)
    local_opt = torch.optim.SGD(local.parameters(), lr=lr, momentum=momentum)
    generator = torch.Generator().manual_seed(seed)
    history = {"epoch": [], "fp8_acc": [], "f32_acc": [], "fp8_loss": [], "f32_loss": []}
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(x_train), generator=generator)
        fp8_losses, f32_losses = [], []
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            xb, yb = x_train[idx], y_train[idx]
            loss = F.cross_entropy(remote(xb), yb)
            head_opt.zero_grad()
            loss.backward()          # the block's backward runs on the server
            head_opt.step()
            block.apply_gradients()  # the block's SGD step runs on the server
            ref = F.cross_entropy(local(xb), yb)
            local_opt.zero_grad()
            ref.backward()
            local_opt.step()
            fp8_losses.append(loss.item())
            f32_losses.append(ref.item())
        history["epoch"].append(epoch)
        history["fp8_acc"].append(accuracy(remote, x_test, y_test))
        history["f32_acc"].append(accuracy(local, x_test, y_test))
        history["fp8_loss"].append(sum(fp8_losses) / len(fp8_losses))
        history["f32_loss"].append(sum(f32_losses) / len(f32_losses))
        log(f"epoch {epoch:2d}  loss fp8 {history['fp8_loss'][-1]:.4f} f32 "
            f"{history['f32_loss'][-1]:.4f}  test accuracy fp8 {100 * history['fp8_acc'][-1]:.1f}% "
            f"f32 {100 * history['f32_acc'][-1]:.1f}%")
    return history


def plot(history, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(history["epoch"], history["fp8_loss"], marker="o", label="remote FP8 LayerNormMLP")
    ax.plot(history["epoch"], history["f32_loss"], marker="s", label="local float32 twin")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title("digits: FP8 on gradwire vs float32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="127.0.0.1:50051", help="gradwire-server address")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipe", choices=["current", "delayed", "block", "block-hybrid", "mxfp8"],
                        default="current")
    parser.add_argument("--wire-dtype", choices=["f32", "bf16", "f16", "fp8"], default="f32")
    parser.add_argument("--plot", default="digits-loss.png", help="PNG of the loss curves")
    parser.add_argument("--json", action="store_true", help="print the history as one JSON line")
    args = parser.parse_args()
    # Closing the client deletes the block it created on the server.
    with gradwire.Client(args.server, wire_dtype=args.wire_dtype) as client:
        history = train(client, args.epochs, lr=args.lr, momentum=args.momentum, seed=args.seed,
                        recipe=args.recipe)
    plot(history, args.plot)
    print(f"loss curves: {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(history))


if __name__ == "__main__":
    main()
