/* ps-server main: parses the configuration (the only place that does) and
 * runs one shard. Exit codes follow Kubernetes restart semantics: 0 done,
 * 2 bad usage, 1-127 other permanent errors (3: checkpoints could not be
 * written --checkpoint-max-failures times in a row), 128+ retryable (129: a
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
#include "envknob.h"
#include "frame.h"
#include "http.h"
#include "log.h"
#include "net.h"
#include "server.h"
#include "shard_http.h"
#include "ucx_env.h"
#include "ucx_link.h"

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
  char on_worker_timeout[16];
  uint64_t max_frame_bytes;
  char log_level[16];
  char http[256];
  bool exit_when_done;
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

#define HTTP_DEFAULT "0.0.0.0:9090"

#define CONFIG_STRUCT struct server_config
static const struct config_option server_options[] = {
    CONFIG_CHOICE("listen", listen, "0.0.0.0:7070", net_listen_addr_check,
                  "address to accept workers on (host:port; port 0 picks a free one)"),
    CONFIG_CHOICE(
        "transport", transport, "tcp", ulink_transport_check,
        "tcp, or ucx: UCX active messages (RDMA verbs, shared memory or TCP, as UCX finds; "
        "UCX_TLS forces a set); workers must use the same"),
    CONFIG_OPT("port-file", CONFIG_STRING, port_file, "", 0, 0,
               "write the bound host:port to this file once listening (launchers, tests)"),
    CONFIG_OPT("shard", CONFIG_STRING, shard, "auto", 0, 0,
               "this shard's id: a number, or auto = pod index (PS_POD_INDEX or hostname name-N)"),
    CONFIG_OPT("num-shards", CONFIG_INT, num_shards, "1", 1, 4096, "number of shards in the job"),
    CONFIG_OPT("num-workers", CONFIG_INT, num_workers, "1", 1, 65536,
               "number of workers in the job"),
    CONFIG_CHOICE(
        "consistency", consistency, "bsp", store_consistency_check,
        "bsp (all workers' step-v gradients make version v+1), asp (each push applied on "
        "arrival) or ssp:K (asp, but no worker reads more than K clocks ahead of the slowest)"),
    CONFIG_OPT("staleness-aware", CONFIG_BOOL, staleness_aware, "true", 0, 0,
               "asp and ssp:K: account for each update's staleness (the updates applied since the "
               "parameters its gradient was computed on were pulled), as --staleness-method says"),
    CONFIG_CHOICE(
        "staleness-method", staleness_method, "lookahead", store_staleness_method_check,
        "lookahead (with --optimizer momentum: a velocity per worker, and the shard serves "
        "the parameters where the next round of pushes will take them, DANA, Hakimi et al. "
        "2019; an update staler than one round is also divided; W+1 floats of state per "
        "parameter; other optimizers divide) or divide (every update divided by its "
        "staleness + 1, Zhang et al. 2016)"),
    CONFIG_CHOICE(
        "optimizer", optimizer, "sgd", opt_check,
        "update applied to the aggregated gradient (torch.optim semantics): sgd, momentum, adam, "
        "adamw (decoupled weight decay), or sum (bsp only: the shard returns the mean gradient "
        "and the workers run the optimizer)"),
    CONFIG_OPT("lr", CONFIG_DOUBLE, lr, "0.1", 0, 1e6, "learning rate"),
    CONFIG_OPT("momentum", CONFIG_DOUBLE, momentum, "0.9", 0, 1,
               "momentum factor (--optimizer momentum)"),
    CONFIG_OPT("nesterov", CONFIG_BOOL, nesterov, "false", 0, 0,
               "Nesterov momentum (--optimizer momentum)"),
    CONFIG_OPT("weight-decay", CONFIG_DOUBLE, weight_decay, "0", 0, 1,
               "weight decay: an L2 term added to the gradient (sgd, momentum, adam), or decoupled "
               "p *= 1 - lr * wd (adamw; torch's AdamW default is 0.01)"),
    CONFIG_OPT("beta1", CONFIG_DOUBLE, beta1, "0.9", 0, 0.999999, "Adam's first-moment decay"),
    CONFIG_OPT("beta2", CONFIG_DOUBLE, beta2, "0.999", 0, 0.999999, "Adam's second-moment decay"),
    CONFIG_OPT("eps", CONFIG_DOUBLE, eps, "1e-8", 0, 1, "Adam's denominator term"),
    CONFIG_OPT("lr-decay-steps", CONFIG_INT, lr_decay_steps, "0", 0, 9.2e18,
               "cosine-anneal the learning rate to 0 over this many worker steps (0 = constant)"),
    CONFIG_OPT("worker-timeout", CONFIG_DOUBLE, worker_timeout, "60", 0, 1e7,
               "seconds a worker may stay disconnected before --on-worker-timeout applies "
               "(0 = wait for it forever)"),
    CONFIG_CHOICE(
        "on-worker-timeout", on_worker_timeout, "auto", server_timeout_action_check,
        "auto: fail with --optimizer sum (the parameters live on the workers: a restarted "
        "one could not rejoin), continue with an optimizer on the shard (a restarted worker "
        "pulls the current parameters); fail: an error to every waiting request, every worker "
        "and the shard exit 129 (retryable: the job restarts); continue: go on with the live "
        "workers, averaging over those that pushed, never silently (an error line, "
        "ps_server_workers_lost_total, the stats' lost ranks); a worker that comes back rejoins"),
    CONFIG_OPT("max-frame-bytes", CONFIG_SIZE, max_frame_bytes, "64MiB", 4, 4294967295.0,
               "largest payload of one frame; larger frames are refused before allocation"),
    CONFIG_CHOICE("log-level", log_level, "info", log_level_check,
                  "debug, info, warn, error or off"),
    CONFIG_CHOICE(
        "http", http, HTTP_DEFAULT, net_listen_addr_or_empty_check,
        "address of /metrics, /healthz and /readyz (host:port; empty = off). If the default "
        "address is taken (another shard on this host) the shard runs without it"),
    CONFIG_OPT(
        "exit-when-done", CONFIG_BOOL, exit_when_done, "true", 0, 0,
        "exit 0 once worker 0 ends the training; false = stop serving workers but keep "
        "/metrics up until SIGTERM (Kubernetes restarts a StatefulSet container that exits)"),
    CONFIG_CHOICE(
        "checkpoint-dir", checkpoint_dir, "", ckpt_dir_check,
        "directory of this shard's checkpoints (empty = none; created if missing, must be "
        "writable): this job's newest valid one is loaded at start, SIGTERM finishes started "
        "steps and writes a final one"),
    CONFIG_OPT("checkpoint-every", CONFIG_INT, checkpoint_every, "0", 0, 9.2e18,
               "write a checkpoint every this many versions (bsp: steps), from a writer thread "
               "(0 = only the final one)"),
    CONFIG_OPT(
        "checkpoint-max-failures", CONFIG_INT, checkpoint_max_failures, "3", 0, 1000000,
        "checkpoint writes failing this many times in a row (full or read-only disk) stop the "
        "job: an error to every waiting request, the shard exits 3 (permanent: the volume needs "
        "an operator); 0 = train on without checkpoints (each failure still logged, counted)"),
    CONFIG_CHOICE(
        "job-id", job_id, "", ckpt_job_id_check,
        "this job's name, written into its checkpoints (printable, at most 64 bytes): only "
        "this job's are loaded and pruned, another job's in the same directory (a reused "
        "volume) are reported and left alone. Empty = the unnamed job (and format-1 files)"),
    CONFIG_OPT(
        "auth-token-file", CONFIG_STRING, auth_token_file, "", 0, 0,
        "file holding the job's shared secret (16..4096 bytes; a Kubernetes Secret): workers "
        "must prove it and every frame is authenticated. Empty = anyone can connect (warned)"),
    CONFIG_OPT("reject-nonfinite", CONFIG_BOOL, reject_nonfinite, "true", 0, 0,
               "refuse (and count) pushed gradients and initial values holding NaN or Inf"),
    CONFIG_OPT("max-connections", CONFIG_INT, max_connections, "1024", 1, 1000000,
               "connections open at once; more are closed at accept"),
    CONFIG_OPT("max-output-queue-bytes", CONFIG_SIZE, max_output_queue_bytes, "256MiB", 65536,
               1099511627776.0,
               "replies queued for one client that does not read them: above 1/4 of this the shard "
               "stops reading from it, above all of it the connection is closed"),
    CONFIG_OPT("max-waiting-pulls", CONFIG_INT, max_waiting_pulls, "65536", 1, 100000000,
               "pulls that may wait for a version on one connection"),
    CONFIG_OPT("handshake-timeout", CONFIG_DOUBLE, handshake_timeout, "10", 0, 1e6,
               "seconds a new connection has to finish hello (and authentication); 0 = no limit"),
    CONFIG_OPT("frame-timeout", CONFIG_DOUBLE, frame_timeout, "60", 0, 1e6,
               "seconds a frame may take to arrive once its first byte came (slow senders); 0 = no "
               "limit"),
    CONFIG_OPT("idle-timeout", CONFIG_DOUBLE, idle_timeout, "300", 0, 1e7,
               "seconds a connection may send nothing while no request of it waits; 0 = no limit"),
    CONFIG_OPT("tcp-user-timeout", CONFIG_DOUBLE, tcp_user_timeout, "60", 0, 3600,
               "seconds sent data may stay unacknowledged before the connection breaks "
               "(TCP_USER_TIMEOUT); 0 = kernel default"),
};

static const struct config_spec server_spec = {
    "ps-server",
    "a parameter-server shard: aggregates pushed gradients, applies the optimizer, serves pulls",
    server_options, sizeof(server_options) / sizeof(server_options[0])};

/* Starts /metrics, /healthz and /readyz. A taken default address is not an
 * error (several shards on one host); an address the user chose is. */
static int start_http(const struct server_config *cfg, uint32_t shard, struct shard_http **out) {
  struct shard_http_opts ho = {.listen = cfg->http,
                               .shard = shard,
                               .num_shards = (uint32_t)cfg->num_shards,
                               .num_workers = (uint32_t)cfg->num_workers,
                               .ucx = ulink_transport_parse(cfg->transport, NULL, 0) == 1};
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
  /* UCX's settings (environment only) are settings too: a bad one exits 2
   * here, not 1 from inside server_run with the runtime failures. */
  char uerr[512];
  if (ulink_transport_parse(cfg.transport, NULL, 0) == 1 && ucx_env_check(uerr, sizeof(uerr)) < 0) {
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
      .ucx = ulink_transport_parse(cfg.transport, NULL, 0) == 1,
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
  };
  r = server_run(&o);
  auth_token_free(token);
  if (r == 0 && shard_http_done(sh) && !cfg.exit_when_done) {
    log_info("training done, serving /metrics until SIGTERM", "exit_when_done=false http=%s",
             shard_http_address(sh));
    http_wait_signal();
  }
  shard_http_stop(sh);
  if (r == -ENOTCONN) return 129; /* a lost peer: retryable (DESIGN.md §3) */
  if (r == -ESTALE) return 3;     /* the job's state is lost: restart all of it (lost.c) */
  if (r == -EIO) return 3;        /* checkpoints cannot be written: permanent */
  return r == 0 ? 0 : 1;
}
