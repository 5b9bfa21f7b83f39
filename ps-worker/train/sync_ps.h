/* sync_ps: the trainer's PS-mode backend over libps.
 *
 * grad_ready pushes a tensor's step-s gradient the moment backward produced
 * it and at once asks for version s+1 of that tensor into a staging buffer;
 * the shard answers when every worker has pushed. fetch waits for those pulls
 * and copies the staging buffers into the model (backward still reads the
 * weights while later layers' pulls land, so they cannot go to the model
 * directly). Rank 0 initialises the shards with the model's initial values;
 * the others start from version 0 as pulled. */
#ifndef PS_SYNC_PS_H
#define PS_SYNC_PS_H

#include "model.h"
#include "ps.h"
#include "trainer.h"

struct sync_ps;

/* Declares m's layout on the shards (and, on rank 0, initialises them with
 * m's current parameters). Takes no ownership of c. */
int sync_ps_open(ps_client *c, int rank, struct mlp *m, struct sync_ps **out);
void sync_ps_close(struct sync_ps *s);
/* Fills t with the backend's callbacks. */
void sync_ps_bind(struct sync_ps *s, struct trainer_sync *t);

/* After training finished: how many ranks the shards went on without
 * (ps_lost_workers; -1 if they could not say), the first SYNC_PS_LOST_MAX
 * of them, sorted, in *ranks. */
#define SYNC_PS_LOST_MAX 64
int sync_ps_lost_workers(const struct sync_ps *s, const int **ranks);

#endif
