/* worker_ckpt_agree: the ranks of a job agree on the checkpoint they go on
 * from (worker_ckpt.h's files), over any group that holds them all: the
 * all-reduce ring (sync_ring_resume) or a 3D job's job group (ckpt3d.h).
 *
 * Each rank reads its own files whole (worker_ckpt_scan_tensors) and says
 * what loads, in turn, by a broadcast from each rank; every rank then
 * computes the same answer: the newest step every rank holds a valid
 * checkpoint of. Each loads it and sets its later files aside
 * (worker_ckpt_set_aside_after), so a step of the abandoned timeline is
 * never taken for the new one's. None in common: a fresh start (step 0),
 * a warning naming, rank by rank, what each holds, when files exist.
 * Also the counted write both trainers use. */
#ifndef PS_WORKER_CKPT_AGREE_H
#define PS_WORKER_CKPT_AGREE_H

#include <stdint.h>

#include "collective.h"
#include "worker_ckpt.h"

/* On every rank of c (c's ranks are id->rank in 0..id->world-1; c may be
 * NULL when id->world is 1): agrees,
 * loads into t and sets *step to where training goes on (0: the fresh
 * start). Falling back (a rank's newer file does not load, or a rank holds
 * newer steps than the others) is a warning on every rank naming the
 * rank, the file and why. 0; or a negative errno, logged: a failed
 * collective sets *coll_failed to its status (-ECONNRESET for a lost rank,
 * else -EPROTO), a load that fails is -EINVAL or the errno. */
int worker_ckpt_agree(ps_coll *c, const char *dir, const struct worker_ckpt_id *id,
                      const struct worker_ckpt_tensors *t, uint64_t *step, ps_status *coll_failed);

/* Writes step's checkpoint (worker_ckpt_save_tensors) and logs it, with
 * *failures the writes failed in a row: a failure is logged and training
 * goes on on the previous checkpoint, unless it is the max_failures-th in
 * a row (0: never): then -EIO with msg saying why, and training stops. */
int worker_ckpt_save_counted(struct ckpt_io *io, const char *dir, const struct worker_ckpt_id *id,
                             uint64_t step, const struct worker_ckpt_tensors *t,
                             uint32_t max_failures, uint32_t *failures, char *msg, size_t msglen);

#endif
