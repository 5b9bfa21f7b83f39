/* ps-worker main: parses the configuration (the only place that does),
 * loads the data, builds the model, connects the sync backend and trains.
 * --sync-mode ps pushes and pulls through the shards (sync_ps.c);
 * --sync-mode allreduce forms a ring of the workers (collective.h), averages
 * gradients by all-reduce over TCP or NCCL and runs the optimizer on every
 * worker (sync_ring.c). Options of the other mode are ignored, so one config
 * map can hold both. Before any product, --blas-kernel picks OpenBLAS's kernel
 * (blas_kernel.h: the process may re-execute itself once for it) and the
 * start line says which kernel runs, why and how fast. Exit codes follow Kubernetes restart
 * semantics: 0 done; 2 bad usage; 1 other permanent errors (bad data, layout refused); 3 the
 * job's state is lost (PS_ERR_STATE_LOST: restart every shard and worker); 129 retryable (a
 * shard or peer was lost or never came up). */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "blas_kernel.h"
#include "collective.h"
#include "collective_nccl.h"
#include "config.h"
#include "data.h"
#include "device.h"
#include "http.h"
#include "log.h"
#include "main3d.h"
#include "model.h"
#include "worker_options.h"
#include "net.h"
#include "ps.h"
#include "sync_ps.h"
#include "sync_ring.h"
#include "trainer.h"
#include "ucx_env.h"
#include "ucx_link.h"
#include "worker_ckpt.h"
#include "worker_http.h"

#define EXIT_PERMANENT 1
#define EXIT_USAGE 2
#define EXIT_RETRY 129
#define EXIT_JOB_LOST 3 /* the job's state is lost: restart every shard and worker */

/* Builds the shard list from --servers or --server-template/--num-shards. */
static int shard_list(const struct worker_config *cfg, char (*addrs)[300], int *n) {
  if (cfg->servers[0] && cfg->server_template[0]) {
    fprintf(stderr, "ps-worker: options --servers and --server-template exclude each other\n");
    return -EINVAL;
  }
  if (cfg->server_template[0]) {
    if (cfg->num_shards < 1) {
      fprintf(stderr, "ps-worker: option --server-template needs --num-shards >= 1\n");
      return -EINVAL;
    }
    for (int i = 0; i < cfg->num_shards; i++) {
      if (net_expand_template(cfg->server_template, i, addrs[i], sizeof(addrs[i])) < 0) {
        fprintf(stderr, "ps-worker: option --server-template: \"%s\" has no {i}\n",
                cfg->server_template);
        return -EINVAL;
      }
    }
    *n = (int)cfg->num_shards;
    return 0;
  }
  if (!cfg->servers[0]) {
    fprintf(stderr, "ps-worker: --sync-mode ps needs --servers or --server-template\n");
    return -EINVAL;
  }
  struct net_addr parsed[MAX_SHARDS];
  char err[256];
  int count = net_parse_addr_list(cfg->servers, parsed, MAX_SHARDS, err, sizeof(err));
  if (count < 0) {
    fprintf(stderr, "ps-worker: option --servers: %s\n", err);
    return -EINVAL;
  }
  if (cfg->num_shards && cfg->num_shards != count) {
    fprintf(stderr, "ps-worker: option --num-shards %lld disagrees with %d --servers\n",
            (long long)cfg->num_shards, count);
    return -EINVAL;
  }
  for (int i = 0; i < count; i++) {
    int len =
        snprintf(addrs[i], sizeof(addrs[i]), strchr(parsed[i].host, ':') ? "[%s]:%u" : "%s:%u",
                 parsed[i].host, parsed[i].port);
    if (len < 0 || (size_t)len >= sizeof(addrs[i])) {
      fprintf(stderr, "ps-worker: option --servers: element %d is too long\n", i);
      return -EINVAL;
    }
  }
  *n = count;
  return 0;
}

/* Builds the ring peer list (world entries, freed by the caller) from
 * --peers or --peer-template. A single worker needs none. */
static int peer_list(const struct worker_config *cfg, char ***out) {
  int world = (int)cfg->world_size;
  *out = NULL;
  if (cfg->peers[0] && cfg->peer_template[0]) {
    fprintf(stderr, "ps-worker: options --peers and --peer-template exclude each other\n");
    return -EINVAL;
  }
  if (!cfg->peers[0] && !cfg->peer_template[0]) {
    if (world == 1) return 0;
    fprintf(stderr,
            "ps-worker: --sync-mode allreduce (or --tensor-parallel x --pipeline-stages > 1) with "
            "--world-size %d needs --peers or --peer-template\n",
            world);
    return -EINVAL;
  }
  char **list = calloc((size_t)world, sizeof(char *));
  struct net_addr *parsed = NULL;
  if (!list) return -ENOMEM;
  int ret = -EINVAL;
  if (cfg->peer_template[0]) {
    for (int i = 0; i < world; i++) {
      char addr[300], err[256];
      struct net_addr a;
      if (net_expand_template(cfg->peer_template, i, addr, sizeof(addr)) < 0) {
        fprintf(stderr, "ps-worker: option --peer-template: \"%s\" needs exactly one {i}\n",
                cfg->peer_template);
        goto out;
      }
      if (net_parse_addr(addr, &a, 0, err, sizeof(err)) < 0) {
        fprintf(stderr, "ps-worker: option --peer-template: rank %d: %s\n", i, err);
        goto out;
      }
      if (!(list[i] = strdup(addr))) goto nomem;
    }
  } else {
    char err[256];
    parsed = calloc((size_t)world + 1, sizeof(*parsed));
    if (!parsed) goto nomem;
    int n = net_parse_addr_list(cfg->peers, parsed, world + 1, err, sizeof(err));
    if (n < 0) {
      fprintf(stderr, "ps-worker: option --peers: %s\n", err);
      goto out;
    }
    if (n != world) {
      fprintf(stderr, "ps-worker: option --peers lists %d address%s but --world-size is %d\n", n,
              n == 1 ? "" : "es", world);
      goto out;
    }
    for (int i = 0; i < world; i++) {
      char addr[300];
      snprintf(addr, sizeof(addr), strchr(parsed[i].host, ':') ? "[%s]:%u" : "%s:%u",
               parsed[i].host, parsed[i].port);
      if (!(list[i] = strdup(addr))) goto nomem;
    }
  }
  free(parsed);
  *out = list;
  return 0;
nomem:
  ret = -ENOMEM;
  fprintf(stderr, "ps-worker: out of memory\n");
out:
  free(parsed);
  for (int i = 0; i < world; i++) free(list[i]);
  free(list);
  return ret;
}

static void free_list(char **list, int n) {
  for (int i = 0; list && i < n; i++) free(list[i]);
  free(list);
}

static int dump_params(const char *path, struct mlp *m) {
  FILE *f = fopen(path, "wb");
  if (!f) return -errno;
  for (int t = 0; t < mlp_num_tensors(m); t++)
    fwrite(mlp_param(m, t), sizeof(float), mlp_tensor_count(m, t), f);
  return fclose(f) == 0 ? 0 : -EIO;
}

/* Forms the ring (and NCCL), broadcasts rank 0's parameters and binds the
 * all-reduce backend into sync. Returns 0 or the exit code after logging why. */
static int start_allreduce(const struct worker_config *cfg, int rank, char **peers, bool use_nccl,
                           const ps_token *token, struct mlp *m, ps_coll **coll,
                           struct ps_nccl **nccl, struct sync_ring **sr, struct trainer_sync *sync,
                           uint64_t *start_step) {
  char err[512];
  struct ps_coll_opts po = worker_coll_opts(cfg, rank, peers, token);
  po.node_first = !use_nccl && strcmp(cfg->allreduce_algorithm, "ring");
  ps_status st = ps_coll_open(&po, coll, err, sizeof(err));
  if (st != PS_OK) {
    log_error("cannot form the ring", "error=\"%s\"", err);
    return st == PS_ERR_CONNECT ? EXIT_RETRY : EXIT_PERMANENT;
  }
  if (use_nccl) {
    st = ps_nccl_open(*coll, nccl, err, sizeof(err));
    if (st != PS_OK) {
      log_error("cannot start the NCCL backend", "error=\"%s\"", err);
      return st == PS_ERR_IO ? EXIT_RETRY : EXIT_PERMANENT;
    }
  }
  struct sync_ring_opts ro = {.lr = cfg->lr,
                              .momentum = (float)cfg->momentum,
                              .lr_decay_steps = (uint64_t)cfg->lr_decay_steps,
                              .fusion_bytes = cfg->fusion_bytes,
                              .shard_state = cfg->shard_optimizer_state,
                              .ckpt_dir = cfg->checkpoint_dir[0] ? cfg->checkpoint_dir : NULL,
                              .ckpt_every = (uint64_t)cfg->checkpoint_every,
                              .ckpt_max_failures = (uint32_t)cfg->checkpoint_max_failures,
                              .ckpt_id = {.rank = (uint32_t)rank,
                                          .world = (uint32_t)cfg->world_size,
                                          .batch = (uint32_t)cfg->batch_size,
                                          .seed = (uint64_t)cfg->seed}};
  int r = sync_ring_open(*coll, *nccl, &ro, m, sr);
  if (r == 0) r = sync_ring_resume(*sr, m, start_step);
  if (r < 0) return r == -ECONNRESET ? EXIT_RETRY : EXIT_PERMANENT;
  size_t bucket_bytes[8];
  int nb = sync_ring_buckets(*sr, bucket_bytes, 8);
  char desc[160] = "";
  for (int i = 0, len = 0; i < nb && i < 8 && len < (int)sizeof(desc); i++)
    len += snprintf(desc + len, sizeof(desc) - (size_t)len, "%s%zu", i ? "," : "", bucket_bytes[i]);
  log_info("training",
           "sync_mode=allreduce backend=%s rank=%d world_size=%lld model=%s "
           "params=%zu batch=%lld epochs=%lld lr=%g momentum=%g buckets=%d bucket_bytes=%s%s "
           "shard_optimizer_state=%d optimizer_state_bytes=%zu",
           cfg->allreduce_backend, rank, (long long)cfg->world_size, cfg->model, mlp_num_params(m),
           (long long)cfg->batch_size, (long long)cfg->epochs, cfg->lr, cfg->momentum, nb, desc,
           nb > 8 ? ",..." : "", cfg->shard_optimizer_state, sync_ring_state_bytes(*sr));
  sync_ring_bind(*sr, sync);
  return 0;
}

/* Connects to the shards, declares the layout (rank 0 also initialises it)
 * and binds the PS-mode backend into sync. Returns 0 or the exit code after
 * logging why. */
static int start_ps(const struct worker_config *cfg, int rank, char (*addrs)[300], int num_shards,
                    const ps_token *token, struct mlp *m, ps_client **c, struct sync_ps **sp,
                    struct trainer_sync *sync) {
  int code = worker_connect_shards(cfg, rank, addrs, num_shards, token, mlp_num_params(m), c);
  if (code != 0) return code;
  int r = sync_ps_open(*c, rank, m, sp);
  if (r < 0) return r == -ECONNRESET ? EXIT_RETRY : EXIT_PERMANENT;
  log_info("training",
           "sync_mode=ps rank=%d world_size=%lld shards=%d model=%s params=%zu "
           "batch=%lld epochs=%lld",
           rank, (long long)cfg->world_size, num_shards, cfg->model, mlp_num_params(m),
           (long long)cfg->batch_size, (long long)cfg->epochs);
  sync_ps_bind(*sp, sync);
  return 0;
}

/* Loads the data (the test set on rank 0 only), opens the model on its
 * device and loads the seeded initial parameters onto it. Returns 0, or -1
 * after logging why (a permanent error: a restart would not give this
 * machine the data, a GPU or this build CUDA). */
static int open_model(const struct worker_config *cfg, int rank, const struct device_opts *dopts,
                      const int *sizes, int num_sizes, struct dataset *train, struct dataset *test,
                      struct device_model **dm) {
  char err[512];
  if (dataset_load(cfg->data, "train", train, err, sizeof(err)) < 0 ||
      (rank == 0 && dataset_load(cfg->data, "t10k", test, err, sizeof(err)) < 0)) {
    log_error("cannot load data",
              "error=\"%s\" hint=\"install dataset-fashion-mnist or pass --data\"", err);
    return -1;
  }
  if ((uint32_t)sizes[0] != train->rows * train->cols ||
      sizes[num_sizes - 1] != DATASET_NUM_CLASSES) {
    log_error("model does not fit the data", "model=%s inputs=%u classes=%d", cfg->model,
              train->rows * train->cols, DATASET_NUM_CLASSES);
    return -1;
  }
  if (device_model_open(dopts, sizes, num_sizes, (int)cfg->batch_size, dm, err, sizeof(err)) < 0) {
    log_error("cannot set up the model", "option=--device device=%s model=%s error=\"%s\"",
              cfg->device, cfg->model, err);
    return -1;
  }
  mlp_init_params(device_model_host(*dm), (uint64_t)cfg->seed);
  if (device_model_load_params(*dm) < 0) {
    log_error("cannot load the parameters onto the device", "error=\"%s\"",
              device_model_errmsg(*dm));
    return -1;
  }
  log_info("device", "device=\"%s\"", device_model_name(*dm));
  return 0;
}

/* Picks the BLAS kernel (this may re-execute the worker, which starts over
 * with the same argv) and logs the start line naming it. Returns 0, or -1
 * after saying why (a bad --blas-kernel: the CPU changed under the check). */
static int select_blas(const struct worker_config *cfg, char **argv) {
  ps_blas_info b;
  char err[300], blas[96], cpu[96], was[48] = "";
  if (ps_blas_select(cfg->blas_kernel, argv, &b, err, sizeof(err)) != PS_OK) {
    fprintf(stderr, "ps-worker: option --blas-kernel: %s\n", err);
    return -1;
  }
  if (b.was[0]) snprintf(was, sizeof(was), " was=%s", b.was);
  log_info("blas", "blas=%s kernel=%s why=%s%s gflops=%.1f cpu=%s",
           log_quote(blas, sizeof(blas), b.blas), b.kernel, b.why, was, b.gflops,
           log_quote(cpu, sizeof(cpu), b.cpu));
  return 0;
}

/* Rank 0's summary line on stdout (what ps-local and the tests read), and
 * every rank's closing log line. Both say how many workers the shards went
 * on without (sp NULL: allreduce mode, where a lost rank fails the ring);
 * rank 0 names them at error level, since the job then did not train on
 * all its data. */
static void report(int rank, const struct trainer_result *res, const struct sync_ps *sp) {
  const int *lost = NULL;
  int n_lost = sp ? sync_ps_lost_workers(sp, &lost) : 0;
  char count[16] = "unknown";
  if (n_lost >= 0) snprintf(count, sizeof(count), "%d", n_lost);
  if (rank == 0) {
    printf("summary accuracy=%.4f epochs=%d wall_s=%.2f samples_per_s=%.0f workers_lost=%s\n",
           (double)res->accuracy, res->epochs_done, res->wall_s, res->samples_per_s, count);
    fflush(stdout);
  }
  if (rank == 0 && n_lost > 0) {
    char ranks[400] = "";
    for (int i = 0, len = 0; i < n_lost && i < SYNC_PS_LOST_MAX && len < (int)sizeof(ranks); i++)
      len += snprintf(ranks + len, sizeof(ranks) - (size_t)len, "%s%d", i ? "," : "", lost[i]);
    log_error("the job went on without workers: their data was not all trained on",
              "workers_lost=%d ranks=%s%s", n_lost, ranks, n_lost > SYNC_PS_LOST_MAX ? ",..." : "");
  }
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  log_info("done",
           "steps=%" PRIu64
           " wall_s=%.2f wait_s=%.2f eval_s=%.2f samples_per_s=%.0f max_rss_mb=%.1f "
           "workers_lost=%s",
           res->steps, res->wall_s, res->wait_s, res->eval_s, res->samples_per_s,
           (double)ru.ru_maxrss / 1024.0, count);
}

/* SIGTERM/SIGINT end the worker at once with 128 + the signal (retryable).
 * The default action would do the same, except in a container, where the
 * worker is PID 1 and the kernel ignores signals it has no handler for: the
 * pod would then sit out its whole termination grace period. */
static void on_stop_signal(int sig) {
  _exit(128 + sig);
}

static int start_http(const struct worker_config *cfg, int rank, struct worker_http **out) {
  struct worker_http_opts ho = {.listen = cfg->http,
                                .sync_mode = cfg->sync_mode,
                                .transport = cfg->transport,
                                .rank = rank,
                                .world_size = (int)cfg->world_size,
                                .batch = (int)cfg->batch_size};
  char err[300];
  int r = worker_http_start(&ho, out, err, sizeof(err));
  if (r < 0) {
    fprintf(stderr, "ps-worker: option --http: %s\n", err);
    return r;
  }
  if (cfg->http[0]) log_info("http listening", "addr=%s", worker_http_address(*out));
  return 0;
}

int main(int argc, char **argv) {
  struct worker_config cfg;
  memset(&cfg, 0, sizeof(cfg));
  int r = config_parse(&worker_spec, &cfg, argc, argv, NULL, stderr);
  if (r == CONFIG_HELP || r == CONFIG_VERSION) return 0;
  if (r < 0) return EXIT_USAGE;
  if (cfg.connect_timeout_ms == 0) {
    /* libps reads 0 as its own default (30 s to the shards, 60 s to the
     * ring): a silent wait nobody asked for. */
    fprintf(stderr,
            "ps-worker: option --connect-timeout-ms: 0 is not a deadline (-1 = forever, or "
            "1..1000000000 ms)\n");
    return EXIT_USAGE;
  }
  /* The enumerated values passed their owners' checks in the table. */
  enum log_level level;
  log_level_parse(cfg.log_level, &level);
  ps_sync_mode mode;
  ps_coll_backend backend;
  ps_sync_mode_parse(cfg.sync_mode, &mode, NULL, 0);
  ps_coll_backend_parse(cfg.allreduce_backend, &backend, NULL, 0);
  bool allreduce = mode == PS_SYNC_ALLREDUCE, use_nccl = backend == PS_COLL_NCCL;
  char uerr[512]; /* UCX's settings (environment only) exit 2 as options do */
  if (!allreduce && ulink_transport_parse(cfg.transport, NULL, 0) == 1 &&
      ucx_env_check(uerr, sizeof(uerr)) < 0) {
    fprintf(stderr, "ps-worker: %s\n", uerr);
    return EXIT_USAGE;
  }
  int rank;
  int64_t rank_index;
  if (config_pod_index(cfg.rank, "ps-worker", "rank", cfg.world_size, "--world-size", stderr,
                       &rank_index) < 0)
    return EXIT_USAGE;
  rank = (int)rank_index;
  static char addrs[MAX_SHARDS][300];
  int num_shards = 0;
  char **peers = NULL;
  if (!allreduce && (cfg.checkpoint_dir[0] || cfg.checkpoint_every)) {
    fprintf(stderr,
            "ps-worker: options --checkpoint-dir and --checkpoint-every: allreduce only "
            "(in ps mode the shards checkpoint: ps-server --checkpoint-dir)\n");
    return EXIT_USAGE;
  }
  if (cfg.shard_optimizer_state && (!allreduce || use_nccl || cfg.checkpoint_dir[0])) {
    fprintf(stderr, "ps-worker: option --shard-optimizer-state: %s\n",
            !allreduce ? "allreduce only (in ps mode the shards hold the optimizer state)"
            : use_nccl ? "not with --allreduce-backend nccl yet (tcp only)"
                       : "not with --checkpoint-dir yet (the checkpoints hold whole velocities)");
    return EXIT_USAGE;
  }
  if (config_choice(cfg.allreduce_algorithm, worker_algo_names, WORKER_NUM_ALGOS, NULL, 0) ==
          ALGO_NODE_FIRST &&
      (!cfg.node_name[0] || use_nccl)) {
    fprintf(stderr, "ps-worker: option --allreduce-algorithm node-first: %s\n",
            use_nccl ? "tcp only (NCCL picks its own rings and trees)"
                     : "needs --node-name (the node this rank runs on)");
    return EXIT_USAGE;
  }
  if (cfg.checkpoint_every && !cfg.checkpoint_dir[0]) {
    fprintf(stderr, "ps-worker: option --checkpoint-every: needs --checkpoint-dir\n");
    return EXIT_USAGE;
  }
  int sizes[MLP_MAX_SIZES], num_sizes;
  char err[512];
  if (mlp_parse_spec(cfg.model, sizes, MLP_MAX_SIZES, &num_sizes, err, sizeof(err)) < 0) {
    fprintf(stderr, "ps-worker: option --model: %s\n", err);
    return EXIT_USAGE;
  }
  if (main3d_check(&cfg, allreduce, sizes, num_sizes) < 0) return EXIT_USAGE;
  if (!allreduce && shard_list(&cfg, addrs, &num_shards) < 0) return EXIT_USAGE;
  if (main3d_needs_peers(&cfg, allreduce) && peer_list(&cfg, &peers) < 0) return EXIT_USAGE;
  struct device_opts dopts = {.kind = DEVICE_AUTO, .gpu = rank}; /* rank mod GPUs, as NCCL */
  device_kind_parse(cfg.device, &dopts.kind);
  char proc[32];
  snprintf(proc, sizeof(proc), "ps-worker-%d", rank);
  log_setup(proc, level);
  if (select_blas(&cfg, argv) < 0) return EXIT_USAGE;
  signal(SIGPIPE, SIG_IGN);
  signal(SIGTERM, on_stop_signal);
  signal(SIGINT, on_stop_signal);
  ps_token *token = NULL;
  if (cfg.auth_token_file[0] &&
      ps_token_load(cfg.auth_token_file, &token, err, sizeof(err)) != PS_OK) {
    fprintf(stderr, "ps-worker: option --auth-token-file: %s\n", err);
    return EXIT_USAGE;
  }
  if (!token && !allreduce) { /* the ring says it itself (ps_coll_open) */
    log_warn(
        "AUTHENTICATION IS OFF: this worker talks to anyone at the shard addresses and "
        "believes what comes back; set --auth-token-file",
        "auth_token_file=%s", "none");
  }
  /* A checkpoint directory that cannot be created or written is a bad
   * setting, found now rather than at every checkpoint. */
  if (allreduce && cfg.checkpoint_dir[0] &&
      worker_ckpt_prepare(cfg.checkpoint_dir, (uint32_t)rank, err, sizeof(err)) < 0) {
    fprintf(stderr, "ps-worker: option --checkpoint-dir: %s\n", err);
    ps_token_free(token);
    free_list(peers, (int)cfg.world_size);
    return EXIT_USAGE;
  }
  struct worker_http *wh = NULL;
  if ((r = start_http(&cfg, rank, &wh)) < 0) {
    ps_token_free(token);
    free_list(peers, (int)cfg.world_size);
    return r == -EINVAL ? EXIT_USAGE : EXIT_PERMANENT;
  }

  int exit_code = EXIT_PERMANENT;
  struct dataset train = {0}, test = {0};
  struct device_model *dm = NULL;
  struct mlp *m = NULL; /* dm's host mirror: what the sync backends read and write */
  ps_client *c = NULL;
  struct sync_ps *sp = NULL;
  ps_coll *coll = NULL;
  struct ps_nccl *nccl = NULL;
  struct sync_ring *sr = NULL;
  struct trainer_sync sync;
  uint64_t start_step = 0;
  if (main3d_wanted(&cfg)) {
    struct trainer_result res3;
    struct mlp *full = NULL;
    exit_code = main3d_run(&cfg, rank, allreduce, peers, addrs, num_shards, token, sizes, num_sizes,
                           wh, &res3, &full);
    if (exit_code == 0 && full && cfg.dump_params[0] &&
        (r = dump_params(cfg.dump_params, full)) < 0) {
      log_error("cannot write --dump-params", "path=\"%s\" error=\"%s\"", cfg.dump_params,
                strerror(-r));
      exit_code = EXIT_PERMANENT;
    }
    mlp_free(full);
    if (exit_code == 0) {
      report(rank, &res3, NULL);
      worker_http_done(wh);
    }
    goto out;
  }
  if (open_model(&cfg, rank, &dopts, sizes, num_sizes, &train, &test, &dm) < 0) goto out;
  m = device_model_host(dm);
  exit_code = allreduce ? start_allreduce(&cfg, rank, peers, use_nccl, token, m, &coll, &nccl, &sr,
                                          &sync, &start_step)
                        : start_ps(&cfg, rank, addrs, num_shards, token, m, &c, &sp, &sync);
  if (exit_code != 0) goto out;
  exit_code = EXIT_PERMANENT;
  worker_http_watch_client(wh, c); /* NULL in allreduce mode: the ring is formed */
  if (sr) worker_http_set_state_bytes(wh, sync_ring_state_bytes(sr));
  worker_http_wrap_sync(wh, &sync);
  struct trainer_opts to = {.train = &train,
                            .test = rank == 0 ? &test : NULL,
                            .rank = rank,
                            .world_size = (int)cfg.world_size,
                            .batch = (int)cfg.batch_size,
                            .epochs = (int)cfg.epochs,
                            .seed = (uint64_t)cfg.seed,
                            .max_steps = (uint64_t)cfg.max_steps,
                            .start_step = start_step,
                            .log_every = (int)cfg.log_every,
                            .progress = rank == 0,
                            .grad_blocks = cfg.grad_blocks};
  struct trainer_result res;
  r = trainer_run(&to, dm, &sync, &res);
  if (r < 0) {
    exit_code = r == -ECONNRESET ? EXIT_RETRY : r == -ESTALE ? EXIT_JOB_LOST : EXIT_PERMANENT;
    goto out;
  }
  if (rank == 0 && cfg.dump_params[0] && (r = dump_params(cfg.dump_params, m)) < 0) {
    log_error("cannot write --dump-params", "path=\"%s\" error=\"%s\"", cfg.dump_params,
              strerror(-r));
    goto out;
  }
  report(rank, &res, sp);
  worker_http_done(wh);
  exit_code = 0;
out:
  sync_ring_close(sr);
  ps_nccl_close(nccl);
  ps_coll_close(coll);
  free_list(peers, (int)cfg.world_size);
  sync_ps_close(sp);
  worker_http_watch_client(wh, NULL);
  ps_client_free(c);
  device_model_close(dm);
  dataset_free(&train);
  dataset_free(&test);
  if (exit_code == 0 && !cfg.exit_when_done) {
    log_info("training done, serving /metrics until SIGTERM", "exit_when_done=false http=%s",
             worker_http_address(wh));
    http_wait_signal();
  }
  worker_http_stop(wh);
  ps_token_free(token);
  return exit_code;
}
