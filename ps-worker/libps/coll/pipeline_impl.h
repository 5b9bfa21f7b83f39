/* pipeline_impl: what pipeline.c (the schedules) and pipeline_sim.c (the
 * validator and the simulator) share. Internal to libps.
 *
 * Virtual stages: chunk c of pipeline rank s is virtual stage c * p + s of
 * V = p * v. Micro-batch i's activations go from virtual stage k to k + 1
 * (on rank (k + 1) % p, its chunk (k + 1) / p), its gradients from k + 1 back
 * to k. An action's `chunk` is the chunk of its own rank that it serves: a
 * send names the chunk that produced the tensor, a receive the chunk that
 * consumes it, so a send of chunk c on rank p - 1 is received by chunk c + 1
 * on rank 0. With p = 1 the hand-over between chunks stays on the rank and
 * has no send or receive. */
#ifndef PS_PIPELINE_IMPL_H
#define PS_PIPELINE_IMPL_H

#include <stddef.h>

#include "pipeline.h"

/* Every stage's list: lists[s] (n[s] actions), malloc'd; pipe_lists_free
 * frees them. */
struct pipe_lists {
  int p;
  struct ps_pipe_action **a;
  size_t *n;
};

/* Generates every stage's list of sh (checked) into *out. */
ps_status pipe_lists_new(const struct ps_pipe_shape *sh, struct pipe_lists *out, char *err,
                         size_t errlen);
void pipe_lists_free(struct pipe_lists *l);

/* The validator of ps_pipe_validate on any lists (the tests break a schedule
 * on purpose and hand it here). */
ps_status pipe_validate_lists(const struct ps_pipe_shape *sh, const struct pipe_lists *l, char *err,
                              size_t errlen);
/* The simulator of ps_pipe_simulate on any lists; PS_ERR_STATE naming the
 * stuck stages when the lists deadlock. */
ps_status pipe_simulate_lists(const struct ps_pipe_shape *sh, const struct pipe_lists *l,
                              const struct ps_pipe_costs *c, struct ps_pipe_sim *out, char *err,
                              size_t errlen);

/* "forward", "recv_act", ...: for messages. */
const char *pipe_op_name(ps_pipe_op op);

#endif
