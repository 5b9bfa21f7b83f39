/* shard_http: a shard's metrics and probes (see shard_http.h).
 *
 * Snapshot protocol: the HTTP thread takes a ticket (++requested) under mu,
 * wakes the loop with uv_async_send and waits on cv until served >= its
 * ticket. The loop's async callback reads `requested` first, publishes, then
 * sets served to what it read, so a served ticket always means a publish
 * that started after the request. uv_async_send is only called while
 * `attached` is true under mu, and detach clears it under mu before closing
 * the handle, so the HTTP thread never touches a closed handle. The handle
 * is unref'd: the loop ends when the server's own handles are closed, and
 * the server detaches right after. Counters of the store and of the
 * server's traffic are published as deltas from the previous snapshot (both
 * keep plain totals), which only the loop thread computes. */
#include "shard_http.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "conn_transports.h"
#include "http.h"
#include "metrics.h"
#include "ps.pb-c.h"
#include "server.h"
#include "store.h"

#define KEY_SERIES_MAX 1024u  /* per-key versions beyond this are not exported */
#define RANK_SERIES_MAX 4096u /* likewise per-worker clocks */

enum shard_state { S_STARTING, S_READY, S_STOPPING, S_DONE };
static const char *const state_names[] = {"starting", "ready", "stopping", "done"};

struct shard_http {
  struct metrics *reg;
  struct metric *pushes, *pulls, *updates, *duplicates, *bytes_in, *bytes_out, *rejected;
  struct metric *errors, *connections, *keys, *param_bytes, *min_version, *key_version;
  struct metric *clock, *ready, *done, *start_time, *shard_id;
  struct metric *ckpt_enabled, *ckpts, *ckpt_clock, *ckpt_age, *ckpt_age_s, *ckpt_seconds;
  struct metric *ckpt_bytes, *ckpt_failures, *ckpt_skipped, *ckpt_in_a_row, *ckpt_last_ts;
  double started_s; /* clock_now_s() at creation */
  struct metric *transport, *rndv, *staleness, *no_base, *silent, *lost, *workers_lost;
  struct http_server *http;
  uint32_t num_workers;
  const ProtobufCEnumDescriptor *codes;
  atomic_int state;

  /* loop thread only */
  struct store_stats last;
  struct server_traffic last_traffic;
  uint64_t last_ckpt[3]; /* written, failed, skipped */
  double min_seen;       /* the lowest key version at the last publish */
  bool keys_labelled;
  shard_http_snapshot_fn fn;
  void *arg;

  /* shared, under mu */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uv_async_t async;
  bool attached;
  uint64_t requested, served;
};

/* ---- HTTP thread -------------------------------------------------------- */

/* Asks the loop for a fresh snapshot. Returns 1 if one was published, 0 if
 * the loop is detached (the last snapshot stands), -ETIMEDOUT if the loop did
 * not answer in time. */
static int snapshot(struct shard_http *h) {
  int ret = 0;
  pthread_mutex_lock(&h->mu);
  if (h->attached) {
    uint64_t ticket = ++h->requested;
    uv_async_send(&h->async);
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += SHARD_HTTP_SNAPSHOT_MS / 1000;
    deadline.tv_nsec += (long)(SHARD_HTTP_SNAPSHOT_MS % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
      deadline.tv_sec++;
      deadline.tv_nsec -= 1000000000L;
    }
    ret = 1;
    while (h->attached && h->served < ticket) {
      if (pthread_cond_timedwait(&h->cv, &h->mu, &deadline) == ETIMEDOUT) {
        ret = h->served >= ticket ? 1 : -ETIMEDOUT;
        break;
      }
    }
  }
  pthread_mutex_unlock(&h->mu);
  return ret;
}

static int on_metrics(void *arg, FILE *out, const char **ctype) {
  struct shard_http *h = arg;
  snapshot(h);
  *ctype = METRICS_CONTENT_TYPE;
  return metrics_render(h->reg, out) == 0 ? 200 : 500;
}

static int on_healthz(void *arg, FILE *out, const char **ctype) {
  struct shard_http *h = arg;
  (void)ctype;
  if (snapshot(h) < 0) {
    fprintf(out, "event loop did not answer within %d ms\n", SHARD_HTTP_SNAPSHOT_MS);
    return 503;
  }
  fprintf(out, "ok: %s\n", state_names[atomic_load(&h->state)]);
  return 200;
}

static int on_readyz(void *arg, FILE *out, const char **ctype) {
  struct shard_http *h = arg;
  (void)ctype;
  int snap = snapshot(h);
  int st = atomic_load(&h->state);
  if (st == S_DONE) {
    fputs("done: worker 0 ended the training; no longer serving workers\n", out);
    return 503;
  }
  if (st == S_READY && snap < 0) {
    fprintf(out, "not ready: event loop did not answer within %d ms\n", SHARD_HTTP_SNAPSHOT_MS);
    return 503;
  }
  if (st == S_READY) {
    fputs("ready: listening, state loaded\n", out);
    return 200;
  }
  fprintf(out, "not ready: %s\n", state_names[st]);
  return 503;
}

/* ---- setup -------------------------------------------------------------- */

static void set_state(struct shard_http *h, enum shard_state st) {
  atomic_store(&h->state, (int)st);
  metric_set(h->ready, st == S_READY);
  metric_set(h->done, st == S_DONE);
}

static int build_metrics(struct shard_http *h, const struct shard_http_opts *o) {
  struct metrics *m = h->reg = metrics_new();
  if (!m) return -ENOMEM;
  h->pushes =
      metrics_counter(m, "ps_server_pushes_total", "gradient pushes received, duplicates included");
  h->pulls = metrics_counter(m, "ps_server_pulls_total", "parameter pulls received");
  h->updates = metrics_counter(m, "ps_server_updates_total",
                               "optimizer updates applied (one per key and version)");
  h->duplicates = metrics_counter(m, "ps_server_duplicate_pushes_total",
                                  "pushes recognised as resends after a reconnect, not applied");
  h->bytes_in =
      metrics_counter(m, "ps_server_received_bytes_total", "bytes of frames received from workers");
  h->bytes_out =
      metrics_counter(m, "ps_server_sent_bytes_total", "bytes of frames sent to workers");
  h->rejected = metrics_counter(m, "ps_server_rejected_frames_total",
                                "frames refused with an error, after which the connection closed");
  /* errors by kind: every ErrorCode of the wire schema except ERR_NONE */
  h->codes = &ps__error_code__descriptor;
  size_t n = h->codes->n_values;
  const char **kinds = calloc(n + 1, sizeof(char *));
  char(*names)[48] = calloc(n + 1, sizeof(*names));
  if (!kinds || !names) {
    free(kinds);
    free(names);
    return -ENOMEM;
  }
  for (size_t i = 0; i < n; i++) {
    const char *src = h->codes->values[i].name;
    if (strncmp(src, "ERR_", 4) == 0) src += 4;
    size_t j = 0;
    for (; src[j] && j + 1 < sizeof(names[i]); j++)
      names[i][j] = (char)(src[j] >= 'A' && src[j] <= 'Z' ? src[j] - 'A' + 'a' : src[j]);
    names[i][j] = 0;
    kinds[i] = names[i];
  }
  snprintf(names[n], sizeof(names[n]), "other");
  kinds[n] = names[n];
  h->errors = metrics_counter_vec(m, "ps_server_errors_total",
                                  "clients refused, by the error code they were sent", "kind",
                                  n + 1, kinds, n + 1);
  free(kinds);
  free(names);
  h->connections = metrics_gauge(m, "ps_server_connected_workers",
                                 "open worker connections (a worker holds one per shard)");
  h->keys = metrics_gauge(m, "ps_server_keys", "keys (tensor chunks) this shard holds");
  h->param_bytes =
      metrics_gauge(m, "ps_server_param_bytes", "bytes of parameters this shard holds");
  h->min_version =
      metrics_gauge(m, "ps_server_min_version",
                    "lowest version over this shard's keys: the job's progress in steps");
  h->key_version =
      metrics_gauge_vec(m, "ps_server_key_version", "version of each key (first 1024 keys)", "key",
                        KEY_SERIES_MAX, NULL, 0);
  uint32_t ranks = o->num_workers < RANK_SERIES_MAX ? o->num_workers : RANK_SERIES_MAX;
  h->clock = metrics_gauge_vec(m, "ps_server_worker_clock",
                               "step each worker pushes next on this shard (lowest over its "
                               "keys): a straggler shows as the smallest",
                               "rank", ranks ? ranks : 1, NULL, 0);
  static const char *const results[] = {"written", "failed", "skipped"};
  h->ckpt_enabled = metrics_gauge(m, "ps_server_checkpoints_enabled",
                                  "1 when this shard writes checkpoints (--checkpoint-dir)");
  h->ckpts = metrics_counter_vec(m, "ps_server_checkpoints_total",
                                 "checkpoints written, failed, or skipped (the writer was busy)",
                                 "result", 3, results, 3);
  h->ckpt_clock = metrics_gauge(m, "ps_server_checkpoint_clock",
                                "version of the newest checkpoint written (-1 = none yet)");
  h->ckpt_age = metrics_gauge(m, "ps_server_checkpoint_age_steps",
                              "checkpoint age: steps (versions) applied since the newest "
                              "checkpoint, i.e. what a crash now would lose");
  h->ckpt_age_s = metrics_gauge(m, "ps_server_checkpoint_age_seconds",
                                "checkpoint age in time: seconds since the newest checkpoint was "
                                "committed (since the start while there is none)");
  h->ckpt_seconds = metrics_gauge(m, "ps_server_checkpoint_write_seconds",
                                  "how long writing the newest checkpoint took");
  h->ckpt_bytes = metrics_gauge(m, "ps_server_checkpoint_bytes", "size of the newest checkpoint");
  h->ckpt_failures = metrics_counter(m, "ps_server_checkpoint_failures_total",
                                     "checkpoint writes that failed (full, read-only or vanished "
                                     "--checkpoint-dir; the log names the errno)");
  h->ckpt_skipped = metrics_counter(m, "ps_server_checkpoints_skipped_total",
                                    "checkpoints not taken because the previous write was still "
                                    "running (not a failure)");
  h->ckpt_in_a_row = metrics_gauge(m, "ps_server_checkpoint_failures_in_a_row",
                                   "checkpoint writes failed since the last success; "
                                   "--checkpoint-max-failures of them stop the job");
  h->ckpt_last_ts = metrics_gauge(m, "ps_server_last_checkpoint_timestamp_seconds",
                                  "when the newest checkpoint was committed, in seconds since the "
                                  "epoch (0 = none yet): alert on time() minus this");
  h->ready = metrics_gauge(m, "ps_server_ready", "1 when /readyz answers 200");
  h->done = metrics_gauge(m, "ps_server_training_done", "1 once worker 0 ended the training");
  h->shard_id = metrics_gauge(m, "ps_server_shard", "this shard's id");
  /* the labels are the registry's names, in its order */
  const char *transports[16];
  size_t ntp = conn_transport_count();
  if (ntp > sizeof(transports) / sizeof(transports[0])) return -EINVAL;
  for (size_t i = 0; i < ntp; i++) transports[i] = conn_transport_name(i);
  h->transport = metrics_gauge_vec(m, "ps_server_transport",
                                   "1 for the transport workers reach this shard by (--transport)",
                                   "transport", ntp, transports, ntp);
  h->rndv = metrics_counter(m, "ps_server_rendezvous_payloads_total",
                            "payloads UCX fetched by rendezvous straight into their destination "
                            "(--transport ucx; 0 on tcp)");
  static const double stale_bounds[] = {0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64};
  h->staleness = metrics_histogram(
      m, "ps_server_push_staleness",
      "asp/ssp: updates applied to a key between the pull a push's gradient was computed on and "
      "the push (0 = computed on the current parameters); bsp: none",
      stale_bounds, sizeof(stale_bounds) / sizeof(stale_bounds[0]));
  h->no_base = metrics_counter(m, "ps_server_pushes_without_base_total",
                               "asp/ssp pushes applied that did not say which version they were "
                               "computed on (an older client), counted as staleness 0");
  h->lost = metrics_counter(m, "ps_server_lost_updates_total",
                            "asp/ssp: updates made after the checkpoint this shard restarted "
                            "from (a kill -9), counted when their rank came back beyond it");
  h->silent = metrics_counter(m, "ps_server_silent_workers_total",
                              "workers whose heartbeats stopped for --worker-timeout (stopped, "
                              "hung or cut off): their connection closed, the timeout acted on");
  h->workers_lost = metrics_counter(m, "ps_server_workers_lost_total",
                                    "times this shard went on without a worker gone for "
                                    "--worker-timeout (--on-worker-timeout continue): the job "
                                    "trains without its data until it rejoins");
  h->start_time = metrics_gauge(m, "process_start_time_seconds",
                                "start time of the process since the Unix epoch in seconds");
  if (!h->pushes || !h->pulls || !h->updates || !h->duplicates || !h->bytes_in || !h->bytes_out ||
      !h->rejected || !h->errors || !h->connections || !h->keys || !h->param_bytes ||
      !h->min_version || !h->key_version || !h->clock || !h->ready || !h->done || !h->shard_id ||
      !h->start_time || !h->ckpt_enabled || !h->ckpts || !h->ckpt_clock || !h->ckpt_age ||
      !h->ckpt_age_s || !h->ckpt_seconds || !h->ckpt_bytes || !h->ckpt_failures ||
      !h->ckpt_skipped || !h->ckpt_in_a_row || !h->ckpt_last_ts || !h->transport || !h->rndv ||
      !h->staleness || !h->no_base || !h->silent || !h->lost || !h->workers_lost)
    return -ENOMEM;
  int tpi = conn_transport_index(o->transport);
  if (tpi < 0) return -EINVAL;
  metric_vec_set(h->transport, (size_t)tpi, 1);
  char **labels = calloc(ranks ? ranks : 1, sizeof(char *));
  if (!labels) return -ENOMEM;
  int r = 0;
  for (uint32_t i = 0; i < ranks && r == 0; i++)
    if (asprintf(&labels[i], "%" PRIu32, i) < 0) {
      labels[i] = NULL;
      r = -ENOMEM;
    }
  if (r == 0) r = metric_vec_set_labels(h->clock, (const char *const *)labels, ranks);
  for (uint32_t i = 0; i < ranks; i++) free(labels[i]);
  free(labels);
  if (r < 0) return r;
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  metric_set(h->start_time, (double)now.tv_sec + (double)now.tv_nsec * 1e-9);
  metric_set(h->shard_id, o->shard);
  metric_set(h->ckpt_clock, -1);
  return 0;
}

int shard_http_start(const struct shard_http_opts *o, struct shard_http **out, char *err,
                     size_t errlen) {
  *out = NULL;
  struct shard_http *h = calloc(1, sizeof(*h));
  if (h) h->started_s = clock_now_s();
  if (!h) return -ENOMEM;
  h->num_workers = o->num_workers;
  pthread_mutex_init(&h->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&h->cv, &ca);
  pthread_condattr_destroy(&ca);
  int r = build_metrics(h, o);
  if (r < 0) {
    snprintf(err, errlen, "out of memory");
    shard_http_stop(h);
    return r;
  }
  set_state(h, S_STARTING);
  if (o->listen && o->listen[0]) {
    struct http_route routes[] = {
        {"/metrics", on_metrics, h}, {"/healthz", on_healthz, h}, {"/readyz", on_readyz, h}};
    struct http_opts ho = {.listen = o->listen, .routes = routes, .num_routes = 3};
    r = http_start(&ho, &h->http, err, errlen);
    if (r < 0) {
      shard_http_stop(h);
      return r;
    }
  }
  *out = h;
  return 0;
}

const char *shard_http_address(const struct shard_http *h) {
  return h && h->http ? http_address(h->http) : "";
}

void shard_http_stop(struct shard_http *h) {
  if (!h) return;
  http_stop(h->http);
  metrics_free(h->reg);
  pthread_cond_destroy(&h->cv);
  pthread_mutex_destroy(&h->mu);
  free(h);
}

bool shard_http_done(const struct shard_http *h) {
  return h && atomic_load(&h->state) == S_DONE;
}

/* ---- loop thread -------------------------------------------------------- */

static void on_async(uv_async_t *a) {
  struct shard_http *h = a->data;
  pthread_mutex_lock(&h->mu);
  uint64_t ticket = h->requested;
  pthread_mutex_unlock(&h->mu);
  h->fn(h->arg);
  pthread_mutex_lock(&h->mu);
  h->served = ticket;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
}

int shard_http_attach(struct shard_http *h, uv_loop_t *loop, shard_http_snapshot_fn fn, void *arg) {
  if (!h) return 0;
  h->fn = fn;
  h->arg = arg;
  int r = uv_async_init(loop, &h->async, on_async);
  if (r < 0) return r;
  h->async.data = h;
  uv_unref((uv_handle_t *)&h->async); /* scrapes never keep the loop alive */
  fn(arg);
  pthread_mutex_lock(&h->mu);
  h->attached = true;
  pthread_mutex_unlock(&h->mu);
  return 0;
}

void shard_http_set_ready(struct shard_http *h) {
  if (h) set_state(h, S_READY);
}

void shard_http_stopping(struct shard_http *h, bool done) {
  if (h) set_state(h, done ? S_DONE : S_STOPPING);
}

void shard_http_detach(struct shard_http *h) {
  if (!h) return;
  pthread_mutex_lock(&h->mu);
  bool was = h->attached;
  h->attached = false;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
  if (!was) return;
  h->fn(h->arg); /* the final values stay visible */
  uv_close((uv_handle_t *)&h->async, NULL);
}

static void add_delta(struct metric *c, uint64_t now, uint64_t *last) {
  if (now > *last) metric_inc(c, now - *last);
  *last = now;
}

void shard_http_publish(struct shard_http *h, const struct store *st,
                        const struct server_traffic *t, uint32_t connections) {
  if (!h) return;
  add_delta(h->pushes, st->stats.pushes, &h->last.pushes);
  add_delta(h->pulls, t->pulls, &h->last_traffic.pulls);
  add_delta(h->updates, st->stats.updates, &h->last.updates);
  add_delta(h->duplicates, st->stats.duplicates, &h->last.duplicates);
  add_delta(h->bytes_in, t->bytes_in, &h->last_traffic.bytes_in);
  add_delta(h->bytes_out, t->bytes_out, &h->last_traffic.bytes_out);
  add_delta(h->rejected, t->rejected_frames, &h->last_traffic.rejected_frames);
  add_delta(h->rndv, t->rndv_in, &h->last_traffic.rndv_in);
  add_delta(h->no_base, st->stats.no_base, &h->last.no_base);
  add_delta(h->silent, t->silent, &h->last_traffic.silent);
  add_delta(h->workers_lost, t->workers_lost, &h->last_traffic.workers_lost);
  add_delta(h->lost, st->stats.lost, &h->last.lost);
  for (uint64_t tau = 0; tau < STORE_STALENESS_SLOTS; tau++) {
    uint64_t now = st->stats.staleness[tau], *last = &h->last.staleness[tau];
    if (now <= *last) continue;
    bool over = tau == STORE_STALENESS_SLOTS - 1; /* >= 64: its own sum */
    double sum = over ? (double)(st->stats.staleness_over_sum - h->last.staleness_over_sum)
                      : (double)(tau * (now - *last));
    /* the group >= 64 lands in the bucket of its mean (64, or +Inf when above) */
    metric_observe_n(h->staleness, over ? sum / (double)(now - *last) : (double)tau, now - *last,
                     sum);
    if (over) h->last.staleness_over_sum = st->stats.staleness_over_sum;
    *last = now;
  }
  metric_set(h->connections, connections);
  if (!st->has_layout) return;
  metric_set(h->keys, (double)st->num_keys);
  metric_set(h->param_bytes, (double)st->param_bytes);
  size_t nk = st->num_keys < KEY_SERIES_MAX ? st->num_keys : KEY_SERIES_MAX;
  if (!h->keys_labelled) {
    char(*names)[17] = calloc(nk ? nk : 1, sizeof(*names));
    const char **ptrs = calloc(nk ? nk : 1, sizeof(char *));
    if (names && ptrs) {
      for (size_t i = 0; i < nk; i++) {
        snprintf(names[i], sizeof(names[i]), "%016" PRIx64, st->keys[i].key);
        ptrs[i] = names[i];
      }
      h->keys_labelled = metric_vec_set_labels(h->key_version, ptrs, nk) == 0;
    }
    free(names);
    free(ptrs);
  }
  uint64_t minv = UINT64_MAX;
  for (size_t i = 0; i < st->num_keys; i++) {
    if (st->keys[i].version < minv) minv = st->keys[i].version;
    if (i < nk) metric_vec_set(h->key_version, i, (double)st->keys[i].version);
  }
  h->min_seen = st->num_keys ? (double)minv : 0;
  metric_set(h->min_version, h->min_seen);
  uint32_t ranks = h->num_workers < RANK_SERIES_MAX ? h->num_workers : RANK_SERIES_MAX;
  for (uint32_t r = 0; r < ranks; r++) {
    uint64_t c = UINT64_MAX;
    for (size_t i = 0; i < st->num_keys; i++)
      if (st->keys[i].next_step && store_owns(&st->keys[i], r) && st->keys[i].next_step[r] < c)
        c = st->keys[i].next_step[r];
    metric_vec_set(h->clock, r, c == UINT64_MAX ? 0 : (double)c);
  }
}

void shard_http_publish_checkpoints(struct shard_http *h, const struct shard_http_ckpt *c) {
  if (!h) return;
  metric_set(h->ckpt_enabled, c != NULL);
  if (!c) return;
  uint64_t now[3] = {c->written, c->failed, c->skipped};
  for (size_t i = 0; i < 3; i++) {
    if (now[i] > h->last_ckpt[i]) {
      metric_vec_inc(h->ckpts, i, now[i] - h->last_ckpt[i]);
      if (i == 1) metric_inc(h->ckpt_failures, now[i] - h->last_ckpt[i]);
      if (i == 2) metric_inc(h->ckpt_skipped, now[i] - h->last_ckpt[i]);
    }
    h->last_ckpt[i] = now[i];
  }
  metric_set(h->ckpt_in_a_row, c->failed_in_a_row);
  if (c->written == 0) {
    metric_set(h->ckpt_age, h->min_seen); /* nothing saved yet: all of it */
    metric_set(h->ckpt_age_s, clock_now_s() - h->started_s);
    return;
  }
  metric_set(h->ckpt_clock, (double)c->last_clock);
  metric_set(h->ckpt_age,
             h->min_seen > (double)c->last_clock ? h->min_seen - (double)c->last_clock : 0);
  metric_set(h->ckpt_age_s, clock_now_s() - c->last_done_s);
  metric_set(h->ckpt_seconds, c->last_seconds);
  metric_set(h->ckpt_bytes, (double)c->last_bytes);
  metric_set(h->ckpt_last_ts, c->last_unix_s);
}

void shard_http_count_error(struct shard_http *h, int code) {
  if (!h) return;
  size_t n = h->codes->n_values;
  for (size_t i = 0; i < n; i++) {
    if (h->codes->values[i].value == code) {
      metric_vec_inc(h->errors, i, 1);
      return;
    }
  }
  metric_vec_inc(h->errors, n, 1);
}
