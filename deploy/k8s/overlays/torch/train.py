"""The torch overlay's training script: a small CNN on Fashion-MNIST through
ps. Every worker pod of the Job runs it (/usr/bin/python3, from the
ConfigMap ps-torch-script); replace this file with your own script, or see
docs/KUBERNETES.md for one baked into the image.

The pod's environment has everything ps.init() needs (PS_SERVER_TEMPLATE,
PS_NUM_SHARDS, PS_RANK, PS_WORLD_SIZE, PS_PEER_TEMPLATE, PS_AUTH_TOKEN_FILE,
PS_SYNC_MODE); the hyper-parameters below come from the ps-config ConfigMap
through the Job's args. The shards run --optimizer sum, so the gradients are
averaged on the shards and the SGD here steps locally on every worker. Rank 0
ends with `summary accuracy=...`, then ps.shutdown() tells the shards the
training is over. Exit 0 completes the pod; exit 129 (a lost shard or peer)
is retried by the Job, 1-127 fail it."""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ps
import ps.data
import ps.torch


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 5, padding=2)
        self.conv2 = nn.Conv2d(8, 16, 5, padding=2)
        self.fc1 = nn.Linear(16 * 7 * 7, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        right = sum((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum().item()
                    for i in range(0, len(x), 1000))
    model.train()
    return right / len(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--data", default=ps.data.DEFAULT_DIR)
    args = p.parse_args()

    ps.init()
    rank, world = ps.rank(), ps.size()
    x, y = (torch.from_numpy(a) for a in ps.data.fashion_mnist(args.data, train=True))
    torch.manual_seed(0)
    model = Net()
    opt = ps.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum),
        model.named_parameters())
    ps.torch.broadcast_parameters(model.state_dict(), root_rank=0)

    # every rank takes its own batches of one shuffled order, the same number
    # of steps on every rank (each step waits for all of them)
    steps = len(x) // (args.batch_size * world)
    start = time.monotonic()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for s in range(steps):
            idx = order[(s * world + rank) * args.batch_size:][:args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} loss {loss.item():.4f}", flush=True)
    wall = time.monotonic() - start
    if rank == 0:
        tx, ty = (torch.from_numpy(a) for a in ps.data.fashion_mnist(args.data, train=False))
        print(f"summary accuracy={accuracy(model, tx, ty):.4f} epochs={args.epochs} "
              f"steps={steps * args.epochs} workers={world} wall_s={wall:.2f} "
              f"samples_per_s={steps * args.epochs * args.batch_size * world / wall:.0f}",
              flush=True)
    ps.shutdown()


if __name__ == "__main__":
    main()
