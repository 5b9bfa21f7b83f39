/* ring_coll: all-gather, reduce-scatter, reduce and all-to-all over the
 * ring (ring.h), as plans for ring.c's progress loop (ring_impl.h). Each is
 * pipelined in slices of slice_bytes, starts with the op header in each
 * direction that carries anything and, with authentication, ends in its tag;
 * rank r sends only to r+1 and receives only from r-1.
 *
 *   all-gather     W-1 streams: stream j sends block r-j (the rank's own at
 *                  j = 0, then the one just received) and receives block
 *                  r-j-1 straight into the output. Each link carries W-1
 *                  blocks: the optimum.
 *   reduce-scatter the first half of the ring all-reduce, shifted so that
 *                  rank r completes chunk r: stream j sends chunk r-j-1 (the
 *                  rank's own at j = 0, else the partial sum just formed in
 *                  a scratch slot) and receives chunk r-j-2 into a slot,
 *                  combined with the local chunk; the last stream's combine
 *                  goes into the output. W-1 chunks per link: the optimum.
 *   reduce         a chain ending at the root: root+1 sends its buffer,
 *                  every next rank combines it with its own in a slot and
 *                  passes it on, the root combines it into its buffer. One
 *                  buffer per link, every link busy at once (the time of
 *                  n bytes over one link, below reduce-scatter + gather's
 *                  2(W-1)/W n); other ranks' buffers are only read.
 *   all-to-all     store and forward: block (r -> d) travels d-r hops,
 *                  stream j carries the blocks that started at rank r-j and
 *                  have not arrived yet (W-1-j of them), the first of which
 *                  is for r+1; a received block for this rank goes to the
 *                  output, the others to scratch until passed on. Each link
 *                  carries W(W-1)/2 blocks, W/2 times what direct pairs
 *                  would (the ring has no others); exact for W = 2.
 *
 * Scratch slots of reduce-scatter and reduce are reused in turn, each
 * receive waiting for the segment that frees its slot (forwarded, or
 * combined into the output), as in ring.c's all-reduce. Sums run in chain
 * order, so every rank that holds a result holds the same bits. */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ring.h"
#include "ring_impl.h"

static size_t min_sz(size_t a, size_t b) {
  return a < b ? a : b;
}

/* [a, a+an) and [b, b+bn) share a byte */
static bool overlap(const void *a, size_t an, const void *b, size_t bn) {
  const char *x = a, *y = b;
  return an && bn && x < y + bn && y < x + an;
}

static int plan_failed(struct ring *g, int r, const char *what, size_t n) {
  return ring_fail(g, r, -1, "cannot plan %s of %zu: %s", what, n, strerror(-r));
}

int ring_allgather(struct ring *g, const void *send, void *recv, size_t bytes) {
  if (g->err) return g->err;
  const int W = g->world, r = g->rank;
  if ((bytes && (!send || !recv)) || bytes > SIZE_MAX / 2 / (size_t)W) return -EINVAL;
  if (bytes == 0) return 0;
  char *out = recv;
  if (out + (size_t)r * bytes != send) memmove(out + (size_t)r * bytes, send, bytes);
  if (W == 1) return 0;
  const size_t k = ring_nslices(bytes, g->slice);
  int ret = ring_reserve(g, 1 + (size_t)(W - 1) * k, 1 + (size_t)(W - 1) * k);
  if (ret < 0) return plan_failed(g, ret, "an all-gather of bytes", bytes);
  ring_start_op(g, OP_ALLGATHER, 0, false, 0, bytes);
  ring_add_recv(g, &g->hdr_in, HDR_BYTES, ACT_HDR, NULL, 0, 0);
  for (int j = 0; j < W - 1; j++) {
    char *sblk = out + (size_t)ring_mod(r - j, W) * bytes;
    char *rblk = out + (size_t)ring_mod(r - j - 1, W) * bytes;
    for (size_t i = 0; i < k; i++) {
      size_t off = i * g->slice, l = min_sz(g->slice, bytes - off);
      /* stream j > 0 forwards slice i of receive stream j-1 (list index 1 + (j-1)k + i) */
      ring_add_send(g, sblk + off, l, j == 0 ? 0 : 2 + (size_t)(j - 1) * k + i);
      ring_add_recv(g, rblk + off, l, ACT_NONE, NULL, 0, 0);
    }
  }
  ring_add_tags(g);
  return ring_run(g);
}

int ring_reduce_scatter(struct ring *g, const void *send, void *recv, size_t count, enum dtype dt,
                        enum ring_redop op) {
  if (g->err) return g->err;
  const int W = g->world, r = g->rank;
  if (!ring_reduction_ok(dt, op, count, (size_t)W) || (count && (!send || !recv))) return -EINVAL;
  const size_t z = dtype_size(dt), n = count * z; /* bytes per chunk */
  const char *in = send;
  char *out = recv;
  /* in place means recv is the rank's own chunk of send (NCCL's rule) */
  bool in_place = out == in + (size_t)r * n;
  if (!in_place && overlap(in, (size_t)W * n, out, n)) return -EINVAL;
  if (count == 0) return 0;
  if (!in_place) memcpy(out, in + (size_t)r * n, n);
  if (W == 1) return 0;
  ring_set_reduction(g, dt, op);
  const size_t sl = g->slice, k = ring_nslices(n, sl);
  int ret = ring_reserve(g, 1 + (size_t)(W - 1) * k, 1 + (size_t)(W - 1) * k);
  if (ret < 0) return plan_failed(g, ret, "a reduce-scatter of elements", count);
  ring_start_op(g, OP_REDUCE_SCATTER, op, false, 0, count);
  ring_add_recv(g, &g->hdr_in, HDR_BYTES, ACT_HDR, NULL, 0, 0);
  size_t slot_send[NUM_SLOTS] = {0}, slot_recv[NUM_SLOTS] = {0}, next_slot = 0;
  for (int j = 0; j < W - 1; j++) {
    size_t sc = (size_t)ring_mod(r - j - 1, W), rc = (size_t)ring_mod(r - j - 2, W);
    for (size_t i = 0; i < k; i++) {
      size_t off = i * sl, l = min_sz(sl, n - off);
      if (j == 0) {
        ring_add_send(g, in + sc * n + off, l, 0);
      } else { /* the slot receive stream j-1 combined slice i into */
        const struct rseg *from = &g->rs[1 + (size_t)(j - 1) * k + i];
        ring_add_send(g, from->dst, l, 2 + (size_t)(j - 1) * k + i);
      }
      size_t s = next_slot++ % NUM_SLOTS;
      char *slot = (char *)g->slots + s * g->slice;
      bool last = j == W - 2; /* rc == r: the combine goes into the output */
      ring_add_recv(g, slot, l, last ? ACT_BUF_SUM : ACT_SLOT_SUM,
                    last ? out + off : (char *)(uintptr_t)(in + rc * n + off), slot_send[s],
                    slot_recv[s]);
      if (!last) { /* free once stream j+1 has sent slice i */
        slot_send[s] = 2 + (size_t)(j + 1) * k + i;
        slot_recv[s] = 0;
      } else { /* free once combined into the output */
        slot_send[s] = 0;
        slot_recv[s] = g->nr;
      }
    }
  }
  ring_add_tags(g);
  return ring_run(g);
}

int ring_reduce(struct ring *g, void *buf, size_t count, enum dtype dt, enum ring_redop op,
                int root) {
  if (g->err) return g->err;
  const int W = g->world, r = g->rank;
  if (!ring_reduction_ok(dt, op, count, 1) || root < 0 || root >= W || (count && !buf))
    return -EINVAL;
  if (count == 0 || W == 1) return 0;
  ring_set_reduction(g, dt, op);
  char *b = buf;
  const int pos = ring_mod(r - root - 1, W); /* root+1 starts the chain, the root ends it */
  const bool first = pos == 0, last = pos == W - 1;
  const size_t sl = g->slice, n = count * g->esz, k = ring_nslices(n, sl);
  int ret = ring_reserve(g, 1 + k, 1 + k);
  if (ret < 0) return plan_failed(g, ret, "a reduce of elements", count);
  ring_start_op(g, OP_REDUCE, op, false, root, count);
  if (last) g->ns = 0; /* the root sends nothing, not even a header */
  if (!first) ring_add_recv(g, &g->hdr_in, HDR_BYTES, ACT_HDR, NULL, 0, 0);
  size_t slot_send[NUM_SLOTS] = {0}, slot_recv[NUM_SLOTS] = {0};
  for (size_t i = 0; i < k; i++) {
    size_t off = i * sl, bytes = min_sz(sl, n - off);
    if (first) {
      ring_add_send(g, b + off, bytes, 0);
      continue;
    }
    size_t s = i % NUM_SLOTS;
    char *slot = (char *)g->slots + s * g->slice;
    ring_add_recv(g, slot, bytes, last ? ACT_BUF_SUM : ACT_SLOT_SUM, b + off, slot_send[s],
                  slot_recv[s]);
    if (last) {
      slot_recv[s] = g->nr; /* free once combined into the buffer */
    } else {
      ring_add_send(g, slot, bytes, g->nr); /* once combined */
      slot_send[s] = g->ns;                 /* free once passed on */
    }
  }
  ring_add_tags(g);
  return ring_run(g);
}

int ring_alltoall(struct ring *g, const void *send, void *recv, size_t bytes) {
  if (g->err) return g->err;
  const int W = g->world, r = g->rank;
  if ((bytes && (!send || !recv)) || bytes > SIZE_MAX / 2 / (size_t)W / (size_t)W ||
      overlap(send, (size_t)W * bytes, recv, (size_t)W * bytes))
    return -EINVAL;
  if (bytes == 0) return 0;
  const char *in = send;
  char *out = recv;
  memcpy(out + (size_t)r * bytes, in + (size_t)r * bytes, bytes);
  if (W == 1) return 0;
  const size_t k = ring_nslices(bytes, g->slice);
  size_t blocks = (size_t)W * (size_t)(W - 1) / 2, staged = (size_t)(W - 1) * (size_t)(W - 2) / 2;
  if (staged * bytes > g->scratch_cap) {
    char *p = malloc(staged * bytes);
    if (!p) return plan_failed(g, -ENOMEM, "an all-to-all of bytes per rank", bytes);
    free(g->scratch);
    g->scratch = p;
    g->scratch_cap = staged * bytes;
  }
  int ret = ring_reserve(g, 1 + blocks * k, 1 + blocks * k);
  if (ret < 0) return plan_failed(g, ret, "an all-to-all of bytes per rank", bytes);
  ring_start_op(g, OP_ALLTOALL, 0, false, 0, bytes);
  ring_add_recv(g, &g->hdr_in, HDR_BYTES, ACT_HDR, NULL, 0, 0);
  size_t next_stage = 0, prev_base = 0; /* list index of receive stream j-1's first segment */
  for (int j = 0; j < W - 1; j++) {
    const int nb = W - 1 - j; /* blocks of stream j */
    size_t base = g->nr;      /* receive stream j starts here */
    /* sends: stream 0 the rank's own blocks for r+1.., else blocks 1.. of receive stream j-1 */
    for (int m = 0; m < nb; m++)
      for (size_t i = 0; i < k; i++) {
        size_t off = i * g->slice, l = min_sz(g->slice, bytes - off);
        if (j == 0) {
          ring_add_send(g, in + (size_t)ring_mod(r + 1 + m, W) * bytes + off, l, 0);
        } else {
          size_t from = prev_base + (size_t)(m + 1) * k + i;
          ring_add_send(g, g->rs[from].dst, l, from + 1);
        }
      }
    /* receives: blocks that started at r-1-j, for r (kept) and beyond (staged) */
    int origin = ring_mod(r - 1 - j, W);
    for (int m = 0; m < nb; m++) {
      char *dst = m == 0 ? out + (size_t)origin * bytes : g->scratch + next_stage++ * bytes;
      for (size_t i = 0; i < k; i++) {
        size_t off = i * g->slice, l = min_sz(g->slice, bytes - off);
        ring_add_recv(g, dst + off, l, ACT_NONE, NULL, 0, 0);
      }
    }
    prev_base = base;
  }
  ring_add_tags(g);
  return ring_run(g);
}
