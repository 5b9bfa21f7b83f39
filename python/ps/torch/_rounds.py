"""Rounds: how the ranks of a job agree, step by step, on who still trains.

Every synchronisation of a DistributedOptimizer is a round. On the ring
(allreduce mode, and the buffer broadcasts of broadcast_buffers in ps mode) a
round starts with a small header every rank contributes to: a sum
all-reduce of 3 floats per rank, zero except this rank's own
(state, step mod 4096, step // 4096), so every rank decodes the same list of
(state, step) for every rank, exactly (small integers in float32):

  TRAIN     the rank computed gradients for this step;
  JOINED    it ran out of data and called ps.torch.join(): it takes part in
            the round with zeros (the mean divides by the ranks that train)
            and does not step;
  FINISHED  its training is over (ps.shutdown(), or the script ended) and it
            did not join.

From the header every rank draws the same conclusions:
  - TRAIN and FINISHED together: the ranks ran different numbers of steps.
    Each rank fails the ring with the same message naming both ranks, their
    steps and join (ps_coll_abort, so no queued operation waits for a rank
    that will never start it), then raises PSError;
  - no TRAIN: the rounds are closed (every rank joined or finished); the
    rest of the round is not run by anyone. If some rank sat out a round the
    others trained in, its model is behind: the optimizers then broadcast
    their parameters and state from the lowest rank of the last round that
    had trainers (final_root), as DDP's Join does for the model;
  - otherwise the round goes on; with fewer trainers than ranks the mean of
    the gradients is rescaled to the trainers' mean.
A round after a closed one opens them again (a next epoch after join()).

In ps mode the shards keep the steps (ps_leave tells them who joined or
finished; they refuse uneven steps themselves) and the header is needed only
for buffer broadcasts, which go over the ring."""

import ctypes

import torch

import ps
from ps import _lib

TRAIN, JOINED, FINISHED = 1, 2, 3
_NAMES = {TRAIN: "trains", JOINED: "joined", FINISHED: "finished"}
_SPLIT = 4096  # steps travel as two small integers, each exact in float32


class Header:
    """One round's header in flight (start) and its decoding (finish)."""

    def __init__(self, job, state, step):
        self.job = job
        if state == TRAIN:  # a round after closed ones opens them again
            rounds_of(job).reopen()
        w, r = job.size, job.rank
        self.buf = torch.zeros(3 * w, dtype=torch.float32)
        self.buf[3 * r] = state
        self.buf[3 * r + 1] = step % _SPLIT
        self.buf[3 * r + 2] = step // _SPLIT
        self.req = ctypes.c_void_p()
        st = _lib.lib.ps_coll_allreduce_async(job.ring(), self.buf.data_ptr(), 3 * w,
                                              _lib.REDOP_SUM, ctypes.byref(self.req))
        if st != _lib.OK:
            self.req = None
            raise job.ring_error(st, "the round header")

    def wait(self):
        """The (state, step) of every rank; raises the ring's failure."""
        req, self.req = self.req, None
        if req is not None:
            st = _lib.lib.ps_coll_wait(req)
            if st != _lib.OK:
                raise self.job.ring_error(st, "the round header")
        v = [int(round(x)) for x in self.buf.tolist()]
        return [(v[3 * q], v[3 * q + 1] + _SPLIT * v[3 * q + 2]) for q in range(self.job.size)]

    def abandon(self):
        """Waits for the header after a failure elsewhere (its buffer is ours)."""
        if self.req is not None:
            req, self.req = self.req, None
            _lib.lib.ps_coll_wait(req)


class Rounds:
    """The job's view of its rounds (one per job: rounds_of(job))."""

    def __init__(self, job):
        self.job = job
        self.closed = False
        self.missed = False  # some rank sat out a round others trained in
        self.last_trainers = None
        self.trainers = job.size  # in the current round

    def conclude(self, states, what):
        """Applies one decoded header; raises PSError (after failing the
        ring on purpose) when the ranks ran different numbers of steps."""
        job = self.job
        train = [q for q, (s, _) in enumerate(states) if s == TRAIN]
        done = [q for q, (s, _) in enumerate(states) if s == FINISHED]
        bad = [q for q, (s, _) in enumerate(states) if s not in _NAMES]
        if bad:
            msg = (f"ps.torch: {what}: ranks {bad} sent no valid round state (ranks disagree on "
                   "what they synchronise: another collective ran on some ranks)")
            abort(job, msg)
            raise ps.PSError(msg, _lib.ERR_STATE)
        if train and done:
            t, f = train[0], done[0]
            if hasattr(job, "_group"):  # a group's rounds (groups.py): name job ranks
                t, f = job._group.ranks[t], job._group.ranks[f]
                states = {job._group.ranks[q]: s for q, s in enumerate(states)}
            msg = (f"ps.torch: the ranks ran different numbers of steps: rank {t} is at step "
                   f"{states[t][1]} of {what} while rank {f} finished after step "
                   f"{states[f][1] - 1} (ps.shutdown() or the end of its script) without "
                   "ps.torch.join(); every rank must run the same number of steps, or a rank "
                   "that runs out of data calls ps.torch.join() so that the others can finish "
                   "without it")
            abort(job, msg)
            raise ps.PSError(msg, _lib.ERR_STATE)
        if not train:
            self.closed = True
            self.trainers = 0
            return states
        if len(train) < job.size:
            self.missed = True
        self.closed = False
        self.last_trainers = train
        self.trainers = len(train)
        return states

    def reopen(self):
        if self.closed:
            self.closed = False
            self.missed = False
            self.last_trainers = None
            self.trainers = self.job.size

    def final_root(self):
        """After the rounds closed: the rank whose model every other rank
        takes (lowest of the last round's trainers), or None when no rank
        sat out a round."""
        if not self.missed or not self.last_trainers:
            return None
        return min(self.last_trainers)


def rounds_of(job):
    r = getattr(job, "rounds", None)
    if r is None:
        r = job.rounds = Rounds(job)
    return r


def abort(job, msg):
    """Fails the ring on every rank with msg (harmless when it failed already)."""
    if job.coll is not None:
        _lib.lib.ps_coll_abort(job.coll, msg.encode())


def broadcast_flat(tensors, root, what, job=None):
    """Broadcasts the tensors (any dtypes, any layouts) from root in one
    operation: their bytes packed into one buffer, then copied back. job:
    the job, or a group's view of it (groups.py); None = the job."""
    job = ps._current() if job is None else job
    if job.size <= 1 or not tensors:
        return
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
    if flat.numel() == 0:
        return
    st = _lib.lib.ps_coll_broadcast(job.ring(), flat.data_ptr(), flat.numel(), root)
    if st != _lib.OK:
        raise job.ring_error(st, what)
    if job.rank == root:
        return
    off = 0
    with torch.no_grad():
        for t, p in zip(tensors, parts):
            n = p.numel()
            t.copy_(flat[off:off + n].clone().view(t.dtype).view(t.shape))
            off += n
