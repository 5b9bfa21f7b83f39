/* sync3d_zero: ZeRO-1 over the data-parallel group of a 3D job (see
 * trainer3d.h).
 *
 * One buffer of D regions of L floats, rank-major: region q holds chunk q
 * of every tensor of this rank's stage, tensor i's at off[i] (chunk[i] =
 * ceil(n_i / D) rounded up to 16 floats, so every chunk starts 64-byte
 * aligned; the tail past n_i is zero padding, never written). At
 * REDUCE_GRADS each gradient is cut into its D chunks, copied into the
 * regions and ONE reduce-scatter (mean, in place) leaves region r (this
 * rank's) holding the mean of chunk r of every gradient. At OPTIMIZER_STEP
 * this rank updates its chunk of every tensor's parameters in place with
 * its chunk of velocity (tm_sgd_momentum, sync_ring_lr's schedule: the
 * non-sharded update per element), copies them into region r, and ONE
 * all-gather (in place) brings every rank's chunks; they are copied back
 * into the tensors.
 *
 * Arithmetic: each element's mean is the D-term sum divided by D, as with
 * the all-reduce; D = 2 sums a + b either way, so the parameters equal the
 * non-sharded 3D run bit for bit; with D >= 3 the ring may add the terms in
 * another order (float rounding only). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "tensor_math.h"
#include "trainer3d.h"

#define ALIGN_FLOATS 16

struct sync3d_zero {
  ps_coll *dp;
  struct mp_stage *st;
  struct sync_ring_opts o;
  int nt, r, d;
  size_t *chunk, *off; /* per tensor, in floats */
  size_t len;          /* L: floats per region */
  float *buf;          /* d * len */
  float *vel;          /* len, NULL without momentum */
  ps_coll_request *req;
};

/* Elements [a, b) of tensor i that chunk q holds. */
static void chunk_range(const struct sync3d_zero *z, int i, int q, size_t *a, size_t *b) {
  size_t n = mp_stage_tensor_count(z->st, i);
  *a = (size_t)q * z->chunk[i];
  if (*a > n) *a = n;
  *b = *a + z->chunk[i] < n ? *a + z->chunk[i] : n;
}

int sync3d_zero_open(ps_coll *dp, const struct sync_ring_opts *o, struct mp_stage *st,
                     struct sync3d_zero **out) {
  struct sync3d_zero *z = calloc(1, sizeof(*z));
  if (!z) return -ENOMEM;
  z->dp = dp;
  z->st = st;
  z->o = *o;
  z->nt = mp_stage_num_tensors(st);
  z->r = ps_coll_rank(dp);
  z->d = ps_coll_world_size(dp);
  z->chunk = calloc((size_t)z->nt, sizeof(size_t));
  z->off = calloc((size_t)z->nt, sizeof(size_t));
  if (!z->chunk || !z->off) goto nomem;
  for (int i = 0; i < z->nt; i++) {
    size_t n = mp_stage_tensor_count(st, i), d = (size_t)z->d;
    z->chunk[i] = ((n + d - 1) / d + ALIGN_FLOATS - 1) / ALIGN_FLOATS * ALIGN_FLOATS;
    z->off[i] = z->len;
    z->len += z->chunk[i];
  }
  size_t bytes = (size_t)z->d * z->len * sizeof(float);
  if (!(z->buf = aligned_alloc(64, bytes))) goto nomem;
  memset(z->buf, 0, bytes); /* the padding stays zero */
  if (o->momentum != 0.0f && !(z->vel = calloc(z->len, sizeof(float)))) goto nomem;
  *out = z;
  return 0;
nomem:
  sync3d_zero_close(z);
  return -ENOMEM;
}

ps_status sync3d_zero_reduce(struct sync3d_zero *z) {
  for (int i = 0; i < z->nt; i++) {
    const float *g = mp_stage_grad(z->st, i);
    for (int q = 0; q < z->d; q++) {
      size_t a, b;
      chunk_range(z, i, q, &a, &b);
      memcpy(z->buf + (size_t)q * z->len + z->off[i], g + a, (b - a) * sizeof(float));
    }
  }
  float *mine = z->buf + (size_t)z->r * z->len;
  return ps_coll_reduce_scatter_async(z->dp, z->buf, mine, z->len, PS_REDOP_AVG, &z->req);
}

ps_status sync3d_zero_update(struct sync3d_zero *z, uint64_t step) {
  ps_status st = z->req ? ps_coll_wait(z->req) : PS_ERR_STATE;
  z->req = NULL;
  if (st != PS_OK) return st;
  float lr = sync_ring_lr(&z->o, step);
  float *mine = z->buf + (size_t)z->r * z->len;
  for (int i = 0; i < z->nt; i++) {
    size_t a, b;
    chunk_range(z, i, z->r, &a, &b);
    float *p = mp_stage_param(z->st, i) + a;
    tm_sgd_momentum(p, z->vel ? z->vel + z->off[i] : NULL, mine + z->off[i], lr, z->o.momentum,
                    b - a);
    memcpy(mine + z->off[i], p, (b - a) * sizeof(float));
  }
  st = ps_coll_allgather(z->dp, mine, z->buf, z->len * sizeof(float));
  if (st != PS_OK) return st;
  for (int i = 0; i < z->nt; i++) {
    float *p = mp_stage_param(z->st, i);
    for (int q = 0; q < z->d; q++) {
      size_t a, b;
      chunk_range(z, i, q, &a, &b);
      if (q != z->r)
        memcpy(p + a, z->buf + (size_t)q * z->len + z->off[i], (b - a) * sizeof(float));
    }
  }
  return PS_OK;
}

size_t sync3d_zero_state_floats(const struct sync3d_zero *z) {
  return z && z->vel ? z->len : 0;
}

void sync3d_zero_close(struct sync3d_zero *z) {
  if (!z) return;
  if (z->req) ps_coll_wait(z->req);
  free(z->buf);
  free(z->vel);
  free(z->chunk);
  free(z->off);
  free(z);
}
