/* sync_ring: all-reduce backend of the trainer (see sync_ring.h).
 *
 * State per step: `fetched` is the version the model holds; grad_ready for
 * step s (== fetched) fills buckets and queues them; fetch(s+1) waits for
 * the buckets in queue order, applies the optimizer and sets fetched = s+1.
 * A bucket is in flight from its queueing until that wait; nothing touches
 * its buffer meanwhile (the trainer does not write a gradient again before
 * the next fetch).
 *
 * Sharded optimizer state (shard_state, ZeRO-1): every bucket has a fused
 * buffer of W equal chunks (the tail zero-padded); grad_ready copies the
 * gradient in and queues its reduce-scatter (mean) into `mean`; fetch waits
 * for each in order and updates this rank's chunk of the bucket's
 * parameters (gathered into its place in `stage`) with its own chunk of
 * velocity; then one all-gather of `stage` (rank r's region holds its chunk
 * of every bucket, so one operation carries them all) and every bucket's
 * parameters are copied back into the tensors. */
#include "sync_ring.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "tensor_math.h"
#include "worker_ckpt_agree.h"

struct bucket {
  int first, last; /* tensors first >= t >= last (backward order) */
  float *fused;    /* NULL: a single tensor (or a piece of one) reduced in place */
  size_t begin;    /* a piece: its first element in tensor `first` */
  size_t count;
  int waiting; /* gradients not yet arrived this step */
  bool inflight;
  ps_coll_request *req;
  /* shard_state: count = W * chunk floats of fused (padded), this rank's
   * chunk of the mean gradient, of the velocity, and the parameters (W
   * chunks) being all-gathered */
  size_t chunk;
  float *mean, *vel;
  size_t stage_off; /* its chunk's place in each rank's region of stage */
};

struct sync_ring {
  ps_coll *c;
  struct ps_nccl *nccl;
  struct sync_ring_opts o;
  int nt, nb;
  struct bucket *b;
  int *bucket_of;    /* a tensor cut in pieces: its first piece */
  int *pieces_of;    /* 1, or the pieces of a tensor larger than a bucket */
  size_t *offset_of; /* floats into the bucket's fused buffer */
  float **velocity;  /* per tensor, NULL without momentum (or with shard_state) */
  size_t state_bytes;
  float *stage; /* shard_state: W regions of stage_len floats */
  size_t stage_len;
  uint64_t fetched;
  bool pending;           /* gradients of step `fetched` were queued */
  struct ckpt_io *io;     /* with ckpt_dir: the checkpoint writes */
  uint32_t ckpt_failures; /* checkpoint writes failed in a row */
  bool ckpt_stop;         /* ckpt_max_failures reached: msg says so, training stops */
  ps_status status;
  char msg[640];
};

/* Records the first failure; the message comes from NCCL when it failed
 * there (via_nccl), else from the TCP group. */
static int fail_via(struct sync_ring *s, ps_status st, bool via_nccl) {
  if (s->status == PS_OK) {
    s->status = st;
    if (via_nccl)
      ps_nccl_errmsg(s->nccl, s->msg, sizeof(s->msg));
    else
      ps_coll_errmsg(s->c, s->msg, sizeof(s->msg));
  }
  return s->status == PS_ERR_IO || s->status == PS_ERR_CONNECT ? -ECONNRESET : -EPROTO;
}

static int fail(struct sync_ring *s, ps_status st) {
  return fail_via(s, st, s->nccl != NULL);
}

static int internal_error(struct sync_ring *s, const char *what, uint64_t a, uint64_t b) {
  snprintf(s->msg, sizeof(s->msg), "internal error: %s (%llu, %llu)", what, (unsigned long long)a,
           (unsigned long long)b);
  s->status = PS_ERR_STATE;
  return -EPROTO;
}

static float *bucket_buf(struct sync_ring *s, struct mlp *m, const struct bucket *bk) {
  return bk->fused ? bk->fused : mlp_grad(m, bk->first) + bk->begin;
}

int sync_ring_open(ps_coll *c, struct ps_nccl *nccl, const struct sync_ring_opts *o, struct mlp *m,
                   struct sync_ring **out) {
  *out = NULL;
  if (o->shard_state && (nccl || o->ckpt_dir)) return -EINVAL;
  struct sync_ring *s = calloc(1, sizeof(*s));
  if (!s) return -ENOMEM;
  s->c = c;
  s->nccl = nccl;
  s->o = *o;
  s->nt = mlp_num_tensors(m);
  /* Over TCP, a tensor larger than a bucket is cut into pieces of at most a
   * bucket, each reduced in place as soon as backward has computed it (the
   * CUDA device computes a gradient whole: NCCL gets whole tensors). */
  size_t split = nccl ? 0 : o->fusion_bytes, cap = 0;
  for (int t = 0; t < s->nt; t++) {
    size_t bytes = mlp_tensor_count(m, t) * sizeof(float);
    cap += split && bytes > split ? (bytes + split - 1) / split : 1;
  }
  s->b = calloc(cap, sizeof(*s->b));
  s->bucket_of = calloc((size_t)s->nt, sizeof(int));
  s->pieces_of = calloc((size_t)s->nt, sizeof(int));
  s->offset_of = calloc((size_t)s->nt, sizeof(size_t));
  s->velocity = calloc((size_t)s->nt, sizeof(float *));
  if (!s->b || !s->bucket_of || !s->pieces_of || !s->offset_of || !s->velocity) goto nomem;
  /* One small file per checkpoint from the training thread: plain syscalls
   * (io_uring would gain nothing here). */
  if (o->ckpt_dir && ckpt_io_open(CKPT_IO_SYNC, &s->io) < 0) goto nomem;

  /* Greedy packing in backward order. */
  size_t fill = 0;
  for (int t = s->nt - 1; t >= 0; t--) {
    size_t count = mlp_tensor_count(m, t), bytes = count * sizeof(float);
    s->pieces_of[t] = 1;
    if (split && bytes > split) {
      size_t np = (bytes + split - 1) / split;
      size_t piece = ((count + np - 1) / np + 15) / 16 * 16; /* 64-byte aligned starts */
      s->bucket_of[t] = s->nb;
      s->pieces_of[t] = 0;
      for (size_t at = 0; at < count; at += piece) {
        struct bucket *bk = &s->b[s->nb++];
        bk->first = bk->last = t;
        bk->begin = at;
        bk->count = count - at < piece ? count - at : piece;
        s->pieces_of[t]++;
      }
      fill = o->fusion_bytes; /* the next tensor opens a bucket */
      continue;
    }
    struct bucket *cur = s->nb ? &s->b[s->nb - 1] : NULL;
    if (!cur || fill + bytes > o->fusion_bytes) {
      cur = &s->b[s->nb++];
      cur->first = t;
      fill = 0;
    }
    cur->last = t;
    s->bucket_of[t] = s->nb - 1;
    s->offset_of[t] = cur->count;
    cur->count += mlp_tensor_count(m, t);
    fill += bytes;
  }
  const size_t W = (size_t)ps_coll_world_size(c);
  for (int i = 0; i < s->nb; i++) {
    struct bucket *bk = &s->b[i];
    if (o->shard_state) {
      bk->chunk = ((bk->count + W - 1) / W + 15) / 16 * 16; /* 64-byte aligned chunks */
      size_t all = W * bk->chunk * sizeof(float), own = bk->chunk * sizeof(float);
      if (!(bk->fused = aligned_alloc(64, all)) || !(bk->mean = aligned_alloc(64, own)) ||
          (o->momentum != 0.0f && !(bk->vel = calloc(bk->chunk, sizeof(float)))))
        goto nomem;
      memset(bk->fused, 0, all); /* the padding stays zero */
      bk->stage_off = s->stage_len;
      s->stage_len += bk->chunk;
      if (bk->vel) s->state_bytes += own;
      continue;
    }
    if (bk->first != bk->last &&
        !(bk->fused = aligned_alloc(64, (bk->count * sizeof(float) + 63) / 64 * 64)))
      goto nomem;
  }
  if (o->shard_state && !(s->stage = calloc(W * s->stage_len, sizeof(float)))) goto nomem;
  if (o->momentum != 0.0f && !o->shard_state) {
    for (int t = 0; t < s->nt; t++) {
      if (!(s->velocity[t] = calloc(mlp_tensor_count(m, t), sizeof(float)))) goto nomem;
      s->state_bytes += mlp_tensor_count(m, t) * sizeof(float);
    }
  }
  /* Everyone starts from rank 0's parameters. */
  for (int t = 0; t < s->nt; t++) {
    ps_status st = ps_coll_broadcast(c, mlp_param(m, t), mlp_tensor_count(m, t) * sizeof(float), 0);
    if (st != PS_OK) {
      int r = fail_via(s, st, false);
      log_error("cannot broadcast the initial parameters", "error=\"%s\"", s->msg);
      sync_ring_close(s);
      return r;
    }
  }
  *out = s;
  return 0;
nomem:
  sync_ring_close(s);
  return -ENOMEM;
}

/* Waits for every bucket in flight; returns the first failure. */
static ps_status drain(struct sync_ring *s) {
  ps_status first = PS_OK;
  for (int i = 0; i < s->nb; i++) {
    struct bucket *bk = &s->b[i];
    if (!bk->inflight) continue;
    ps_status st = s->nccl ? ps_nccl_wait_slot(s->nccl, i) : ps_coll_wait(bk->req);
    bk->inflight = false;
    bk->req = NULL;
    if (first == PS_OK) first = st;
  }
  return first;
}

void sync_ring_close(struct sync_ring *s) {
  if (!s) return;
  if (s->b) drain(s);
  for (int i = 0; s->b && i < s->nb; i++) {
    free(s->b[i].fused);
    free(s->b[i].mean);
    free(s->b[i].vel);
  }
  free(s->stage);
  for (int t = 0; s->velocity && t < s->nt; t++) free(s->velocity[t]);
  free(s->velocity);
  free(s->b);
  free(s->bucket_of);
  free(s->pieces_of);
  free(s->offset_of);
  ckpt_io_close(s->io);
  free(s);
}

size_t sync_ring_state_bytes(const struct sync_ring *s) {
  return s->state_bytes;
}

int sync_ring_buckets(const struct sync_ring *s, size_t *bytes, int max) {
  for (int i = 0; i < s->nb && i < max; i++) bytes[i] = s->b[i].count * sizeof(float);
  return s->nb;
}

float sync_ring_lr(const struct sync_ring_opts *o, uint64_t step) {
  if (o->lr_decay_steps == 0) return (float)o->lr;
  double f = step >= o->lr_decay_steps ? 1.0 : (double)step / (double)o->lr_decay_steps;
  return (float)(o->lr * 0.5 * (1.0 + cos(M_PI * f)));
}

/* The checkpoint of version `fetched` (the parameters for that step and the
 * velocity). A failure is logged and training goes on on the previous
 * checkpoint, unless it is the ckpt_max_failures-th in a row: then -EIO,
 * with msg saying why, and training stops. */
static int save(struct sync_ring *s, struct mlp *m) {
  float *param[2 * MLP_MAX_SIZES];
  size_t count[2 * MLP_MAX_SIZES];
  const char *name[2 * MLP_MAX_SIZES];
  struct worker_ckpt_tensors t;
  worker_ckpt_tensors_of_mlp(m, s->velocity, param, count, name, &t);
  int r =
      worker_ckpt_save_counted(s->io, s->o.ckpt_dir, &s->o.ckpt_id, s->fetched, &t,
                               s->o.ckpt_max_failures, &s->ckpt_failures, s->msg, sizeof(s->msg));
  if (r < 0) s->ckpt_stop = true;
  return r;
}

int sync_ring_resume(struct sync_ring *s, struct mlp *m, uint64_t *step) {
  *step = 0;
  if (!s->o.ckpt_dir) return 0;
  float *param[2 * MLP_MAX_SIZES];
  size_t count[2 * MLP_MAX_SIZES];
  const char *name[2 * MLP_MAX_SIZES];
  struct worker_ckpt_tensors t;
  worker_ckpt_tensors_of_mlp(m, s->velocity, param, count, name, &t);
  ps_status st = PS_OK;
  int ret = worker_ckpt_agree(s->c, s->o.ckpt_dir, &s->o.ckpt_id, &t, step, &st);
  if (st != PS_OK) return fail_via(s, st, false);
  if (ret == 0) s->fetched = *step;
  return ret;
}

/* Waits for bucket i's operation in flight; on its failure, for every other
 * one too, and returns the error. */
static int settle(struct sync_ring *s, int i) {
  struct bucket *bk = &s->b[i];
  ps_status st = s->nccl ? ps_nccl_wait_slot(s->nccl, i) : ps_coll_wait(bk->req);
  bk->inflight = false;
  bk->req = NULL;
  if (st == PS_OK) return 0;
  int r = fail(s, st);
  drain(s);
  return r;
}

/* Elements [a, b) of bucket bk's layout, between the tensors' parameters
 * and buf[0, b - a): into buf (out) or back from it. */
static void bucket_params(const struct sync_ring *s, struct mlp *m, const struct bucket *bk,
                          size_t a, size_t b, float *buf, bool out) {
  if (s->pieces_of[bk->first] > 1) { /* a piece of one tensor, from element begin */
    float *p = mlp_param(m, bk->first) + bk->begin + a;
    if (out)
      memcpy(buf, p, (b - a) * sizeof(float));
    else
      memcpy(p, buf, (b - a) * sizeof(float));
    return;
  }
  for (int t = bk->first; t >= bk->last; t--) {
    size_t off = s->offset_of[t], n = mlp_tensor_count(m, t);
    size_t lo = a > off ? a : off, hi = b < off + n ? b : off + n;
    if (lo >= hi) continue;
    float *p = mlp_param(m, t) + (lo - off);
    if (out)
      memcpy(buf + (lo - a), p, (hi - lo) * sizeof(float));
    else
      memcpy(p, buf + (lo - a), (hi - lo) * sizeof(float));
  }
}

/* shard_state: the step's update from the reduce-scattered means (see the
 * top of the file). */
static int fetch_sharded(struct sync_ring *s, struct mlp *m) {
  const size_t r = (size_t)ps_coll_rank(s->c), W = (size_t)ps_coll_world_size(s->c);
  float lr = sync_ring_lr(&s->o, s->fetched);
  float *region = s->stage + r * s->stage_len;
  for (int i = 0; i < s->nb; i++) {
    struct bucket *bk = &s->b[i];
    int ret = settle(s, i);
    if (ret < 0) return ret;
    size_t a = r * bk->chunk, b = a + bk->chunk < bk->count ? a + bk->chunk : bk->count;
    float *mine = region + bk->stage_off;
    bucket_params(s, m, bk, a, b > a ? b : a, mine, true);
    tm_sgd_momentum(mine, bk->vel, bk->mean, lr, s->o.momentum, b > a ? b - a : 0);
  }
  ps_status st = ps_coll_allgather(s->c, region, s->stage, s->stage_len * sizeof(float));
  if (st != PS_OK) return fail(s, st);
  for (int i = 0; i < s->nb; i++) {
    const struct bucket *bk = &s->b[i];
    for (size_t q = 0; q < W && q * bk->chunk < bk->count; q++) {
      size_t a = q * bk->chunk, b = a + bk->chunk < bk->count ? a + bk->chunk : bk->count;
      bucket_params(s, m, bk, a, b, s->stage + q * s->stage_len + bk->stage_off, false);
    }
  }
  return 0;
}

static int ring_fetch(void *ctx, struct mlp *m, uint64_t step) {
  struct sync_ring *s = ctx;
  if (s->ckpt_stop) return -EIO;
  if (s->status != PS_OK) return fail(s, s->status);
  if (s->pending && s->o.shard_state) {
    for (int i = 0; i < s->nb; i++)
      if (!s->b[i].inflight)
        return internal_error(s, "bucket not queued at fetch", (uint64_t)i, step);
    int r = fetch_sharded(s, m);
    if (r < 0) return r;
    s->pending = false;
    s->fetched++;
  }
  if (s->pending) {
    float lr = sync_ring_lr(&s->o, s->fetched);
    /* Buckets in queue order: the first ones were queued earliest. */
    for (int i = 0; i < s->nb; i++) {
      struct bucket *bk = &s->b[i];
      if (!bk->inflight) return internal_error(s, "bucket not queued at fetch", (uint64_t)i, step);
      int r = settle(s, i);
      if (r < 0) return r;
      const float *g = bucket_buf(s, m, bk);
      if (s->pieces_of[bk->first] > 1) {
        float *v = s->velocity[bk->first];
        tm_sgd_momentum(mlp_param(m, bk->first) + bk->begin, v ? v + bk->begin : NULL, g, lr,
                        s->o.momentum, bk->count);
        continue;
      }
      for (int t = bk->first; t >= bk->last; t--)
        tm_sgd_momentum(mlp_param(m, t), s->velocity[t], g + s->offset_of[t], lr, s->o.momentum,
                        mlp_tensor_count(m, t));
    }
    s->pending = false;
    s->fetched++;
    if (s->o.ckpt_dir && s->o.ckpt_every && s->fetched % s->o.ckpt_every == 0 && save(s, m) < 0)
      return -EIO;
  }
  if (step != s->fetched) return internal_error(s, "version asked, version held", step, s->fetched);
  return 0;
}

/* Starts the all-reduce of bucket bi (every rank queues buckets in index order). */
static int queue(struct sync_ring *s, struct mlp *m, int bi) {
  struct bucket *bk = &s->b[bi];
  float *buf = bucket_buf(s, m, bk);
  ps_status st = s->o.shard_state ? ps_coll_reduce_scatter_async(s->c, buf, bk->mean, bk->chunk,
                                                                 PS_REDOP_AVG, &bk->req)
                 : s->nccl ? ps_nccl_allreduce_host_async(s->nccl, bi, buf, bk->count, PS_REDOP_AVG)
                           : ps_coll_allreduce_async(s->c, buf, bk->count, PS_REDOP_AVG, &bk->req);
  if (st != PS_OK) return fail(s, st);
  bk->inflight = true;
  return 0;
}

static int ring_grad_ready(void *ctx, struct mlp *m, int t, size_t done, uint64_t step) {
  struct sync_ring *s = ctx;
  if (s->status != PS_OK) return fail(s, s->status);
  if (step != s->fetched) return internal_error(s, "gradient step, version held", step, s->fetched);
  int bi = s->bucket_of[t];
  struct bucket *bk = &s->b[bi];
  if (!s->pending) {
    for (int i = 0; i < s->nb; i++) s->b[i].waiting = s->b[i].first - s->b[i].last + 1;
    s->pending = true;
  }
  if (s->pieces_of[t] > 1) { /* each piece goes once it is computed */
    for (int i = bi; i < bi + s->pieces_of[t]; i++) {
      if (!s->b[i].waiting || s->b[i].begin + s->b[i].count > done) continue;
      s->b[i].waiting = 0;
      if (s->o.shard_state) /* into its padded buffer */
        memcpy(s->b[i].fused, mlp_grad(m, t) + s->b[i].begin, s->b[i].count * sizeof(float));
      int r = queue(s, m, i);
      if (r < 0) return r;
    }
    return 0;
  }
  if (done < mlp_tensor_count(m, t)) return 0;
  if (bk->fused)
    memcpy(bk->fused + s->offset_of[t], mlp_grad(m, t), mlp_tensor_count(m, t) * sizeof(float));
  if (--bk->waiting > 0) return 0;
  return queue(s, m, bi);
}

static int ring_grad_blocks(void *ctx, struct mlp *m, size_t *ends, int max) {
  struct sync_ring *s = ctx;
  (void)m;
  if (s->pieces_of[0] < 2 || s->pieces_of[0] > max) return 0;
  for (int i = 0; i < s->pieces_of[0]; i++) {
    const struct bucket *bk = &s->b[s->bucket_of[0] + i];
    ends[i] = bk->begin + bk->count;
  }
  return s->pieces_of[0];
}

static int ring_finish(void *ctx, struct mlp *m, uint64_t step) {
  struct sync_ring *s = ctx;
  int r = ring_fetch(s, m, step);
  if (r < 0) return r;
  ps_status st = ps_coll_barrier(s->c);
  return st == PS_OK ? 0 : fail_via(s, st, false);
}

static const char *ring_err(void *ctx, char *buf, size_t len) {
  struct sync_ring *s = ctx;
  if (s->ckpt_stop)
    snprintf(buf, len, "%s", s->msg);
  else
    snprintf(buf, len, "%s: %s", ps_strerror(s->status), s->msg);
  return buf;
}

void sync_ring_bind(struct sync_ring *s, struct trainer_sync *t) {
  t->ctx = s;
  t->fetch = ring_fetch;
  t->grad_ready = ring_grad_ready;
  t->grad_blocks = ring_grad_blocks;
  t->finish = ring_finish;
  t->errmsg = ring_err;
}
