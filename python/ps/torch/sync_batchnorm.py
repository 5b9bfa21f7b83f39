"""SyncBatchNorm: batch normalisation over the batch of every rank, as
torch.nn.SyncBatchNorm (which needs CUDA and torch.distributed), over ps's
ring in both sync modes.

Forward in training mode: each rank computes its per-channel count, mean
and sum of squared deviations (M2); one all-gather brings every rank's
(float64), and every rank combines them the same way (Chan et al.'s
parallel variance: mean = sum(n_i mean_i) / N, M2 = sum(M2_i + n_i
(mean_i - mean)^2)), so the statistics are those of the global batch and
every rank computes the same ones: normalisation with the biased variance,
running_var updated with the unbiased one (N / (N - 1)), as BatchNorm does on
one process.

Backward: each rank's sums of dy and dy * x_hat over its batch are
all-reduced (one sum all-reduce), and
    dx = weight * invstd * (dy - sum(dy) / N - x_hat * sum(dy x_hat) / N)
with the global sums: the gradient of the sum of every rank's loss with
respect to this rank's inputs. weight's and bias's gradients are this rank's
own sums (torch's choice too): averaged over the ranks by the
DistributedOptimizer, every parameter's gradient is then that of the mean
loss over the global batch, as on one process.

Evaluation (model.eval()) normalises with the running statistics, which
every rank holds alike, and communicates nothing. One rank, or no ring:
plain batch norm. The collectives are ring collectives, so every rank must
run the same forward and backward passes (as with torch's)."""

import torch
import torch.nn.functional as F

import ps
from ps import _lib


class _SyncBN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        from . import _ring
        job, coll = _ring()
        c = x.shape[1]
        xc = x.transpose(0, 1).reshape(c, -1)
        n = xc.shape[1]
        if n:
            mean = xc.mean(1)
            m2 = (xc - mean[:, None]).pow(2).sum(1)
        else:
            mean = torch.zeros(c, dtype=x.dtype)
            m2 = torch.zeros(c, dtype=x.dtype)
        mine = torch.cat([torch.tensor([float(n)], dtype=torch.float64), mean.double(),
                          m2.double()])
        every = torch.empty(job.size, 2 * c + 1, dtype=torch.float64)
        st = _lib.lib.ps_coll_allgather(coll, mine.data_ptr(), every.data_ptr(),
                                        mine.numel() * 8)
        if st != _lib.OK:
            raise job.ring_error(st, "SyncBatchNorm: the all-gather of the batch statistics")
        counts, means, m2s = every[:, 0], every[:, 1:c + 1], every[:, c + 1:]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel over "
                             f"every rank's batch, got input of size {tuple(x.shape)} here "
                             f"and {int(total.item())} values in all")
        g_mean = (counts[:, None] * means).sum(0) / total
        g_m2 = (m2s + counts[:, None] * (means - g_mean).pow(2)).sum(0)
        var = g_m2 / total
        invstd = (var + eps).rsqrt()
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype),
                                                     alpha=momentum)
                running_var.mul_(1 - momentum).add_(
                    (g_m2 / (total - 1)).to(running_var.dtype), alpha=momentum)
        shape = (1, c) + (1,) * (x.dim() - 2)
        mean_f, invstd_f = g_mean.to(x.dtype), invstd.to(x.dtype)
        xhat = (x - mean_f.view(shape)) * invstd_f.view(shape)
        out = xhat
        if weight is not None:
            out = out * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(xhat, weight, invstd_f)
        ctx.total = float(total.item())
        return out

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        from . import _ring
        job, coll = _ring()
        c = xhat.shape[1]
        dims = [0] + list(range(2, xhat.dim()))
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        both = torch.cat([sum_dy, sum_dy_xhat]).double()
        st = _lib.lib.ps_coll_allreduce_typed(coll, both.data_ptr(), both.numel(),
                                              _lib.DTYPE_FLOAT64, _lib.REDOP_SUM)
        if st != _lib.OK:
            raise job.ring_error(st, "SyncBatchNorm: the all-reduce of the gradient sums")
        g_dy = (both[:c] / ctx.total).to(dy.dtype)
        g_dy_xhat = (both[c:] / ctx.total).to(dy.dtype)
        shape = (1, c) + (1,) * (xhat.dim() - 2)
        scale = invstd if weight is None else invstd * weight
        dx = scale.view(shape) * (dy - g_dy.view(shape) - xhat * g_dy_xhat.view(shape))
        dw = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        db = sum_dy if weight is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """torch.nn.SyncBatchNorm's interface (any input of dim >= 2: (N, C),
    (N, C, L), (N, C, H, W), ...), synchronised over every rank of the job
    (process_group is not supported)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None):
        if process_group is not None:
            raise ValueError("ps.torch.SyncBatchNorm: process_group is not supported (the "
                             "statistics are taken over every rank of the job)")
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        running_mean = self.running_mean if not self.training or self.track_running_stats \
            else None
        running_var = self.running_var if not self.training or self.track_running_stats \
            else None
        job = ps._current()
        if not (bn_training and self.training) or job.size <= 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                bn_training, factor, self.eps)
        if input.device.type != "cpu" or input.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"ps.torch.SyncBatchNorm: a {input.dtype} input on "
                            f"{input.device}; it takes float32 or float64 CPU tensors")
        return _SyncBN.apply(input, self.weight, self.bias, running_mean, running_var,
                             self.eps, factor)


def convert_sync_batchnorm(module):
    """module with every BatchNorm*d (and torch's SyncBatchNorm) replaced by
    ps.torch.SyncBatchNorm carrying the same parameters, buffers, mode and
    requires_grad (as torch.nn.SyncBatchNorm.convert_sync_batchnorm).
    Convert before building the optimizer: the parameters are the same
    tensors, but a DistributedOptimizer names them as they are then."""
    out = module
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and \
            not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child))
    del module
    return out
