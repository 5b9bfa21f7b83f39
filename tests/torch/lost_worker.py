"""A command for test_lost.py, run by tools/ps-local on every rank: trains a
small model for 40 steps; rank 1 stops itself (SIGSTOP) at step 5, as a
worker that hangs. Rank 0 saves what ps says about the lost worker.
   lost_worker.py DIR"""
import os
import signal
import sys
import time

import torch

import ps
import ps.torch
from model import global_batch, slice_of, small

out = sys.argv[1]
ps.init()
r = ps.rank()
model = small(1)
opt = ps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters())
with open(os.path.join(out, f"pid-{r}"), "w") as f:
    f.write(str(os.getpid()))
for t in range(40):
    if r == 1 and t == 5:
        with open(os.path.join(out, "stopped"), "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    x, y = slice_of(global_batch(t, 8), r, 4)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
lost = ps.workers_lost()
print(f"workers_lost={lost}", flush=True)
ps.shutdown()
print("rank 0 done", flush=True)
