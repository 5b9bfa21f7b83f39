"""Fashion-MNIST from Debian's dataset-fashion-mnist (IDX files, raw or
.gz), as numpy arrays: the data of ps's examples and tests."""

import gzip
import os
import struct

import numpy as np

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
NUM_CLASSES = 10  # DATASET_NUM_CLASSES of ps-worker/train/data.h


def _open(path):
    for p in (path, path + ".gz"):
        if os.path.exists(p):
            return gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb")
    raise FileNotFoundError(f"{path}[.gz] not found (apt-get install dataset-fashion-mnist)")


def _idx(path, ndim, magic):
    with _open(path) as f:
        head = f.read(4 + 4 * ndim)
        if len(head) != 4 + 4 * ndim or struct.unpack(">I", head[:4])[0] != magic:
            raise ValueError(f"{path}: not an IDX file of {ndim} dimensions")
        dims = struct.unpack(">" + "I" * ndim, head[4:])
        data = f.read()
    n = int(np.prod(dims))
    if len(data) != n:
        raise ValueError(f"{path}: {len(data)} data bytes, the header says {n}")
    return np.frombuffer(data, dtype=np.uint8).reshape(dims)


def fashion_mnist(directory=DEFAULT_DIR, train=True):
    """(images, labels): float32 images in [0, 1] of shape (N, 1, 28, 28) and
    int64 labels (N,). train=False gives the 10,000 test images."""
    prefix = "train" if train else "t10k"
    x = _idx(os.path.join(directory, f"{prefix}-images-idx3-ubyte"), 3, 0x803)
    y = _idx(os.path.join(directory, f"{prefix}-labels-idx1-ubyte"), 1, 0x801)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{directory}: {x.shape[0]} {prefix} images but {y.shape[0]} labels")
    bad = np.flatnonzero(y >= NUM_CLASSES)
    if bad.size:  # as ps-worker/train/data.c: a label no output unit stands for
        i = int(bad[0])
        path = os.path.join(directory, f"{prefix}-labels-idx1-ubyte")
        raise ValueError(f"{path}: label {int(y[i])} at index {i} is outside 0..{NUM_CLASSES - 1}")
    images = (x.astype(np.float32) / 255.0).reshape(x.shape[0], 1, x.shape[1], x.shape[2])
    return images, y.astype(np.int64)
