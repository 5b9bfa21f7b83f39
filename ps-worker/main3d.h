/* main3d: ps-worker's 3D job (--tensor-parallel, --pipeline-stages,
 * --micro-batches; issue 32): the checks of those options and the set-up of
 * the groups, the stage, the data-parallel axis and the loop (trainer3d.h).
 * main.c keeps the options, the summary line and --dump-params. */
#ifndef PS_WORKER_MAIN3D_H
#define PS_WORKER_MAIN3D_H

#include <stdbool.h>

#include "collective.h"
#include "model.h"
#include "ps.h"
#include "trainer.h"
#include "worker_http.h"
#include "worker_options.h"

/* Whether cfg asks for the 3D trainer (T * P > 1 or M > 1). */
bool main3d_wanted(const struct worker_config *cfg);
/* Whether the job needs ring peers (--peers / --peer-template): allreduce
 * mode with W > 1, or T * P > 1 in either mode. */
bool main3d_needs_peers(const struct worker_config *cfg, bool allreduce);
/* The 3D options' checks, before anything starts: 0, or -EINVAL after one
 * line on stderr naming the option and why (exit 2). */
int main3d_check(const struct worker_config *cfg, bool allreduce, const int *sizes, int num_sizes);

/* Connects to the shards with cfg's settings (chunk size auto from
 * total_params floats). Returns 0 or ps-worker's exit code after logging why. */
int worker_connect_shards(const struct worker_config *cfg, int rank, char (*addrs)[300],
                          int num_shards, const ps_token *token, size_t total_params,
                          ps_client **c);

/* The ring's options from cfg (rank, peers, job, listening socket,
 * deadlines, node); the caller adds what its mode needs (p2p, node_first). */
struct ps_coll_opts worker_coll_opts(const struct worker_config *cfg, int rank, char **peers,
                                     const ps_token *token);

/* Runs the 3D job; returns ps-worker's exit code (0, 1, 129). On 0, *res
 * holds the summary and, on rank 0, *full the final whole model (the caller
 * frees it). */
int main3d_run(const struct worker_config *cfg, int rank, bool allreduce, char **peers,
               char (*addrs)[300], int num_shards, const ps_token *token, const int *sizes,
               int num_sizes, struct worker_http *wh, struct trainer_result *res,
               struct mlp **full);

#endif
