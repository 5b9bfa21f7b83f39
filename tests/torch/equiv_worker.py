"""A worker of test_equivalence: trains a small MLP on its half of each
global batch through ps.torch and saves its final parameters.
   equiv_worker.py OUT STEPS BATCH LR MOMENTUM"""
import sys

import torch

import ps
import ps.data
import ps.torch
from harness import DATA
from model import mlp, batches

out, steps, batch, lr, momentum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    float(sys.argv[4]), float(sys.argv[5])
ps.init()
r, w = ps.rank(), ps.size()
torch.manual_seed(100 + r)  # ranks start apart: ps.torch must make them equal
model = mlp()
opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
opt = ps.torch.DistributedOptimizer(opt, model.named_parameters())
ps.torch.broadcast_parameters(model.state_dict(), root_rank=0)
loss_fn = torch.nn.CrossEntropyLoss()
for step, (x, y) in enumerate(batches(DATA, steps, batch * w)):
    lo, hi = r * batch, (r + 1) * batch
    opt.zero_grad()
    loss_fn(model(x[lo:hi]), y[lo:hi]).backward()
    opt.step()
torch.save({k: v.clone() for k, v in model.state_dict().items()}, out % r)
ps.shutdown()
