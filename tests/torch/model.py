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
