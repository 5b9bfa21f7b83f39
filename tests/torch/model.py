"""The model and data of the equivalence tests (shared by the workers and
the single-process reference)."""
import torch

import ps.data


def mlp():
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 10))


def batches(data_dir, steps, global_batch):
    x, y = ps.data.fashion_mnist(data_dir, train=True)
    x, y = torch.from_numpy(x[:steps * global_batch]), torch.from_numpy(y[:steps * global_batch])
    for s in range(steps):
        yield x[s * global_batch:(s + 1) * global_batch], y[s * global_batch:(s + 1) * global_batch]


# The reductions' dtypes besides float32 (ps.torch takes these), and rank
# q's input of n elements of one: values in the hundreds for the floating
# types (sums round in float16 and bfloat16), any value for the integers
# (sums wrap).
TYPED = (torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
         torch.int64)


def typed_input(q, dtype, n):
    g = torch.Generator().manual_seed(300 + q)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)


# -- the DDP/Horovod behaviour tests (ddp_worker.py, test_ddp.py) --------------

def small(seed, hidden=16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 3))


def cnn_bn(seed):
    """A small CNN with BatchNorm (input 1x8x8, 3 classes)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 3))


def global_batch(step, n, shape=(6,)):
    """The global batch of a step: n examples (each rank takes its slice)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn((n,) + tuple(shape), generator=g) * (1 + step % 3)
    return x, torch.randint(0, 3, (n,), generator=g)


def slice_of(batch, rank, per):
    x, y = batch
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


# -- groups and the grid (group_worker.py, test_groups.py) ---------------------

def group_model(stage, perturb=0):
    """Stage `stage`'s model of the grid(pp=2) tests: each stage its own
    shapes under the same parameter names ("0.weight", ...); perturb > 0
    moves it away from the stage's start (a replica to be broadcast over)."""
    torch.manual_seed(40 + stage)
    width = (6, 5) if stage == 0 else (4, 7)
    m = torch.nn.Sequential(torch.nn.Linear(width[0], width[1]), torch.nn.Tanh(),
                            torch.nn.Linear(width[1], 2))
    if perturb:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.5 * perturb)
    return m


def group_step_data(stage, job_rank, step):
    """Job rank job_rank's batch of a step (its own: 3 examples)."""
    g = torch.Generator().manual_seed(500 + 17 * job_rank + step)
    return (torch.randn(3, 6 if stage == 0 else 4, generator=g),
            torch.randn(3, 2, generator=g))
