/* server_options: ps-server's configuration, the one table of its options
 * (the struct and the table; each enumerated value is checked by the module
 * that owns it), linkable so that ps-local forwards these entries instead of
 * re-declaring them. Only main.c parses (config_parse(&server_spec, ...)). */
#ifndef PS_SERVER_OPTIONS_H
#define PS_SERVER_OPTIONS_H

#include <stdbool.h>
#include <stdint.h>

#include "ckpt_dir.h"
#include "config.h"

#define HTTP_DEFAULT "0.0.0.0:9090"

struct server_config {
  char listen[256];
  char transport[8];
  char port_file[1024];
  char shard[64];
  int64_t num_shards;
  int64_t num_workers;
  char consistency[32];
  char optimizer[16];
  double lr;
  double momentum;
  bool nesterov;
  double weight_decay;
  double beta1, beta2, eps;
  int64_t lr_decay_steps;
  double worker_timeout;
  double first_worker_timeout;
  char on_worker_timeout[16];
  uint64_t max_frame_bytes;
  char log_level[16];
  char http[256];
  bool exit_when_done;
  bool fail_on_signal;
  char checkpoint_dir[1024];
  int64_t checkpoint_every;
  int64_t checkpoint_max_failures;
  char job_id[CKPT_JOB_MAX + 1];
  char auth_token_file[1024];
  bool reject_nonfinite;
  bool staleness_aware;
  char staleness_method[16];
  int64_t max_connections;
  uint64_t max_output_queue_bytes;
  int64_t max_waiting_pulls;
  double handshake_timeout, frame_timeout, idle_timeout, tcp_user_timeout;
};

/* ps-server's options: flags, PS_* environment and --config file. */
extern const struct config_spec server_spec;

#endif
