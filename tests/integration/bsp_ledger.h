/* bsp_ledger: the deterministic BSP job that test_bsp and the fault tests
 * (tests/faults/test_shard_restart) run through real shards, and its replay.
 * Each worker's gradient depends on the parameters it pulled, so a wrong
 * pull, a lost update or an update applied twice all change the result;
 * replaying the same arithmetic in one process is the ledger the shards'
 * parameters are compared against. */
#ifndef PS_TEST_BSP_LEDGER_H
#define PS_TEST_BSP_LEDGER_H

#include <stdint.h>

#include "ps.h"

/* Initial value of element i of tensor t. */
float bsp_init_value(int t, uint64_t i);
/* Gradient of worker r at step s for element i, from the pulled value p. */
float bsp_grad_value(int r, uint64_t s, uint64_t i, float p);
/* A worker's buffers of the job's nt tensors: p[t] and g[t], counts[t]
 * floats each (malloc'd; the caller frees them). Rank 0 also fills p with
 * the initial values and ps_inits every tensor with them. */
void bsp_ledger_tensors(ps_client *c, int rank, int nt, const uint64_t *counts, float **p,
                        float **g);
/* Frees what bsp_ledger_tensors allocated. */
void bsp_ledger_tensors_free(int nt, float **p, float **g);
/* Replays `steps` BSP steps of `world` workers with SGD at lr on tensor t
 * (count elements) and compares got with it (1e-5 relative); prints the first
 * mismatches, naming rank and tensor, and returns how many elements differ. */
int bsp_replay_compare(int rank, const char *name, int t, uint64_t count, int world, uint64_t steps,
                       float lr, const float *got);

#endif
