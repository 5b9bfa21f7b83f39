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
