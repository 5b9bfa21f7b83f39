"""Buffers (BatchNorm's running statistics and the like): what DDP's
broadcast_buffers does, for ps.torch.

A module's buffers are not gradients: every rank updates its own in forward
(BatchNorm: running_mean and running_var from its own batch), so without
help they drift apart and the ranks evaluate different models.
broadcast_buffers(module) makes every rank's buffers root_rank's:

  - at once (every rank calls it at the same point, like
    broadcast_parameters);
  - then once per step. With a DistributedOptimizer in the job, at the end
    of each of its synchronisations (when backward() returns): the buffers
    the next forward sees are then root_rank's as of its last forward,
    exactly what DDP's broadcast before each forward gives, and after the
    last step every rank holds the same buffers (DDP leaves each rank's own
    last update). Without one, before each forward in training mode with
    gradients enabled (DDP's rule; an evaluation under torch.no_grad()
    broadcasts nothing, so one rank may evaluate alone).
  - When root_rank has joined (ps.torch.join()) the lowest rank still
    training is the root, as DDP's authoritative rank.

Every buffer of every dtype goes in one broadcast (their bytes packed)."""

import torch

import ps

from . import _rounds


class BufferSync:
    """What broadcast_buffers returns: .sync() broadcasts now (every rank
    must call it), .remove() stops the per-step broadcasts."""

    def __init__(self, module, root_rank, state):
        self.module = module
        self.root = root_rank
        self._state = state  # the job's ps.torch state (its optimizers, its buffer syncs)
        self._hook = None

    def buffers(self):
        return [b for _, b in sorted(self.module.named_buffers(), key=lambda kv: kv[0])]

    def sync(self, root=None):
        """Makes every rank's buffers root's (root_rank by default)."""
        _rounds.broadcast_flat(self.buffers(), self.root if root is None else root,
                               "the buffers of broadcast_buffers")

    def _pre_forward(self, module, inputs):
        if self._state.live_optimizers():
            return  # the optimizer's rounds broadcast them
        if module.training and torch.is_grad_enabled():
            self.sync()

    def remove(self):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._state.buffer_syncs = [s for s in self._state.buffer_syncs if s is not self]


def broadcast_buffers(module, root_rank=0):
    """Keeps module's buffers equal to root_rank's on every rank (see the top
    of buffers.py): broadcasts them now, then once per step. Call it on
    every rank, after the model is built (and moved) as it will train.
    Returns a BufferSync (.sync() now, .remove())."""
    from . import _agree, _check_root, _job_state, check_tensor
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"broadcast_buffers: expected a torch.nn.Module, got "
                        f"{type(module).__name__}")
    _check_root(root_rank)
    named = sorted(module.named_buffers(), key=lambda kv: kv[0])
    for name, b in named:
        check_tensor(b, f"broadcast_buffers: buffer {name}", float32=False,
                     any_layout=True)
    job = ps._current()
    handle = BufferSync(module, root_rank, _job_state(job))
    if job.size > 1:
        _agree(";".join(f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in named), root_rank,
               "broadcast_buffers")
        handle.sync()
    handle._hook = module.register_forward_pre_hook(handle._pre_forward)
    handle._state.buffer_syncs.append(handle)
    return handle
