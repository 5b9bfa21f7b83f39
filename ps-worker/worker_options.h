/* worker_options: ps-worker's configuration, the one table of its options (the
 * struct, the table and the checks of its values), linkable so that
 * ps-local forwards these entries instead of re-declaring them and the
 * Python package reads them from `ps-worker --help=json`. Only main.c
 * parses (config_parse(&worker_spec, ...)); the rest takes const pointers. */
#ifndef PS_WORKER_WORKER_OPTIONS_H
#define PS_WORKER_WORKER_OPTIONS_H

#include <stdbool.h>
#include <stdint.h>

#include "config.h"

#define MAX_SHARDS 1024

struct worker_config {
  char sync_mode[16];
  char transport[8];
  char servers[8192];
  char server_template[256];
  int64_t num_shards;
  char rank[64];
  int64_t world_size;
  char data[1024];
  char model[256];
  char device[16];
  int64_t epochs;
  int64_t batch_size;
  int64_t seed;
  int64_t max_steps;
  int64_t log_every;
  char dump_params[1024];
  char job_id[128];
  int64_t connect_timeout_ms;
  uint64_t chunk_bytes;
  bool grad_blocks;
  char log_level[16];
  char http[256];
  bool exit_when_done;
  char peers[8192];
  char peer_template[256];
  char peer_listen[300];
  int64_t peer_listen_fd;
  char allreduce_backend[16];
  char allreduce_algorithm[16];
  char node_name[256];
  uint64_t fusion_bytes;
  bool shard_optimizer_state;
  double lr;
  double momentum;
  int64_t lr_decay_steps;
  int64_t peer_timeout_ms;
  char checkpoint_dir[1024];
  int64_t checkpoint_every;
  int64_t checkpoint_max_failures;
  char auth_token_file[1024];
  char blas_kernel[32];
  /* model parallelism (issue 32; main3d.c) */
  int64_t tensor_parallel;
  int64_t pipeline_stages;
  int64_t micro_batches;
  char pipeline_schedule[16];
  int64_t pipeline_chunks;
};

/* --allreduce-algorithm's values, in this order. */
enum { ALGO_AUTO, ALGO_RING, ALGO_NODE_FIRST, WORKER_NUM_ALGOS };
extern const char *const worker_algo_names[WORKER_NUM_ALGOS];

/* --pipeline-schedule's values (pipeline.h's names), in ps_pipe_schedule's order. */
enum { WORKER_NUM_SCHEDULES = 4 };
extern const char *const worker_schedule_names[WORKER_NUM_SCHEDULES];

/* ps-worker's options: flags, PS_* environment and --config file. */
extern const struct config_spec worker_spec;

#endif
