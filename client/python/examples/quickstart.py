#!/usr/bin/env python3
"""A PyTorch model with local and remote layers, trained by one local torch optimizer, saved and
loaded with state_dict, and shut down cleanly (nothing left on the server).

The model: a local Linear(16 -> 32), a remote FP8 LayerNormMLP(32 -> 64 -> 32), a local ReLU and
a remote FP8 Linear(32 -> 4), in one RemoteSequential (the remote runs are pipelined in
micro-batches). AdamW over ``model.parameters()`` trains all of them: the remote layers'
gradients arrive in ``.grad`` after ``backward()``, and each ``step()`` reaches the server before
the next forward.

  PYTHONPATH=client/python /usr/bin/python3 client/python/examples/quickstart.py \
      --server 127.0.0.1:50051
"""

import argparse
import json
import os
import tempfile

import torch
import torch.nn.functional as F

import gradwire


def build(client: gradwire.Client, seed: int) -> gradwire.RemoteSequential:
    torch.manual_seed(seed)
    return gradwire.RemoteSequential([
        torch.nn.Linear(16, 32),                                    # local
        gradwire.RemoteLayerNormMLP(client, 32, 64, seed=seed),     # remote
        torch.nn.ReLU(),                                            # local
        gradwire.RemoteLinear(client, 32, 4, seed=seed + 1),        # remote
    ], micro_batches=2)


def run(client: gradwire.Client, steps: int = 30, log=print) -> dict:
    model = build(client, seed=0)
    log(model)
    log(f"{sum(p.numel() for p in model.parameters())} parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=generator)
    target = torch.sin(x[:, :4])
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        losses.append(loss.item())
    log(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")

    # The state_dict holds every layer's real weights, remote ones included: save it, and load
    # it into a model built with other initial weights.
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.pt")
        torch.save(model.state_dict(), path)
        restored = build(client, seed=1)
        restored.load_state_dict(torch.load(path))
    model.eval()
    restored.eval()
    with torch.no_grad():
        same = torch.equal(model(x), restored(x))
    log(f"restored model gives the same outputs: {same}")
    return {"losses": losses, "restored_equal": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="127.0.0.1:50051", help="gradwire-server address")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line")
    args = parser.parse_args()
    # Leaving the block closes the client, which deletes the modules its layers created.
    with gradwire.Client(args.server) as client:
        result = run(client, args.steps, log=print if not args.json else lambda s: None)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
