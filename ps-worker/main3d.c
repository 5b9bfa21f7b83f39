/* main3d: the 3D job's checks and set-up (see main3d.h). */
#include "main3d.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt3d.h"
#include "collective.h"
#include "data.h"
#include "grid.h"
#include "log.h"
#include "mp_model.h"
#include "pipeline.h"
#include "trainer3d.h"

#define EXIT_USAGE 2
#define EXIT_PERMANENT 1
#define EXIT_RETRY 129

bool main3d_wanted(const struct worker_config *cfg) {
  return cfg->tensor_parallel * cfg->pipeline_stages > 1 || cfg->micro_batches > 1;
}

bool main3d_needs_peers(const struct worker_config *cfg, bool allreduce) {
  return allreduce || cfg->tensor_parallel * cfg->pipeline_stages > 1;
}

static int chunks_of(const struct worker_config *cfg) {
  return strcmp(cfg->pipeline_schedule, "interleaved") ? 1 : (int)cfg->pipeline_chunks;
}

static struct ps_pipe_shape shape_of(const struct worker_config *cfg) {
  ps_pipe_schedule kind = PS_PIPE_1F1B;
  ps_pipe_schedule_parse(cfg->pipeline_schedule, &kind, NULL, 0);
  struct ps_pipe_shape sh = {.kind = kind,
                             .stages = (int)cfg->pipeline_stages,
                             .micro = (int)cfg->micro_batches,
                             .chunks = chunks_of(cfg)};
  return sh;
}

int main3d_check(const struct worker_config *cfg, bool allreduce, const int *sizes, int num_sizes) {
  long long t = cfg->tensor_parallel, p = cfg->pipeline_stages, m = cfg->micro_batches;
  long long w = cfg->world_size;
  char err[300];
  if (w % (t * p) != 0) {
    fprintf(stderr,
            "ps-worker: options --tensor-parallel %lld and --pipeline-stages %lld: --world-size "
            "%lld is not a multiple of %lld ranks per pipeline replica\n",
            t, p, w, t * p);
    return -EINVAL;
  }
  if (cfg->batch_size % m != 0) {
    fprintf(stderr,
            "ps-worker: option --micro-batches %lld: --batch-size %lld is not a multiple of it\n",
            m, (long long)cfg->batch_size);
    return -EINVAL;
  }
  if (!main3d_wanted(cfg)) return 0;
  struct ps_pipe_shape sh = shape_of(cfg);
  if (ps_pipe_check(&sh, err, sizeof(err)) != PS_OK) {
    fprintf(stderr, "ps-worker: option --pipeline-schedule %s: %s\n", cfg->pipeline_schedule, err);
    return -EINVAL;
  }
  struct mp_plan plan;
  if (mp_plan_new(sizes, num_sizes, (int)t, (int)p, sh.chunks, &plan, err, sizeof(err)) < 0) {
    fprintf(stderr, "ps-worker: options --model %s, --tensor-parallel and --pipeline-stages: %s\n",
            cfg->model, err);
    return -EINVAL;
  }
  /* the 3D trainer computes on the CPU */
  bool nccl = allreduce && !strcmp(cfg->allreduce_backend, "nccl");
  if (!strcmp(cfg->device, "cuda") || nccl) {
    fprintf(stderr,
            "ps-worker: option --%s with --tensor-parallel, --pipeline-stages or "
            "--micro-batches > 1: CPU only for now\n",
            !strcmp(cfg->device, "cuda") ? "device cuda" : "allreduce-backend nccl");
    return -EINVAL;
  }
  /* --shard-optimizer-state and --checkpoint-dir: main.c refuses them in ps
   * mode, with NCCL, and together */
  return 0;
}

int worker_connect_shards(const struct worker_config *cfg, int rank, char (*addrs)[300],
                          int num_shards, const ps_token *token, size_t total_params,
                          ps_client **c) {
  char err[512];
  uint64_t chunk = cfg->chunk_bytes;
  if (chunk == 0) { /* 4 MiB, or the bytes per shard rounded up to 4 KiB when smaller */
    uint64_t total = total_params * sizeof(float);
    uint64_t per = (total + (uint64_t)num_shards - 1) / (uint64_t)num_shards;
    per = (per + 4095) / 4096 * 4096;
    chunk = per < (4u << 20) ? per : (4u << 20);
  }
  const char *ptrs[MAX_SHARDS];
  for (int i = 0; i < num_shards; i++) ptrs[i] = addrs[i];
  struct ps_client_opts co = {.auth_token = token,
                              .servers = ptrs,
                              .num_servers = num_shards,
                              .rank = rank,
                              .world_size = (int)cfg->world_size,
                              .job_id = cfg->job_id,
                              .chunk_bytes = chunk,
                              .connect_timeout_ms = (int)cfg->connect_timeout_ms,
                              .transport = cfg->transport};
  ps_status st = ps_client_new(&co, c, err, sizeof(err));
  if (st == PS_ERR_INVALID) { /* a setting libps reads itself: PS_HEARTBEAT_MS, ... */
    fprintf(stderr, "ps-worker: %s\n", err);
    return 2;
  }
  if (st != PS_OK) {
    log_error("cannot reach the shards", "error=\"%s\"", err);
    return st == PS_ERR_CONNECT || st == PS_ERR_IO ? EXIT_RETRY : EXIT_PERMANENT;
  }
  return 0;
}

/* The tensor-parallel group as the stage's communication. */
static int tp_allreduce(void *ctx, float *buf, size_t n) {
  return ps_coll_allreduce(ctx, buf, n, PS_REDOP_SUM) == PS_OK ? 0 : -ECONNRESET;
}
static int tp_allgather(void *ctx, const float *send, float *recv, size_t n) {
  return ps_coll_allgather(ctx, send, recv, n * sizeof(float)) == PS_OK ? 0 : -ECONNRESET;
}

struct job {
  ps_coll *coll;
  pthread_t watch;
  bool watching;
  atomic_bool stop;
  ps_grid *grid;
  ps_client *client;
  struct mp_stage *stage;
  struct sync3d *sync;
  struct ckpt3d *ckpt;
  struct mp_tp_comm comm;
  struct dataset train, test;
};

/* ps mode: a rank can wait on the shards (a pull of a key whose other owner
 * is gone) rather than on a group, and the shards wait up to their
 * --worker-timeout for a lost worker. The job group's watchdog sees a lost
 * rank at once: this thread ends the worker then, as a failed group call
 * would (129, naming the rank). */
static void *watch_job(void *arg) {
  struct job *j = arg;
  while (!atomic_load(&j->stop)) {
    ps_status st = ps_coll_status(j->coll);
    if (st != PS_OK) {
      char msg[512];
      ps_coll_errmsg(j->coll, msg, sizeof(msg));
      log_error("model-parallel communication failed", "what=watch status=%s error=\"%s\"",
                ps_strerror(st), msg);
      _exit(st == PS_ERR_IO || st == PS_ERR_CONNECT ? EXIT_RETRY : EXIT_PERMANENT);
    }
    usleep(50 * 1000);
  }
  return NULL;
}

static void job_close(struct job *j) {
  if (j->watching) {
    atomic_store(&j->stop, true);
    pthread_join(j->watch, NULL);
  }
  ckpt3d_close(j->ckpt);
  sync3d_close(j->sync);
  mp_stage_free(j->stage);
  ps_client_free(j->client);
  ps_grid_free(j->grid);
  ps_coll_close(j->coll);
  dataset_free(&j->train);
  dataset_free(&j->test);
}

struct ps_coll_opts worker_coll_opts(const struct worker_config *cfg, int rank, char **peers,
                                     const ps_token *token) {
  struct ps_coll_opts po = {.auth_token = token,
                            .rank = rank,
                            .world_size = (int)cfg->world_size,
                            .peers = (const char *const *)peers,
                            .job_id = cfg->job_id,
                            .listen_addr = cfg->peer_listen,
                            .listen_fd = (int)cfg->peer_listen_fd,
                            .connect_timeout_ms = (int)cfg->connect_timeout_ms,
                            .peer_timeout_ms = (int)cfg->peer_timeout_ms,
                            .node = cfg->node_name};
  return po;
}

/* The job group (p2p) and the grid's groups. 0 or the exit code. */
static int open_groups(const struct worker_config *cfg, int rank, char **peers,
                       const ps_token *token, struct job *j) {
  char err[512];
  struct ps_coll_opts po = worker_coll_opts(cfg, rank, peers, token);
  po.p2p = 1;
  po.node = cfg->node_name[0] ? cfg->node_name : NULL;
  ps_status st = ps_coll_open(&po, &j->coll, err, sizeof(err));
  if (st != PS_OK) {
    log_error("cannot connect the ranks", "error=\"%s\"", err);
    return st == PS_ERR_CONNECT ? EXIT_RETRY : EXIT_PERMANENT;
  }
  st = ps_grid_new(j->coll, (int)cfg->tensor_parallel, (int)cfg->pipeline_stages, &j->grid, err,
                   sizeof(err));
  if (st != PS_OK) {
    log_error("cannot form the tensor-, data- and pipeline-parallel groups", "error=\"%s\"", err);
    return st == PS_ERR_IO || st == PS_ERR_CONNECT ? EXIT_RETRY : EXIT_PERMANENT;
  }
  struct ps_grid_coords at = ps_grid_coords(j->grid);
  ps_coll *pipe = ps_grid_group(j->grid, 'p');
  if (pipe && ps_coll_rank(pipe) != at.pp) { /* the schedules' peers are pipeline ranks */
    log_error("internal error: pipeline group rank is not the stage", "rank=%d stage=%d",
              ps_coll_rank(pipe), at.pp);
    return EXIT_PERMANENT;
  }
  j->comm = (struct mp_tp_comm){ps_grid_group(j->grid, 't'), tp_allreduce, tp_allgather};
  return 0;
}

/* The start line: layout, this rank's place and layers, and its share of
 * the parameters. */
static void log_layout(const struct worker_config *cfg, const struct mp_plan *plan,
                       struct ps_grid_coords at, int d, size_t state_floats) {
  char layers[256] = "";
  for (int c = 0, len = 0; c < plan->chunks && len < (int)sizeof(layers); c++) {
    int k = at.pp + c * plan->pp;
    len += snprintf(layers + len, sizeof(layers) - (size_t)len, "%s%d-%d", c ? "," : "",
                    plan->first_layer[k], plan->first_layer[k + 1] - 1);
  }
  size_t mine = mp_plan_rank_params(plan, at.pp), all = mp_plan_total_params(plan);
  log_info("training 3d",
           "sync_mode=%s t=%d p=%d d=%d tp_rank=%d pp_rank=%d dp_rank=%d layers=%s "
           "schedule=%s micro_batches=%lld micro_batch=%lld chunks=%d model=%s "
           "params_rank=%zu params_model=%zu params_fraction=%.3f optimizer_state_floats=%zu "
           "optimizer_state_sharded=%d batch=%lld global_batch=%lld epochs=%lld",
           cfg->sync_mode, plan->tp, plan->pp, d, at.tp, at.pp, at.dp, layers,
           cfg->pipeline_schedule, (long long)cfg->micro_batches,
           (long long)(cfg->batch_size / cfg->micro_batches), plan->chunks, cfg->model, mine, all,
           all ? (double)mine / (double)all : 0.0, state_floats,
           cfg->shard_optimizer_state && d > 1, (long long)cfg->batch_size,
           (long long)cfg->batch_size * d, (long long)cfg->epochs);
}

struct step_ctx {
  struct worker_http *wh;
  size_t params;
};

static int after_step(void *arg, uint64_t done) {
  return ckpt3d_after_step(arg, done);
}

/* The checkpoint identity of this rank: the job rank and its place in the
 * grid (rank = tp + t * (dp + d * pp)), known before the groups form. */
static struct worker_ckpt_id ckpt_id_of(const struct worker_config *cfg, int rank, int chunks) {
  uint32_t t = (uint32_t)cfg->tensor_parallel, p = (uint32_t)cfg->pipeline_stages;
  uint32_t w = (uint32_t)cfg->world_size, d = w / (t * p), r = (uint32_t)rank;
  struct worker_ckpt_id id = {.rank = r,
                              .world = w,
                              .batch = (uint32_t)cfg->batch_size,
                              .seed = (uint64_t)cfg->seed,
                              .layout = {.t = t,
                                         .p = p,
                                         .chunks = (uint32_t)chunks,
                                         .tp_rank = r % t,
                                         .pp_rank = r / (t * d),
                                         .dp_rank = (r / t) % d}};
  return id;
}

/* allreduce mode with --checkpoint-dir: this rank's writer, and the step
 * every rank holds, loaded. 0 or the exit code. */
static int open_ckpt(const struct worker_config *cfg, int rank, int chunks, struct job *j,
                     uint64_t *start) {
  struct ckpt3d_opts co = {.dir = cfg->checkpoint_dir,
                           .every = (uint64_t)cfg->checkpoint_every,
                           .max_failures = (uint32_t)cfg->checkpoint_max_failures,
                           .id = ckpt_id_of(cfg, rank, chunks)};
  if (ckpt3d_open(&co, j->stage, sync3d_velocity(j->sync), &j->ckpt) < 0) return EXIT_PERMANENT;
  int r = ckpt3d_resume(j->ckpt, j->coll, start);
  return r == 0 ? 0 : r == -ECONNRESET ? EXIT_RETRY : EXIT_PERMANENT;
}

static void on_step(void *arg, const struct mp_stage *st, uint64_t step) {
  struct step_ctx *c = arg;
  struct mp_counters k;
  mp_stage_counters(st, &k);
  struct worker_http_mp mp = {.params_rank = c->params,
                              .tp_allreduce_fwd = k.tp_allreduce_fwd,
                              .tp_allreduce_bwd = k.tp_allreduce_bwd,
                              .tp_allgather = k.tp_allgather,
                              .peak_acts = k.peak_acts,
                              .peak_act_bytes = k.peak_act_bytes};
  worker_http_set_mp(c->wh, &mp, step);
}

int main3d_run(const struct worker_config *cfg, int rank, bool allreduce, char **peers,
               char (*addrs)[300], int num_shards, const ps_token *token, const int *sizes,
               int num_sizes, struct worker_http *wh, struct trainer_result *res,
               struct mlp **full_out) {
  struct job j = {0};
  struct mlp *full = NULL;
  char err[512];
  int code = EXIT_PERMANENT, t = (int)cfg->tensor_parallel, p = (int)cfg->pipeline_stages;
  int w = (int)cfg->world_size, d = w / (t * p);
  *full_out = NULL;
  if (dataset_load(cfg->data, "train", &j.train, err, sizeof(err)) < 0 ||
      (rank == 0 && dataset_load(cfg->data, "t10k", &j.test, err, sizeof(err)) < 0)) {
    log_error("cannot load data",
              "error=\"%s\" hint=\"install dataset-fashion-mnist or pass --data\"", err);
    goto out;
  }
  if ((uint32_t)sizes[0] != j.train.rows * j.train.cols ||
      sizes[num_sizes - 1] != DATASET_NUM_CLASSES) {
    log_error("model does not fit the data", "model=%s inputs=%u classes=%d", cfg->model,
              j.train.rows * j.train.cols, DATASET_NUM_CLASSES);
    goto out;
  }
  struct ps_pipe_shape sh = shape_of(cfg);
  struct mp_plan plan;
  if (mp_plan_new(sizes, num_sizes, t, p, sh.chunks, &plan, err, sizeof(err)) < 0) goto out;
  if (allreduce && cfg->checkpoint_dir[0]) { /* before waiting for the others: a bad setting */
    struct worker_ckpt_id id = ckpt_id_of(cfg, rank, sh.chunks);
    if (worker_ckpt_check_layout(cfg->checkpoint_dir, &id, err, sizeof(err)) < 0) {
      fprintf(stderr, "ps-worker: option --checkpoint-dir: %s\n", err);
      log_error("the checkpoints are of another layout", "error=\"%s\"", err);
      code = EXIT_USAGE;
      goto out;
    }
  }
  /* ps mode with T = P = 1 needs no group: the shards are the data axis */
  if (w > 1 && main3d_needs_peers(cfg, allreduce) &&
      (code = open_groups(cfg, rank, peers, token, &j)))
    goto out;
  code = EXIT_PERMANENT;
  uint64_t start = 0;
  struct ps_grid_coords at = {.tp = 0, .dp = rank, .pp = 0};
  if (j.grid) at = ps_grid_coords(j.grid);
  struct ps_pipe_action *acts = NULL;
  size_t nacts = 0;
  if (ps_pipe_actions(&sh, at.pp, &acts, &nacts, err, sizeof(err)) != PS_OK) {
    log_error("cannot build the schedule", "error=\"%s\"", err);
    goto out;
  }
  int inflight = trainer3d_max_inflight(acts, nacts);
  free(acts);
  j.stage = mp_stage_new(&plan, at.pp, at.tp, (int)(cfg->batch_size / cfg->micro_batches), inflight,
                         t > 1 ? &j.comm : NULL);
  if (!j.stage || !(full = mlp_new(sizes, num_sizes, 1000))) {
    log_error("cannot set up this rank's part of the model", "error=\"%s\"", strerror(errno));
    goto out;
  }
  mlp_init_params(full, (uint64_t)cfg->seed); /* every rank cuts its slices from the same model */
  if (mp_stage_load_full(j.stage, full) < 0) goto out;
  int r;
  if (allreduce) {
    struct sync_ring_opts ro = {.lr = cfg->lr,
                                .momentum = (float)cfg->momentum,
                                .lr_decay_steps = (uint64_t)cfg->lr_decay_steps,
                                .shard_state = cfg->shard_optimizer_state};
    r = sync3d_open_ring(j.grid ? ps_grid_group(j.grid, 'd') : NULL, &ro, j.stage, &j.sync);
    if (r == 0 && cfg->checkpoint_dir[0] && (code = open_ckpt(cfg, rank, sh.chunks, &j, &start)))
      goto out;
    code = EXIT_PERMANENT;
  } else {
    if ((code = worker_connect_shards(cfg, rank, addrs, num_shards, token,
                                      mp_plan_total_params(&plan), &j.client)))
      goto out;
    code = EXIT_PERMANENT;
    worker_http_watch_client(wh, j.client);
    if (j.coll && pthread_create(&j.watch, NULL, watch_job, &j) == 0) j.watching = true;
    r = sync3d_open_ps(j.client, &plan, w, rank, j.stage, full, &j.sync);
    if (r == 0) r = sync3d_resume_ps(j.sync, j.grid ? j.coll : NULL, w, rank, &start);
  }
  if (r < 0) {
    code = r == -ECONNRESET ? EXIT_RETRY : EXIT_PERMANENT;
    goto out;
  }
  log_layout(cfg, &plan, at, d, sync3d_state_floats(j.sync));
  if (cfg->shard_optimizer_state && d == 1)
    log_info(
        "--shard-optimizer-state with one data-parallel replica: nothing to shard, "
        "this rank keeps its whole optimizer state",
        "d=%d optimizer_state_floats=%zu", d, sync3d_state_floats(j.sync));
  worker_http_set_state_bytes(wh, sync3d_state_floats(j.sync) * sizeof(float));
  if (rank != 0) {
    mlp_free(full);
    full = NULL;
  }
  struct step_ctx sc = {wh, mp_plan_rank_params(&plan, at.pp)};
  on_step(&sc, j.stage, UINT64_MAX);
  struct trainer3d_opts o = {.train = &j.train,
                             .test = rank == 0 ? &j.test : NULL,
                             .job = j.grid ? j.coll : NULL,
                             .grid = j.grid,
                             .job_rank = rank,
                             .world = w,
                             .plan = &plan,
                             .shape = sh,
                             .stage = j.stage,
                             .sync = j.sync,
                             .full = full,
                             .batch = (int)cfg->batch_size,
                             .epochs = (int)cfg->epochs,
                             .seed = (uint64_t)cfg->seed,
                             .max_steps = (uint64_t)cfg->max_steps,
                             .start_step = start,
                             .log_every = (int)cfg->log_every,
                             .on_step = on_step,
                             .on_step_arg = &sc,
                             .after_step = j.ckpt ? after_step : NULL,
                             .after_step_arg = j.ckpt};
  r = trainer3d_run(&o, res);
  if (r < 0) {
    code = r == -ECONNRESET ? EXIT_RETRY : EXIT_PERMANENT;
    goto out;
  }
  struct mp_counters k;
  mp_stage_counters(j.stage, &k);
  log_info("stage done",
           "pp_rank=%d tp_rank=%d dp_rank=%d tp_allreduce_fwd=%llu tp_allreduce_bwd=%llu "
           "tp_allgather=%llu peak_act_microbatches=%llu peak_act_bytes=%llu",
           at.pp, at.tp, at.dp, (unsigned long long)k.tp_allreduce_fwd,
           (unsigned long long)k.tp_allreduce_bwd, (unsigned long long)k.tp_allgather,
           (unsigned long long)k.peak_acts, (unsigned long long)k.peak_act_bytes);
  *full_out = full;
  full = NULL;
  code = 0;
out:
  worker_http_watch_client(wh, NULL);
  mlp_free(full);
  job_close(&j);
  return code;
}
