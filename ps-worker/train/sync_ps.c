/* sync_ps: PS-mode gradient exchange for the trainer (see sync_ps.h). */
#include "sync_ps.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

struct sync_ps {
  ps_client *c;
  int rank;
  int nt;
  float **staging;
  ps_request **push;
  ps_request **pull;
  uint64_t pulling; /* version the in-flight pulls ask for */
  bool have;        /* the model holds version `fetched` */
  uint64_t fetched;
  ps_status status;
  uint64_t rolled_back_to;    /* after -ERESTART: the step the job continues from */
  int lost[SYNC_PS_LOST_MAX]; /* finish: the ranks the shards went on without */
  int n_lost;                 /* how many (more than named), -1 = not known */
};

static int fail(struct sync_ps *s, ps_status st) {
  if (s->status == PS_OK) s->status = st;
  if (st == PS_ERR_STATE_LOST) return -ESTALE; /* the whole job restarts (exit 3) */
  return st == PS_ERR_IO || st == PS_ERR_CONNECT ? -ECONNRESET : -EPROTO;
}

int sync_ps_open(ps_client *c, int rank, struct mlp *m, struct sync_ps **out) {
  struct sync_ps *s = calloc(1, sizeof(*s));
  if (!s) return -ENOMEM;
  s->c = c;
  s->rank = rank;
  s->nt = mlp_num_tensors(m);
  s->staging = calloc((size_t)s->nt, sizeof(float *));
  s->push = calloc((size_t)s->nt, sizeof(ps_request *));
  s->pull = calloc((size_t)s->nt, sizeof(ps_request *));
  const char **names = calloc((size_t)s->nt, sizeof(char *));
  uint64_t *counts = calloc((size_t)s->nt, sizeof(uint64_t));
  int ret = -ENOMEM;
  if (!s->staging || !s->push || !s->pull || !names || !counts) goto fail;
  for (int t = 0; t < s->nt; t++) {
    names[t] = mlp_tensor_name(m, t);
    counts[t] = mlp_tensor_count(m, t);
    if (!(s->staging[t] = malloc(counts[t] * sizeof(float)))) goto fail;
  }
  ps_status st = ps_declare(c, s->nt, names, counts);
  if (st != PS_OK) {
    ret = fail(s, st);
    goto fail;
  }
  if (rank == 0) {
    for (int t = 0; t < s->nt; t++) {
      st = ps_init(c, t, mlp_param(m, t));
      if (st != PS_OK) {
        ret = fail(s, st);
        goto fail;
      }
    }
  }
  s->pulling = UINT64_MAX;
  s->n_lost = -1;
  free(names);
  free(counts);
  *out = s;
  return 0;
fail:
  free(names);
  free(counts);
  if (s->status != PS_OK) {
    char buf[512];
    log_error("cannot set up the model on the shards", "error=\"%s\" detail=\"%s\"",
              ps_strerror(s->status), ps_errmsg(c, buf, sizeof(buf)));
  }
  sync_ps_close(s);
  return ret;
}

void sync_ps_close(struct sync_ps *s) {
  if (!s) return;
  for (int t = 0; t < s->nt; t++) {
    if (s->push && s->push[t]) ps_wait(s->push[t], NULL);
    if (s->pull && s->pull[t]) ps_wait(s->pull[t], NULL);
    if (s->staging) free(s->staging[t]);
  }
  free(s->staging);
  free(s->push);
  free(s->pull);
  free(s);
}

/* A shard came back from an older checkpoint (PS_ERR_ROLLBACK): wait for
 * every request in flight, take every shard back to that checkpoint and
 * tell the trainer to continue from its step (-ERESTART). */
static int rollback(struct sync_ps *s) {
  for (int t = 0; t < s->nt; t++) {
    if (s->push[t]) ps_wait(s->push[t], NULL);
    if (s->pull[t]) ps_wait(s->pull[t], NULL);
    s->push[t] = s->pull[t] = NULL;
  }
  s->pulling = UINT64_MAX;
  s->have = false;
  uint64_t back = ps_rollback_clock(s->c);
  if (back == UINT64_MAX) return fail(s, PS_ERR_ROLLBACK);
  ps_status st = ps_rollback(s->c, back);
  if (st != PS_OK) return fail(s, st);
  s->rolled_back_to = back;
  return -ERESTART;
}

static uint64_t ps_rollback_step(void *ctx) {
  struct sync_ps *s = ctx;
  return s->rolled_back_to;
}

static int ps_fetch(void *ctx, struct mlp *m, uint64_t step) {
  struct sync_ps *s = ctx;
  if (s->have && s->fetched == step) return 0;
  /* pushes first: their gradient buffers are rewritten by the next backward */
  for (int t = 0; t < s->nt; t++) {
    if (!s->push[t]) continue;
    ps_status st = ps_wait(s->push[t], NULL);
    s->push[t] = NULL;
    if (st == PS_ERR_ROLLBACK) return rollback(s);
    if (st != PS_OK) return fail(s, st);
  }
  if (s->pulling != step) {
    for (int t = 0; t < s->nt; t++) {
      ps_status st = ps_pull_async(s->c, t, step, s->staging[t], NULL, NULL, &s->pull[t]);
      if (st != PS_OK) return fail(s, st);
    }
    s->pulling = step;
  }
  for (int t = 0; t < s->nt; t++) {
    uint64_t v = 0;
    ps_status st = ps_wait(s->pull[t], &v);
    s->pull[t] = NULL;
    if (st == PS_ERR_ROLLBACK) return rollback(s);
    if (st != PS_OK) return fail(s, st);
    if (v < step) return fail(s, PS_ERR_REMOTE);
    memcpy(mlp_param(m, t), s->staging[t], mlp_tensor_count(m, t) * sizeof(float));
  }
  s->pulling = UINT64_MAX;
  s->have = true;
  s->fetched = step;
  return 0;
}

static int ps_grad_ready(void *ctx, struct mlp *m, int t, size_t done, uint64_t step) {
  struct sync_ps *s = ctx;
  if (done < mlp_tensor_count(m, t)) return 0;
  /* one batch: the pull's header leaves in the push's last segment */
  ps_batch_begin(s->c);
  ps_status st = ps_push_async(s->c, t, step, mlp_grad(m, t), NULL, NULL, &s->push[t]);
  if (st == PS_OK) st = ps_pull_async(s->c, t, step + 1, s->staging[t], NULL, NULL, &s->pull[t]);
  ps_batch_end(s->c);
  if (st != PS_OK) return fail(s, st);
  s->pulling = step + 1;
  s->have = false;
  return 0;
}

/* Every shard learns this rank is done (a rank still pushing steps then
 * fails at once instead of waiting for ever), the ranks meet in the
 * barrier, and each asks which workers the shards went on without before
 * rank 0 stops the shards (the others' question races with that stop, so
 * they only log a failure). */
static int ps_finish(void *ctx, struct mlp *m, uint64_t step) {
  struct sync_ps *s = ctx;
  int r = ps_fetch(s, m, step);
  if (r < 0) return r;
  ps_status st = ps_leave(s->c, PS_LEAVE_FINISHED);
  if (st == PS_OK) st = ps_barrier(s->c);
  if (st == PS_ERR_ROLLBACK) return rollback(s);
  if (st != PS_OK) return fail(s, st);
  st = ps_lost_workers(s->c, s->lost, SYNC_PS_LOST_MAX, &s->n_lost);
  if (st != PS_OK && s->rank == 0) return fail(s, st);
  if (st != PS_OK) {
    char buf[400];
    log_warn("cannot ask the shards which workers they went on without", "error=\"%s\"",
             ps_errmsg(s->c, buf, sizeof(buf)));
    s->n_lost = -1;
  }
  if (s->rank == 0) {
    st = ps_shutdown_servers(s->c);
    if (st != PS_OK) return fail(s, st);
  }
  return 0;
}

int sync_ps_lost_workers(const struct sync_ps *s, const int **ranks) {
  *ranks = s->lost;
  return s->n_lost;
}

static const char *ps_err(void *ctx, char *buf, size_t len) {
  struct sync_ps *s = ctx;
  char detail[400];
  snprintf(buf, len, "%s: %s", ps_strerror(s->status), ps_errmsg(s->c, detail, sizeof(detail)));
  return buf;
}

void sync_ps_bind(struct sync_ps *s, struct trainer_sync *t) {
  t->ctx = s;
  t->fetch = ps_fetch;
  t->grad_ready = ps_grad_ready;
  t->finish = ps_finish;
  t->errmsg = ps_err;
  t->rollback_step = ps_rollback_step;
}
