/* worker_http: a worker's metrics and probes (see worker_http.h).
 *
 * Threads: the training thread calls the sync wrappers (step timing, atomic
 * updates only); the HTTP thread renders and, for PS mode, copies the libps
 * client's counters under `mu` at scrape time, publishing them as deltas
 * from `last` so the exported counters stay monotonic. main.c's calls take
 * `mu` (watch_client, which first publishes the old client's final counts)
 * or store atomics (done). */
#include "worker_http.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "http.h"
#include "metrics.h"
#include "model.h"

enum worker_phase { W_STARTING, W_TRAINING, W_DONE };
static const char *const phase_names[] = {"starting", "training", "done"};

struct worker_http {
  struct metrics *reg;
  struct metric *steps, *step, *step_seconds, *wait_seconds, *samples, *grad_bytes;
  struct metric *pushes, *pulls, *sent, *received, *reconnects, *connected, *peers;
  struct metric *ready, *done, *rank, *start_time, *state_bytes;
  struct metric *mp_params, *mp_ar_fwd, *mp_ar_bwd, *mp_ag, *mp_peak, *mp_peak_bytes;
  struct http_server *http;
  int batch;
  atomic_int phase;

  /* training thread only */
  struct trainer_sync inner;
  bool have_step;
  uint64_t cur_step;
  double step_start;

  /* under mu */
  pthread_mutex_t mu;
  ps_client *client;
  struct ps_client_counters last; /* HTTP thread: what was published */
};

/* ---- HTTP thread -------------------------------------------------------- */

static void add_delta(struct metric *c, uint64_t now, uint64_t *last) {
  if (now > *last) metric_inc(c, now - *last);
  *last = now;
}

/* Copies the client's counters; returns connected/total shards (-1/-1 when
 * no client is watched). */
static void poll_client(struct worker_http *w, int *connected, int *total) {
  *connected = *total = -1;
  pthread_mutex_lock(&w->mu);
  if (w->client) {
    struct ps_client_counters k;
    ps_client_counters(w->client, &k);
    add_delta(w->pushes, k.pushes, &w->last.pushes);
    add_delta(w->pulls, k.pulls, &w->last.pulls);
    add_delta(w->sent, k.bytes_sent, &w->last.bytes_sent);
    add_delta(w->received, k.bytes_received, &w->last.bytes_received);
    add_delta(w->reconnects, k.reconnects, &w->last.reconnects);
    metric_set(w->connected, k.connected_shards);
    metric_set(w->peers, k.num_shards);
    *connected = k.connected_shards;
    *total = k.num_shards;
  }
  pthread_mutex_unlock(&w->mu);
}

/* Writes why not ready into out (if given); returns true when ready. */
static bool is_ready(struct worker_http *w, FILE *out) {
  int connected, total;
  poll_client(w, &connected, &total);
  int ph = atomic_load(&w->phase);
  bool ok = ph == W_TRAINING && connected == total;
  metric_set(w->ready, ok);
  if (!out) return ok;
  if (ph == W_DONE)
    fputs("done: training finished; nothing left to serve\n", out);
  else if (ph == W_STARTING)
    fputs("not ready: starting (loading data, reaching the shards or the ring)\n", out);
  else if (total < 0)
    fputs("ready: training, ring formed\n", out);
  else
    fprintf(out, "%s: training, %d of %d shards connected\n", ok ? "ready" : "not ready", connected,
            total);
  return ok;
}

static int on_metrics(void *arg, FILE *out, const char **ctype) {
  struct worker_http *w = arg;
  is_ready(w, NULL);
  *ctype = METRICS_CONTENT_TYPE;
  return metrics_render(w->reg, out) == 0 ? 200 : 500;
}

static int on_readyz(void *arg, FILE *out, const char **ctype) {
  (void)ctype;
  return is_ready(arg, out) ? 200 : 503;
}

static int on_healthz(void *arg, FILE *out, const char **ctype) {
  struct worker_http *w = arg;
  (void)ctype;
  fprintf(out, "ok: %s\n", phase_names[atomic_load(&w->phase)]);
  return 200;
}

/* ---- setup -------------------------------------------------------------- */

static int build_metrics(struct worker_http *w, const struct worker_http_opts *o) {
  /* a step of a small model on a busy CPU takes about a millisecond, a large
   * one on a slow network seconds */
  static const double step_bounds[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                       0.1,    0.25,  0.5,    1,     2.5,  5,     10};
  const size_t nb = sizeof(step_bounds) / sizeof(step_bounds[0]);
  struct metrics *m = w->reg = metrics_new();
  if (!m) return -ENOMEM;
  w->steps = metrics_counter(m, "ps_worker_steps_total", "training steps completed");
  w->step = metrics_gauge(m, "ps_worker_step", "the step being computed (this worker's clock)");
  w->step_seconds = metrics_histogram(m, "ps_worker_step_seconds", "wall time of one training step",
                                      step_bounds, nb);
  w->wait_seconds = metrics_histogram(
      m, "ps_worker_wait_seconds",
      "time a step waited for its parameters (communication not hidden by compute)", step_bounds,
      nb);
  w->samples = metrics_counter(m, "ps_worker_samples_total", "training samples processed");
  w->grad_bytes = metrics_counter(m, "ps_worker_gradient_bytes_total",
                                  "gradient bytes handed to the sync backend");
  w->pushes = metrics_counter(m, "ps_worker_pushes_total", "key pushes sent to shards (ps mode)");
  w->pulls = metrics_counter(m, "ps_worker_pulls_total", "key pulls sent to shards (ps mode)");
  w->sent = metrics_counter(m, "ps_worker_sent_bytes_total", "bytes sent to shards (ps mode)");
  w->received =
      metrics_counter(m, "ps_worker_received_bytes_total", "bytes received from shards (ps mode)");
  w->reconnects = metrics_counter(m, "ps_worker_reconnects_total",
                                  "shard connections lost and re-established (ps mode)");
  w->connected = metrics_gauge(m, "ps_worker_connected_shards", "shard connections up (ps mode)");
  w->peers = metrics_gauge(m, "ps_worker_shards", "shards of the job (ps mode)");
  w->ready = metrics_gauge(m, "ps_worker_ready", "1 when /readyz answers 200");
  w->done = metrics_gauge(m, "ps_worker_training_done", "1 once training finished");
  w->rank = metrics_gauge(m, "ps_worker_rank", "this worker's rank");
  w->state_bytes = metrics_gauge(m, "ps_worker_optimizer_state_bytes",
                                 "bytes of optimizer state this rank holds (allreduce mode; "
                                 "1/W of it with --shard-optimizer-state, 1/D in a 3D job)");
  w->mp_params = metrics_gauge(m, "ps_worker_params",
                               "parameters (floats) this rank holds: its stage's slices under "
                               "--tensor-parallel / --pipeline-stages, else the whole model");
  w->mp_ar_fwd = metrics_gauge(m, "ps_worker_tp_allreduces_forward",
                               "tensor-parallel all-reduces in forward passes so far");
  w->mp_ar_bwd = metrics_gauge(m, "ps_worker_tp_allreduces_backward",
                               "tensor-parallel all-reduces in backward passes so far");
  w->mp_ag = metrics_gauge(m, "ps_worker_tp_allgathers",
                           "tensor-parallel all-gathers (unpaired column-parallel layers) so far");
  w->mp_peak = metrics_gauge(m, "ps_worker_peak_activation_microbatches",
                             "most micro-batches whose activations this stage held at once");
  w->mp_peak_bytes =
      metrics_gauge(m, "ps_worker_peak_activation_bytes", "bytes of those activations");
  if (!w->mp_params || !w->mp_ar_fwd || !w->mp_ar_bwd || !w->mp_ag || !w->mp_peak ||
      !w->mp_peak_bytes)
    return -ENOMEM;
  w->start_time = metrics_gauge(m, "process_start_time_seconds",
                                "start time of the process since the Unix epoch in seconds");
  const char *mode = o->sync_mode ? o->sync_mode : "";
  struct metric *info = metrics_gauge_vec(
      m, "ps_worker_sync_mode", "1 for the sync mode this worker runs", "mode", 1, &mode, 1);
  if (!w->steps || !w->step || !w->step_seconds || !w->wait_seconds || !w->samples ||
      !w->grad_bytes || !w->pushes || !w->pulls || !w->sent || !w->received || !w->reconnects ||
      !w->connected || !w->peers || !w->ready || !w->done || !w->rank || !w->start_time ||
      !w->state_bytes || !info)
    return -ENOMEM;
  metric_set(info, 1);
  const char *tr = o->transport ? o->transport : "tcp";
  struct metric *transport = metrics_gauge_vec(
      m, "ps_worker_transport", "1 for the transport push and pull use (--transport, ps mode)",
      "transport", 1, &tr, 1);
  if (!transport) return -ENOMEM;
  metric_set(transport, 1);
  metric_set(w->rank, o->rank);
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  metric_set(w->start_time, (double)now.tv_sec + (double)now.tv_nsec * 1e-9);
  return 0;
}

int worker_http_start(const struct worker_http_opts *o, struct worker_http **out, char *err,
                      size_t errlen) {
  *out = NULL;
  struct worker_http *w = calloc(1, sizeof(*w));
  if (!w) return -ENOMEM;
  pthread_mutex_init(&w->mu, NULL);
  w->batch = o->batch;
  int r = build_metrics(w, o);
  if (r < 0) {
    snprintf(err, errlen, "out of memory");
    worker_http_stop(w);
    return r;
  }
  if (o->listen && o->listen[0]) {
    struct http_route routes[] = {
        {"/metrics", on_metrics, w}, {"/healthz", on_healthz, w}, {"/readyz", on_readyz, w}};
    struct http_opts ho = {.listen = o->listen, .routes = routes, .num_routes = 3};
    r = http_start(&ho, &w->http, err, errlen);
    if (r < 0) {
      worker_http_stop(w);
      return r;
    }
  }
  *out = w;
  return 0;
}

const char *worker_http_address(const struct worker_http *w) {
  return w && w->http ? http_address(w->http) : "";
}

void worker_http_stop(struct worker_http *w) {
  if (!w) return;
  http_stop(w->http);
  metrics_free(w->reg);
  pthread_mutex_destroy(&w->mu);
  free(w);
}

void worker_http_watch_client(struct worker_http *w, ps_client *c) {
  if (!w) return;
  int connected, total;
  poll_client(w, &connected, &total); /* the old client's last counts stay exported */
  pthread_mutex_lock(&w->mu);
  w->client = c;
  memset(&w->last, 0, sizeof(w->last));
  if (!c) metric_set(w->connected, 0);
  pthread_mutex_unlock(&w->mu);
}

void worker_http_done(struct worker_http *w) {
  if (!w) return;
  atomic_store(&w->phase, W_DONE);
  metric_set(w->done, 1);
  metric_set(w->ready, 0);
}

/* ---- the sync wrappers (training thread) -------------------------------- */

static int wrap_fetch(void *ctx, struct mlp *m, uint64_t step) {
  struct worker_http *w = ctx;
  double t0 = clock_now_s();
  if (w->have_step && step == w->cur_step + 1) {
    metric_observe(w->step_seconds, t0 - w->step_start);
    metric_inc(w->steps, 1);
    metric_inc(w->samples, (uint64_t)w->batch);
  }
  metric_set(w->step, (double)step);
  int r = w->inner.fetch(w->inner.ctx, m, step);
  double t1 = clock_now_s();
  /* a repeated fetch (evaluation) restarts the step's clock */
  if (!w->have_step || step != w->cur_step) metric_observe(w->wait_seconds, t1 - t0);
  w->have_step = true;
  w->cur_step = step;
  w->step_start = t0;
  return r;
}

static int wrap_grad_ready(void *ctx, struct mlp *m, int t, size_t done, uint64_t step) {
  struct worker_http *w = ctx;
  if (done == mlp_tensor_count(m, t)) /* once per tensor, when it is whole */
    metric_inc(w->grad_bytes, (uint64_t)done * sizeof(float));
  return w->inner.grad_ready(w->inner.ctx, m, t, done, step);
}

static int wrap_grad_blocks(void *ctx, struct mlp *m, size_t *ends, int max) {
  struct worker_http *w = ctx;
  return w->inner.grad_blocks(w->inner.ctx, m, ends, max);
}

static int wrap_finish(void *ctx, struct mlp *m, uint64_t step) {
  struct worker_http *w = ctx;
  if (w->have_step && step == w->cur_step + 1) {
    metric_observe(w->step_seconds, clock_now_s() - w->step_start);
    metric_inc(w->steps, 1);
    metric_inc(w->samples, (uint64_t)w->batch);
    w->cur_step = step;
  }
  return w->inner.finish(w->inner.ctx, m, step);
}

static uint64_t wrap_rollback_step(void *ctx) {
  struct worker_http *w = ctx;
  return w->inner.rollback_step(w->inner.ctx);
}

static const char *wrap_errmsg(void *ctx, char *buf, size_t len) {
  struct worker_http *w = ctx;
  return w->inner.errmsg(w->inner.ctx, buf, len);
}

void worker_http_wrap_sync(struct worker_http *w, struct trainer_sync *sync) {
  if (!w) return;
  w->inner = *sync;
  sync->ctx = w;
  sync->fetch = wrap_fetch;
  sync->grad_ready = wrap_grad_ready;
  sync->finish = wrap_finish;
  sync->errmsg = wrap_errmsg;
  sync->rollback_step = w->inner.rollback_step ? wrap_rollback_step : NULL;
  sync->grad_blocks = w->inner.grad_blocks ? wrap_grad_blocks : NULL;
  atomic_store(&w->phase, W_TRAINING);
}

void worker_http_set_mp(struct worker_http *w, const struct worker_http_mp *mp, uint64_t step) {
  if (!w) return;
  atomic_store(&w->phase, W_TRAINING);
  metric_set(w->mp_params, (double)mp->params_rank);
  metric_set(w->mp_ar_fwd, (double)mp->tp_allreduce_fwd);
  metric_set(w->mp_ar_bwd, (double)mp->tp_allreduce_bwd);
  metric_set(w->mp_ag, (double)mp->tp_allgather);
  metric_set(w->mp_peak, (double)mp->peak_acts);
  metric_set(w->mp_peak_bytes, (double)mp->peak_act_bytes);
  if (step == UINT64_MAX) return; /* before the first step */
  double now = clock_now_s();
  if (w->have_step) metric_observe(w->step_seconds, now - w->step_start);
  metric_inc(w->steps, 1);
  metric_inc(w->samples, (uint64_t)w->batch);
  metric_set(w->step, (double)step + 1);
  w->have_step = true;
  w->step_start = now;
}

void worker_http_set_state_bytes(struct worker_http *w, size_t bytes) {
  if (w) metric_set(w->state_bytes, (double)bytes);
}
