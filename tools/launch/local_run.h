/* local_run: one run of ps-local, from the options main() parsed and the
 * plan it made of them, to the exit code: the private directory and token,
 * the shards and workers it starts and supervises, their output, and how
 * the run ended (local_run.c's opening comment has the lifecycle). Only
 * ps-local.c's main() parses (docs/ARCHITECTURE.md, Conventions); this module reads the options
 * through a const pointer. */
#ifndef PS_LOCAL_RUN_H
#define PS_LOCAL_RUN_H

#include <stdbool.h>
#include <stdint.h>

enum { LOCAL_PATH_BYTES = 4096 };

/* ps-local's options, filled by its option table (ps-local.c). */
struct local_config {
  int64_t shards;
  int64_t workers;
  int64_t epochs;
  char model[256];
  int64_t batch_size;
  double lr;
  double momentum;
  int64_t seed;
  char data[LOCAL_PATH_BYTES];
  char sync_mode[16];
  char bin_dir[LOCAL_PATH_BYTES];
  char log_level[16];
  int64_t max_steps;
  char keep_logs[LOCAL_PATH_BYTES];
  char lr_schedule[16];
  char consistency[32];
  char optimizer[16];
  double weight_decay;
  char auth_token_file[LOCAL_PATH_BYTES];
  bool no_auth;
  char blas_kernel[32];
  char transport[8];
  char staleness_method[16];
  bool shard_optimizer_state;
  char worker_timeout[32];    /* the shards' --worker-timeout as given; "" = theirs */
  char on_worker_timeout[16]; /* the shards' --on-worker-timeout as given; "" = theirs */
  /* ps-worker's model parallelism, forwarded */
  int64_t tensor_parallel, pipeline_stages, micro_batches, pipeline_chunks;
  char pipeline_schedule[16];
  /* across hosts (rendezvous.h): --nodes, --node-rank, --rendezvous, ... */
  int64_t nodes, node_rank, workers_per_node, shards_per_node;
  char rendezvous[300];
  double rendezvous_timeout;
};

/* What main() made of the options, for local_run. */
struct local_plan {
  const struct local_config *cfg;
  bool allreduce;         /* --sync-mode allreduce: no shards, workers form a ring */
  const char *const *cmd; /* command mode: the argv after "--"; NULL = ps-worker */
  const char *optimizer;  /* the shards' --optimizer (its default resolved) */
  const char *schedule;   /* --lr-schedule, its default resolved */
  uint64_t decay_steps;   /* --lr-decay-steps for the shards; 0 = constant */
  char server_bin[LOCAL_PATH_BYTES];
  char worker_bin[LOCAL_PATH_BYTES]; /* "" in command mode */
  char build_root[LOCAL_PATH_BYTES]; /* the meson build tree we run from; "" = installed */
  char job_id[128];                  /* command mode: PS_JOB_ID */
};

/* Runs the job the plan describes on 127.0.0.1 and returns ps-local's exit
 * code (0 done; 1 a child failed, or a start-up error; 129 a lost rank,
 * retryable: the first child to fail exited 129, or a worker that could no
 * longer finish once another had was killed; 128+N stopped by signal N).
 * t0 (clock_now_ms) is when ps-local started, for the summary's wall time.
 * Once it returns, every child it started has been reaped. */
int local_run(const struct local_plan *plan, uint64_t t0);

#endif
