/* ps-worker main: parses the configuration (the only place that does),
 * loads the data, builds the model, connects the sync backend and trains.
 * Exit codes follow Kubernetes restart semantics: 0 done; 2 bad usage;
 * 1 other permanent errors (bad data, layout refused); 129 retryable (a shard
 * or peer was lost or never came up). */
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

#include "config.h"
#include "data.h"
#include "device.h"
#include "http.h"
#include "log.h"
#include "model.h"
#include "net.h"
#include "ps.h"
#include "sync_ps.h"
#include "trainer.h"
#include "worker_http.h"

#define EXIT_PERMANENT 1
#define EXIT_USAGE 2
#define EXIT_RETRY 129
#define MAX_SHARDS 1024

struct worker_config {
  char sync_mode[16];
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
  char log_level[16];
  char http[256];
  bool exit_when_done;
};

#define OPT(name, type, field, def, min, max, help) \
  {name, type, offsetof(struct worker_config, field), sizeof(((struct worker_config *)0)->field), \
   def, min, max, NULL, help}

static const struct config_option worker_options[] = {
    OPT("sync-mode", CONFIG_STRING, sync_mode, "ps", 0, 0,
        "how gradients are synchronised: ps (parameter-server shards)"),
    OPT("servers", CONFIG_STRING, servers, "", 0, 0, "shard addresses h:p,h:p (shard 0 first)"),
    OPT("server-template", CONFIG_STRING, server_template, "", 0, 0,
        "shard address with {i}, e.g. ps-server-{i}.ps-server:7070 (with --num-shards)"),
    OPT("num-shards", CONFIG_INT, num_shards, "0", 0, MAX_SHARDS,
        "number of shards for --server-template"),
    OPT("rank", CONFIG_STRING, rank, "0", 0, 0,
        "this worker's rank: a number, or auto = pod index (PS_POD_INDEX or hostname name-N)"),
    OPT("world-size", CONFIG_INT, world_size, "1", 1, 65536, "number of workers"),
    OPT("data", CONFIG_STRING, data, "/usr/share/datasets/fashion-mnist", 0, 0,
        "directory with the IDX files (train-*, t10k-*; raw or .gz)"),
    OPT("model", CONFIG_STRING, model, "mlp:784-256-10", 0, 0, "model: mlp:IN-HIDDEN...-OUT"),
    OPT("device", CONFIG_STRING, device, "auto", 0, 0,
        "where the model computes: auto (a CUDA GPU when one is usable, else the CPU), cpu or cuda"),
    OPT("epochs", CONFIG_INT, epochs, "3", 1, 100000, "passes over the training set"),
    OPT("batch-size", CONFIG_INT, batch_size, "128", 1, 65536, "samples per step on this worker"),
    OPT("seed", CONFIG_INT, seed, "1", 0, 9.2e18, "seed of the initial weights and the data order"),
    OPT("max-steps", CONFIG_INT, max_steps, "0", 0, 9.2e18, "stop after this many steps (0 = no limit)"),
    OPT("log-every", CONFIG_INT, log_every, "50", 1, 1e9,
        "steps between progress lines when stderr is not a terminal"),
    OPT("dump-params", CONFIG_STRING, dump_params, "", 0, 0,
        "write the final parameters here (raw float32, tensor order; rank 0)"),
    OPT("job-id", CONFIG_STRING, job_id, "ps-job", 0, 0, "job name shown to the shards"),
    OPT("connect-timeout-ms", CONFIG_INT, connect_timeout_ms, "60000", -1, 1e9,
        "how long to keep trying to reach the shards at start (-1 = forever)"),
    OPT("chunk-bytes", CONFIG_SIZE, chunk_bytes, "0", 0, 1073741824.0,
        "largest key: tensors are cut into chunks of at most this size; 0 = auto: 4 MiB, or "
        "less so that a model smaller than 4 MiB per shard still spreads over every shard"),
    OPT("log-level", CONFIG_STRING, log_level, "info", 0, 0, "debug, info, warn, error or off"),
    OPT("http", CONFIG_STRING, http, "", 0, 0,
        "address of /metrics, /healthz and /readyz (host:port, e.g. 0.0.0.0:9091; empty = off)"),
    OPT("exit-when-done", CONFIG_BOOL, exit_when_done, "true", 0, 0,
        "exit 0 when training is done; false = release everything but keep /metrics up until "
        "SIGTERM (Kubernetes restarts a StatefulSet container that exits, even with 0)"),
};

static const struct config_spec worker_spec = {
    "ps-worker", "a data-parallel training worker (Fashion-MNIST MLP on CPU via BLAS)",
    worker_options, sizeof(worker_options) / sizeof(worker_options[0])};

static int resolve_rank(const char *s, int64_t world, int *out) {
  char host[256] = "";
  const char *src = s;
  if (strcmp(s, "auto") == 0) {
    src = getenv("PS_POD_INDEX");
    if (!src || !*src) {
      if (gethostname(host, sizeof(host) - 1) != 0) return -EINVAL;
      char *dash = strrchr(host, '-');
      if (!dash) {
        fprintf(stderr, "ps-worker: option --rank: auto, but hostname \"%s\" has no -N suffix "
                        "and PS_POD_INDEX is unset\n", host);
        return -EINVAL;
      }
      src = dash + 1;
    }
  }
  char *end;
  errno = 0;
  long long v = strtoll(src, &end, 10);
  if (errno || end == src || *end || v < 0 || v >= world) {
    fprintf(stderr, "ps-worker: option --rank: \"%s\" is not a rank in [0, %lld) (--world-size)\n",
            src, (long long)world);
    return -EINVAL;
  }
  *out = (int)v;
  return 0;
}

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
  for (int i = 0; i < count; i++)
    snprintf(addrs[i], sizeof(addrs[i]), strchr(parsed[i].host, ':') ? "[%s]:%u" : "%s:%u",
             parsed[i].host, parsed[i].port);
  *n = count;
  return 0;
}

/* 4 MiB (BytePS's default), or the model's bytes per shard rounded up to a
 * multiple of 4 KiB when that is smaller: a small model's largest tensor is
 * then cut so every shard holds about the same bytes and shares the work. */
static uint64_t auto_chunk_bytes(struct mlp *m, int num_shards) {
  uint64_t total = mlp_num_params(m) * sizeof(float);
  uint64_t per = (total + (uint64_t)num_shards - 1) / (uint64_t)num_shards;
  per = (per + 4095) / 4096 * 4096;
  return per < (4u << 20) ? per : (4u << 20);
}

static int dump_params(const char *path, struct mlp *m) {
  FILE *f = fopen(path, "wb");
  if (!f) return -errno;
  for (int t = 0; t < mlp_num_tensors(m); t++)
    fwrite(mlp_param(m, t), sizeof(float), mlp_tensor_count(m, t), f);
  return fclose(f) == 0 ? 0 : -EIO;
}

static int start_http(const struct worker_config *cfg, int rank, struct worker_http **out) {
  struct worker_http_opts ho = {.listen = cfg->http, .sync_mode = cfg->sync_mode, .rank = rank,
                                .world_size = (int)cfg->world_size, .batch = (int)cfg->batch_size};
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
  enum log_level level;
  if (log_level_parse(cfg.log_level, &level) < 0) {
    fprintf(stderr, "ps-worker: option --log-level: \"%s\" is not debug|info|warn|error|off\n",
            cfg.log_level);
    return EXIT_USAGE;
  }
  if (strcmp(cfg.sync_mode, "ps") != 0) {
    fprintf(stderr, "ps-worker: option --sync-mode: \"%s\" is not available (this build knows: ps)\n",
            cfg.sync_mode);
    return EXIT_USAGE;
  }
  int rank;
  if (resolve_rank(cfg.rank, cfg.world_size, &rank) < 0) return EXIT_USAGE;
  static char addrs[MAX_SHARDS][300];
  int num_shards = 0;
  if (shard_list(&cfg, addrs, &num_shards) < 0) return EXIT_USAGE;
  int sizes[MLP_MAX_SIZES], num_sizes;
  char err[512];
  if (mlp_parse_spec(cfg.model, sizes, MLP_MAX_SIZES, &num_sizes, err, sizeof(err)) < 0) {
    fprintf(stderr, "ps-worker: option --model: %s\n", err);
    return EXIT_USAGE;
  }
  struct device_opts dopts = {.kind = DEVICE_AUTO};
  if (device_kind_parse(cfg.device, &dopts.kind) < 0) {
    fprintf(stderr, "ps-worker: option --device: \"%s\" is not auto, cpu or cuda\n", cfg.device);
    return EXIT_USAGE;
  }
  char proc[32];
  snprintf(proc, sizeof(proc), "ps-worker-%d", rank);
  log_setup(proc, level);
  signal(SIGPIPE, SIG_IGN);
  struct worker_http *wh = NULL;
  if ((r = start_http(&cfg, rank, &wh)) < 0) return r == -EINVAL ? EXIT_USAGE : EXIT_PERMANENT;

  int exit_code = EXIT_PERMANENT;
  struct dataset train = {0}, test = {0};
  struct device_model *dm = NULL;
  struct mlp *m = NULL; /* dm's host mirror: what the sync backends read and write */
  ps_client *c = NULL;
  struct sync_ps *sp = NULL;
  if (dataset_load(cfg.data, "train", &train, err, sizeof(err)) < 0 ||
      (rank == 0 && dataset_load(cfg.data, "t10k", &test, err, sizeof(err)) < 0)) {
    log_error("cannot load data", "error=\"%s\" hint=\"install dataset-fashion-mnist or pass --data\"",
              err);
    goto out;
  }
  if ((uint32_t)sizes[0] != train.rows * train.cols || sizes[num_sizes - 1] != DATASET_NUM_CLASSES) {
    log_error("model does not fit the data", "model=%s inputs=%u classes=%d", cfg.model,
              train.rows * train.cols, DATASET_NUM_CLASSES);
    goto out;
  }
  /* A device that cannot be used is a permanent error (exit 1): a restart
   * would not give this machine a GPU or this build CUDA. */
  r = device_model_open(&dopts, sizes, num_sizes, (int)cfg.batch_size, &dm, err, sizeof(err));
  if (r < 0) {
    log_error("cannot set up the model", "option=--device device=%s model=%s error=\"%s\"",
              cfg.device, cfg.model, err);
    goto out;
  }
  m = device_model_host(dm);
  mlp_init_params(m, (uint64_t)cfg.seed);
  if (device_model_load_params(dm) < 0) {
    log_error("cannot load the parameters onto the device", "error=\"%s\"",
              device_model_errmsg(dm));
    goto out;
  }
  log_info("device", "device=\"%s\"", device_model_name(dm));

  uint64_t chunk = cfg.chunk_bytes;
  if (chunk == 0) chunk = auto_chunk_bytes(m, num_shards);
  const char *ptrs[MAX_SHARDS];
  for (int i = 0; i < num_shards; i++) ptrs[i] = addrs[i];
  struct ps_client_opts co = {.servers = ptrs, .num_servers = num_shards, .rank = rank,
                              .world_size = (int)cfg.world_size, .job_id = cfg.job_id,
                              .chunk_bytes = chunk,
                              .connect_timeout_ms = (int)cfg.connect_timeout_ms};
  ps_status st = ps_client_new(&co, &c, err, sizeof(err));
  if (st != PS_OK) {
    log_error("cannot reach the shards", "error=\"%s\"", err);
    exit_code = st == PS_ERR_CONNECT || st == PS_ERR_IO ? EXIT_RETRY : EXIT_PERMANENT;
    goto out;
  }
  r = sync_ps_open(c, rank, m, &sp);
  if (r < 0) {
    exit_code = r == -ECONNRESET ? EXIT_RETRY : EXIT_PERMANENT;
    goto out;
  }
  log_info("training", "sync_mode=ps rank=%d world_size=%lld shards=%d model=%s params=%zu "
           "batch=%lld epochs=%lld", rank, (long long)cfg.world_size, num_shards, cfg.model,
           mlp_num_params(m), (long long)cfg.batch_size, (long long)cfg.epochs);
  struct trainer_sync sync;
  sync_ps_bind(sp, &sync);
  worker_http_watch_client(wh, c); /* NULL in allreduce mode: the ring is formed */
  worker_http_wrap_sync(wh, &sync);
  struct trainer_opts to = {.train = &train, .test = rank == 0 ? &test : NULL, .rank = rank,
                            .world_size = (int)cfg.world_size, .batch = (int)cfg.batch_size,
                            .epochs = (int)cfg.epochs, .seed = (uint64_t)cfg.seed,
                            .max_steps = (uint64_t)cfg.max_steps, .log_every = (int)cfg.log_every,
                            .progress = rank == 0};
  struct trainer_result res;
  r = trainer_run(&to, dm, &sync, &res);
  if (r < 0) {
    exit_code = r == -ECONNRESET ? EXIT_RETRY : EXIT_PERMANENT;
    goto out;
  }
  if (rank == 0 && cfg.dump_params[0] && (r = dump_params(cfg.dump_params, m)) < 0) {
    log_error("cannot write --dump-params", "path=\"%s\" error=\"%s\"", cfg.dump_params, strerror(-r));
    goto out;
  }
  if (rank == 0) {
    printf("summary accuracy=%.4f epochs=%d wall_s=%.2f samples_per_s=%.0f\n", (double)res.accuracy,
           res.epochs_done, res.wall_s, res.samples_per_s);
    fflush(stdout);
  }
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  log_info("done", "steps=%" PRIu64 " wall_s=%.2f wait_s=%.2f samples_per_s=%.0f max_rss_mb=%.1f",
           res.steps, res.wall_s, res.wait_s, res.samples_per_s, (double)ru.ru_maxrss / 1024.0);
  worker_http_done(wh);
  exit_code = 0;
out:
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
  return exit_code;
}
