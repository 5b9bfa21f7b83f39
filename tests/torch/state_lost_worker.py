"""A worker of test_state_lost.py: trains a small model (one key on each of
the two shards) through ps.torch for STEPS steps of synthetic data with a
worker-side SGD with momentum; every rank starts from the same seed.
   state_lost_worker.py OUT STEPS HOLD
OUT % rank + ".step" holds the step this rank is at. At step HOLD (-1:
never) the rank waits, between two steps, until the file OUT % "go" exists
(or it is killed). At the end it saves its parameters, shard 0's
duplicates counter and each shard's number of keys to OUT % rank. A
JobLostError is left uncaught: ps exits the process with 3."""
import ctypes
import os
import sys
import time

import torch

import ps
import ps.torch
from ps import _lib
from model import global_batch, slice_of, small

out, steps, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ps.init()
r, w = ps.rank(), ps.size()
model = small(7, hidden=256)  # 2,563 floats: two keys of 8 KiB, one per shard
opt = ps.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    model.named_parameters())


def at(step):
    tmp = out % r + ".step.tmp"
    with open(tmp, "w") as f:
        f.write(str(step))
    os.replace(tmp, out % r + ".step")


for t in range(steps):
    at(t)
    if t == hold:
        while not os.path.exists(out % "go"):
            time.sleep(0.02)
    x, y = slice_of(global_batch(t, 4 * w), r, 4)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
at(steps)
stats = [_lib.ShardStats() for _ in range(2)]
for i in range(2):
    st = _lib.lib.ps_stats(ps._current().client, i, ctypes.byref(stats[i]))
    if st != _lib.OK:
        raise ps._current().client_error(st, f"asking shard {i} for its stats")
torch.save({"params": {k: v.clone() for k, v in model.state_dict().items()},
            "duplicates": stats[0].duplicates, "keys": [s.num_keys for s in stats]}, out % r)
ps.shutdown()
print(f"rank {r} done", flush=True)
