/* ps-server main: parses the configuration (the only place that does) and
 * runs one shard. Exit codes follow Kubernetes restart semantics: 0 done,
 * 2 bad usage, 1-127 other permanent errors (3: checkpoints could not be
 * written --checkpoint-max-failures times in a row; 1: no worker sent a
 * layout within --first-worker-timeout), 128+ retryable (129: a
 * worker was gone and --on-worker-timeout fail stopped the job). */
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "auth.h"
#include "ckpt_dir.h"
#include "config.h"
#include "conn_transports.h"
#include "envknob.h"
#include "frame.h"
#include "http.h"
#include "log.h"
#include "net.h"
#include "server.h"
#include "server_options.h"
#include "shard_http.h"

/* Starts /metrics, /healthz and /readyz. A taken default address is not an
 * error (several shards on one host); an address the user chose is. */
static int start_http(const struct server_config *cfg, uint32_t shard, struct shard_http **out) {
  struct shard_http_opts ho = {.listen = cfg->http,
                               .shard = shard,
                               .num_shards = (uint32_t)cfg->num_shards,
                               .num_workers = (uint32_t)cfg->num_workers,
                               .transport = cfg->transport};
  char err[300];
  int r = shard_http_start(&ho, out, err, sizeof(err));
  if (r == -EADDRINUSE && strcmp(cfg->http, HTTP_DEFAULT) == 0) {
    log_warn("no /metrics: the default --http address is in use", "addr=%s", cfg->http);
    ho.listen = "";
    r = shard_http_start(&ho, out, err, sizeof(err));
  }
  if (r < 0) {
    fprintf(stderr, "ps-server: option --http: %s\n", err);
    return r;
  }
  if (shard_http_address(*out)[0]) log_info("http listening", "addr=%s", shard_http_address(*out));
  return 0;
}

int main(int argc, char **argv) {
  struct server_config cfg;
  memset(&cfg, 0, sizeof(cfg));
  int stop_signal = 0;
  int r = config_parse(&server_spec, &cfg, argc, argv, NULL, stderr);
  if (r == CONFIG_HELP || r == CONFIG_VERSION) return 0;
  if (r < 0) return 2;
  /* A knob outside the table (ckpt_io_uring.c reads it): refused here, at
   * start, rather than as a silent fallback at the first checkpoint. */
  bool no_uring;
  char why[160];
  if (envknob_bool("PS_DISABLE_IO_URING", &no_uring, why, sizeof(why)) < 0) {
    fprintf(stderr, "ps-server: %s\n", why);
    return 2;
  }
  /* The transport's settings (environment only) are settings too: a bad one
   * exits 2 here, not 1 from inside server_run with the runtime failures. */
  char uerr[512];
  if (conn_transport_check_env(cfg.transport, uerr, sizeof(uerr)) < 0) {
    fprintf(stderr, "ps-server: %s\n", uerr);
    return 2;
  }
  /* The enumerated values passed their owners' checks in the table. */
  enum log_level level;
  enum opt_kind kind;
  enum store_consistency mode;
  uint32_t staleness;
  enum worker_timeout_action on_timeout;
  enum store_staleness_method method;
  log_level_parse(cfg.log_level, &level);
  opt_parse(cfg.optimizer, &kind);
  store_consistency_parse(cfg.consistency, &mode, &staleness);
  store_staleness_method_parse(cfg.staleness_method, &method);
  server_timeout_action_parse(cfg.on_worker_timeout, &on_timeout);
  if (kind == OPT_SUM && mode != STORE_BSP) {
    fprintf(stderr,
            "ps-server: option --optimizer: sum needs --consistency bsp (the workers "
            "apply each step's mean gradient in step order)\n");
    return 2;
  }
  if (cfg.nesterov && (kind != OPT_MOMENTUM || cfg.momentum <= 0)) {
    fprintf(stderr,
            "ps-server: option --nesterov: needs --optimizer momentum and "
            "--momentum > 0 (as torch.optim.SGD)\n");
    return 2;
  }
  uint32_t shard;
  int64_t shard_index;
  if (config_pod_index(cfg.shard, "ps-server", "shard", cfg.num_shards, "--num-shards", stderr,
                       &shard_index) < 0)
    return 2;
  shard = (uint32_t)shard_index;
  char proc[32];
  snprintf(proc, sizeof(proc), "ps-server-%u", shard);
  log_setup(proc, level);
  signal(SIGPIPE, SIG_IGN);
  struct auth_token *token = NULL;
  if (auth_token_option("ps-server", cfg.auth_token_file, &token) < 0) return 2;
  struct shard_http *sh = NULL;
  if ((r = start_http(&cfg, shard, &sh)) < 0) {
    auth_token_free(token);
    return r == -EINVAL ? 2 : 1;
  }

  struct server_opts o = {
      .listen = cfg.listen,
      .transport = cfg.transport,
      .port_file = cfg.port_file,
      .shard = shard,
      .num_shards = (uint32_t)cfg.num_shards,
      .num_workers = (uint32_t)cfg.num_workers,
      .consistency = mode,
      .staleness = staleness,
      .staleness_aware = cfg.staleness_aware,
      .staleness_method = method,
      .opt = {.kind = kind,
              .lr = cfg.lr,
              .momentum = cfg.momentum,
              .weight_decay = cfg.weight_decay,
              .nesterov = cfg.nesterov,
              .beta1 = cfg.beta1,
              .beta2 = cfg.beta2,
              .eps = cfg.eps,
              .decay_steps = (uint64_t)cfg.lr_decay_steps},
      .worker_timeout_ms = (uint64_t)(cfg.worker_timeout * 1000.0 + 0.5),
      .on_worker_timeout = on_timeout,
      .first_worker_timeout_ms = (uint64_t)(cfg.first_worker_timeout * 1000.0 + 0.5),
      .max_frame_bytes = cfg.max_frame_bytes,
      .max_header_bytes = FRAME_MAX_HEADER,
      .http = sh,
      .checkpoint_dir = cfg.checkpoint_dir,
      .checkpoint_every = (uint64_t)cfg.checkpoint_every,
      .checkpoint_max_failures = (uint32_t)cfg.checkpoint_max_failures,
      .job_id = cfg.job_id,
      .auth_token = token,
      .reject_nonfinite = cfg.reject_nonfinite,
      .max_connections = (uint32_t)cfg.max_connections,
      .handshake_timeout_ms = (uint64_t)(cfg.handshake_timeout * 1000.0 + 0.5),
      .frame_timeout_ms = (uint64_t)(cfg.frame_timeout * 1000.0 + 0.5),
      .idle_timeout_ms = (uint64_t)(cfg.idle_timeout * 1000.0 + 0.5),
      .out_queue_bytes = cfg.max_output_queue_bytes,
      .max_waiting = (uint32_t)cfg.max_waiting_pulls,
      .tcp_user_timeout_ms = (uint32_t)(cfg.tcp_user_timeout * 1000.0 + 0.5),
      .stop_signal = &stop_signal,
  };
  r = server_run(&o);
  auth_token_free(token);
  if (r == 0 && shard_http_done(sh) && !cfg.exit_when_done) {
    log_info("training done, serving /metrics until SIGTERM", "exit_when_done=false http=%s",
             shard_http_address(sh));
    http_wait_signal();
  }
  shard_http_stop(sh);
  if (r == -ENOTCONN) return 129; /* a lost peer: retryable (docs/KUBERNETES.md) */
  if (r == -ESTALE) return 3;     /* the job's state is lost: restart all of it (lost.c) */
  if (r == -EIO) return 3;        /* checkpoints cannot be written: permanent */
  if (r == -ETIMEDOUT) return 1;  /* no worker ever came: a restart would wait again */
  if (r == 0 && stop_signal && cfg.fail_on_signal) {
    log_warn("stopped by a signal before worker 0 ended the training: exiting 128+N "
             "(--fail-on-signal), so a Job runs this shard again (from its checkpoint)",
             "signal=%s exit=%d", stop_signal == SIGTERM ? "SIGTERM" : "SIGINT", 128 + stop_signal);
    return 128 + stop_signal;
  }
  return r == 0 ? 0 : 1;
}
