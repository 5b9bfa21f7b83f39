"""Train a small CNN on Fashion-MNIST through ps, the way you would train
your own model: the same script runs in both sync modes.

    tools/ps-local --shards 2 --workers 2 -- /usr/bin/python3 examples/torch/train_cnn.py
    tools/ps-local --workers 2 --sync-mode allreduce -- /usr/bin/python3 examples/torch/train_cnn.py

ps-local puts each worker's settings in its environment (PS_RANK,
PS_SERVERS, ...); ps.init() reads them. Every rank trains on its own slice
of each epoch's shuffled data, DistributedOptimizer averages the gradients
over the ranks (through the shards or the ring), and rank 0 prints a line per
epoch and the final test accuracy. The shards' --optimizer decides where the
optimizer runs: sum (ps-local's default with a command: here, locally, the
SGD below) or sgd/momentum/adam on the shards."""
import argparse
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ps
import ps.data
import ps.torch


class CNN(nn.Module):
    """Two 5x5 convolutions with pooling, then two fully connected layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def evaluate(model, x, y, batch=1000):
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            correct += (model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum().item()
    model.train()
    return correct / len(x)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data", default=ps.data.DEFAULT_DIR)
    p.add_argument("--max-steps", type=int, default=0, help="per epoch; 0 = the whole epoch")
    args = p.parse_args()

    torch.set_num_threads(1)  # one core per process on a shared machine
    ps.init()
    rank, world = ps.rank(), ps.size()
    x, y = (torch.from_numpy(a) for a in ps.data.fashion_mnist(args.data, train=True))
    tx, ty = (torch.from_numpy(a) for a in ps.data.fashion_mnist(args.data, train=False))

    torch.manual_seed(args.seed)
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    opt = ps.torch.DistributedOptimizer(opt, model.named_parameters())
    ps.torch.broadcast_parameters(model.state_dict(), root_rank=0)
    ps.torch.broadcast_optimizer_state(opt, root_rank=0)
    if rank == 0:
        where = ("the shards' optimizer" if getattr(opt, "shard_side", False)
                 else "the local SGD")
        print(f"training a CNN on {world} worker(s), sync mode {ps.sync_mode()}, updates by "
              f"{where}", flush=True)

    steps = len(x) // (args.batch_size * world)
    if args.max_steps:
        steps = min(steps, args.max_steps)
    # Cosine annealing over the whole run (per step). With a shard-side
    # optimizer the shards' own --lr (and --lr-decay-steps) apply instead.
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * steps)
    acc = 0.0
    for epoch in range(args.epochs):
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch)  # equal on every rank
        order = torch.randperm(len(x), generator=g)
        start, seen, loss_sum = time.monotonic(), 0, 0.0
        for s in range(steps):
            lo = (s * world + rank) * args.batch_size
            idx = order[lo:lo + args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.item()
            seen += len(idx)
        took = time.monotonic() - start
        if rank == 0:
            acc = evaluate(model, tx, ty)
            print(f"epoch {epoch + 1}/{args.epochs} loss {loss_sum / max(steps, 1):.4f} "
                  f"test accuracy {acc:.4f} ({seen * world / took:.0f} samples/s)", flush=True)
    if rank == 0:
        print(f"accuracy={acc:.4f} epochs={args.epochs}", flush=True)
    ps.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
