/* ring: plans and the progress loop of the ring collectives (see ring.h).
 *
 * Plan invariants. Segment 0 of each direction is the op header. A send
 * segment may go once `need_recv` receive segments are complete (a complete
 * receive segment has also been processed: summed or checked). A receive
 * segment may start once `need_send` send segments are complete and
 * `need_recv` receive segments are (its scratch slot is free again). Chunk c
 * of reduce-scatter step j and its slices are identical on the sending and the
 * receiving side, so send stream j+1 is exactly receive stream j once
 * processed: S_0 is the local chunk `rank`, S_{j+1} forwards R_j.
 *
 *   stream j       sends chunk         receives chunk      receive action
 *   0..W-3  (RS)   r-j (slot if j>0)   r-j-1 into a slot   slot += buf
 *   W-2     (RS)   r-W+2 (slot)        r+1 into a slot     buf += slot (* 1/W)
 *   W-1+i   (AG)   r+1-i from buf      r-i into buf        none
 *
 * (all chunk numbers mod W). A send returns once the kernel has copied the
 * bytes, so a buffer region is free again as soon as its segment counts as
 * sent. The same rule makes a send segment's bytes fixed from the moment it
 * is ready until it is sent, which is when it is MACed; with authentication
 * each list ends in a tag segment (add_tags) that depends on nothing but
 * the order of the lists. */
#include "ring.h"
#include "ring_impl.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "auth.h"
#include "clock.h"
#include "net.h"

int ring_fail(struct ring *g, int err, int lost, const char *fmt, ...) {
  if (g->err) return g->err;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g->msg, sizeof(g->msg), fmt, ap);
  va_end(ap);
  g->err = err;
  g->lost = lost;
  return err;
}

static int prev_rank(const struct ring *g) {
  return (g->rank + g->world - 1) % g->world;
}
static int next_rank(const struct ring *g) {
  return (g->rank + 1) % g->world;
}

int ring_new(const struct ring_opts *o, struct ring **out) {
  *out = NULL;
  if (o->world_size < 1 || o->rank < 0 || o->rank >= o->world_size) return -EINVAL;
  if (o->world_size > 1 && (o->prev_fd < 0 || o->next_fd < 0)) return -EINVAL;
  struct ring *g = calloc(1, sizeof(*g));
  if (!g) return -ENOMEM;
  g->rank = o->rank;
  g->world = o->world_size;
  g->prev = o->prev_fd;
  g->next = o->next_fd;
  g->abort_fd = o->abort_fd;
  g->abort_flag = o->abort_flag;
  g->tx = o->send_auth;
  g->rx = o->recv_auth;
  g->lost = -1;
  size_t slice = o->slice_bytes ? o->slice_bytes : RING_DEFAULT_SLICE;
  slice = (slice + CHUNK_ALIGN - 1) / CHUNK_ALIGN * CHUNK_ALIGN;
  g->slice = slice;
  g->small = o->small_bytes ? o->small_bytes : RING_DEFAULT_SMALL;
  size_t round = o->round_bytes ? o->round_bytes : RING_DEFAULT_ROUND;
  g->round = (round + slice - 1) / slice * slice; /* whole slices per rank and round */
  g->spin_ns = (uint64_t)(o->spin_us < 0 ? RING_DEFAULT_SPIN_US : o->spin_us) * 1000u;
  if (g->world > 1) {
    if (net_set_nonblocking(g->prev, 1) < 0 || net_set_nonblocking(g->next, 1) < 0) {
      free(g);
      return -EINVAL;
    }
    g->slots = aligned_alloc(64, NUM_SLOTS * slice);
    if (!g->slots) {
      free(g);
      return -ENOMEM;
    }
  }
  *out = g;
  return 0;
}

void ring_free(struct ring *g) {
  if (!g) return;
  free(g->slots);
  free(g->gather);
  free(g->scratch);
  free(g->ss);
  free(g->rs);
  free(g);
}

const char *ring_errmsg(const struct ring *g) {
  return g->msg;
}
int ring_lost_rank(const struct ring *g) {
  return g->lost;
}

/* ---- plans ---- */

/* Room for ns send and nr receive segments, and the tag segment of each. */
int ring_reserve(struct ring *g, size_t ns, size_t nr) {
  ns++;
  nr++;
  if (ns > g->ss_cap) {
    struct sseg *p = realloc(g->ss, ns * sizeof(*p));
    if (!p) return -ENOMEM;
    g->ss = p;
    g->ss_cap = ns;
  }
  if (nr > g->rs_cap) {
    struct rseg *p = realloc(g->rs, nr * sizeof(*p));
    if (!p) return -ENOMEM;
    g->rs = p;
    g->rs_cap = nr;
  }
  g->ns = g->nr = 0;
  return 0;
}

void ring_add_send(struct ring *g, const void *src, size_t len, size_t need_recv) {
  g->ss[g->ns++] = (struct sseg){.src = src, .len = len, .need_recv = (uint32_t)need_recv};
}

void ring_add_recv(struct ring *g, void *dst, size_t len, enum act act, void *aux, size_t need_send,
                   size_t need_recv) {
  g->rs[g->nr++] = (struct rseg){.dst = dst,
                                 .len = len,
                                 .act = (uint8_t)act,
                                 .aux = aux,
                                 .need_send = (uint32_t)need_send,
                                 .need_recv = (uint32_t)need_recv};
}

static bool reduces(int kind) {
  return kind == OP_ALLREDUCE || kind == OP_REDUCE_SCATTER || kind == OP_REDUCE ||
         kind == OP_NODE_ALLREDUCE;
}

void ring_set_reduction(struct ring *g, enum dtype dt, enum ring_redop op) {
  g->dt = dt;
  g->esz = dtype_size(dt);
  g->op = op;
}

void ring_start_op(struct ring *g, enum op_kind kind, int redop, bool small, int root,
                   uint64_t count) {
  g->hdr_out = (struct op_hdr){.magic = HDR_MAGIC,
                               .kind = (uint8_t)kind,
                               .redop = (uint8_t)redop,
                               .small = small,
                               .dtype = (uint8_t)(reduces(kind) ? g->dt : 0),
                               .root = (uint32_t)root,
                               .seq = g->seq++,
                               .count = count};
  memset(&g->hdr_in, 0, sizeof(g->hdr_in));
  ring_add_send(g, &g->hdr_out, HDR_BYTES, 0);
}

/* With authentication, each direction that carries anything ends in its tag. */
void ring_add_tags(struct ring *g) {
  if (g->tx && g->ns) ring_add_send(g, g->tag_out, AUTH_TAG_BYTES, 0);
  if (g->rx && g->nr) ring_add_recv(g, g->tag_in, AUTH_TAG_BYTES, ACT_TAG, NULL, 0, 0);
}

/* Chunk c of n bytes: CHUNK_ALIGN-rounded equal parts, the last ones
 * shorter (for float32 the same bytes as the earlier split in floats). */
static void chunk(size_t n, int world, int c, size_t *off, size_t *len) {
  size_t per = (n + (size_t)world - 1) / (size_t)world;
  per = (per + CHUNK_ALIGN - 1) / CHUNK_ALIGN * CHUNK_ALIGN;
  size_t a = (size_t)c * per, b = a + per;
  if (a > n) a = n;
  if (b > n) b = n;
  *off = a;
  *len = b - a;
}

static int mod(int a, int w) {
  return ring_mod(a, w);
}

/* Chunk of stream j: sent (send side) or received (receive side). */
static int send_chunk(int W, int r, int j) {
  return j < W - 1 ? mod(r - j, W) : mod(r + 1 - (j - (W - 1)), W);
}
static int recv_chunk(int W, int r, int j) {
  return j < W - 1 ? mod(r - j - 1, W) : mod(r - (j - (W - 1)), W);
}

/* Segments of one round: the reduce-scatter + all-gather of buf[0, n) (a
 * window of the user's buffer), appended to the lists. slot_send/slot_recv
 * carry the scratch slots' release points from round to round. */
struct round_state {
  size_t slot_send[NUM_SLOTS], slot_recv[NUM_SLOTS], next_slot;
};

static size_t round_segments(const struct ring *g, size_t n, bool sending) {
  const int W = g->world, streams = 2 * (W - 1);
  size_t total = 0;
  for (int j = 0; j < streams; j++) {
    size_t off, len;
    chunk(n, W, sending ? send_chunk(W, g->rank, j) : recv_chunk(W, g->rank, j), &off, &len);
    total += ring_nslices(len, g->slice);
  }
  return total;
}

/* buf[0, n) in bytes */
static void plan_round(struct ring *g, char *buf, size_t n, struct round_state *st, size_t *sp,
                       size_t *rp) {
  const int W = g->world, r = g->rank, streams = 2 * (W - 1);
  const size_t sl = g->slice;
  /* Receive stream j and send stream j+1 carry the same chunk; the prefix
   * sums give the list index of slice k of stream j. */
  sp[0] = g->ns;
  rp[0] = g->nr;
  for (int j = 0; j < streams; j++) {
    size_t off, len;
    chunk(n, W, send_chunk(W, r, j), &off, &len);
    sp[j + 1] = sp[j] + ring_nslices(len, sl);
    chunk(n, W, recv_chunk(W, r, j), &off, &len);
    rp[j + 1] = rp[j] + ring_nslices(len, sl);
  }
  for (int j = 0; j < streams; j++) {
    size_t off, len;
    chunk(n, W, send_chunk(W, r, j), &off, &len);
    for (size_t k = 0, p = 0; p < len; k++, p += sl) {
      size_t l = len - p < sl ? len - p : sl;
      if (j == 0) {
        ring_add_send(g, buf + off + p, l, 0);
      } else {
        const struct rseg *from = &g->rs[rp[j - 1] + k]; /* R_{j-1}, slice k */
        const void *src = j < W - 1 ? (const void *)from->dst : (const void *)(buf + off + p);
        ring_add_send(g, src, l, rp[j - 1] + k + 1);
      }
    }
    chunk(n, W, recv_chunk(W, r, j), &off, &len);
    for (size_t k = 0, p = 0; p < len; k++, p += sl) {
      size_t l = len - p < sl ? len - p : sl;
      if (j < W - 1) {
        size_t s = st->next_slot++ % NUM_SLOTS;
        char *slot = (char *)g->slots + s * g->slice;
        ring_add_recv(g, slot, l, j < W - 2 ? ACT_SLOT_SUM : ACT_BUF_SUM, buf + off + p,
                      st->slot_send[s], st->slot_recv[s]);
        if (j < W - 2) {
          st->slot_send[s] = sp[j + 1] + k + 1; /* free once S_{j+1} slice k is sent */
          st->slot_recv[s] = 0;
        } else {
          st->slot_send[s] = 0;
          st->slot_recv[s] = g->nr; /* free once summed into the buffer */
        }
      } else {
        /* The first all-gather chunk is the one this rank sent in S_0:
         * never overwrite a slice before it went out (causally always true,
         * but cheap to state). */
        size_t need_send = j == W - 1 ? sp[0] + k + 1 : 0;
        ring_add_recv(g, buf + off + p, l, ACT_NONE, NULL, need_send, 0);
      }
    }
  }
}

/* Reduce-scatter + all-gather in rounds of W * round_bytes: each round's
 * window of the buffer is read, summed and written back within a short
 * span, so it stays in cache between the two phases (NCCL loops the same
 * way), and the next round's sends follow in the same stream. count is in
 * elements (the header's), the plan in bytes. */
static int plan_ring_allreduce(struct ring *g, char *buf, size_t count, int redop) {
  const int W = g->world, streams = 2 * (W - 1);
  const size_t n = count * g->esz, window = g->round * (size_t)W;
  size_t rounds = (n + window - 1) / window, ns = 1, nr = 1;
  size_t last = n - (rounds - 1) * window;
  ns += (rounds - 1) * round_segments(g, window, true) + round_segments(g, last, true);
  nr += (rounds - 1) * round_segments(g, window, false) + round_segments(g, last, false);
  size_t pre[2 * (2 * 64 + 1)], *sp = pre;
  if (streams + 1 > 2 * 64 + 1) {
    sp = malloc(((size_t)streams + 1) * 2 * sizeof(size_t));
    if (!sp) return -ENOMEM;
  }
  size_t *rp = sp + streams + 1;
  int ret = ring_reserve(g, ns, nr);
  if (ret == 0) {
    ring_start_op(g, OP_ALLREDUCE, redop, false, 0, count);
    ring_add_recv(g, &g->hdr_in, HDR_BYTES, ACT_HDR, NULL, 0, 0);
    struct round_state st = {{0}, {0}, 0};
    for (size_t off = 0; off < n; off += window)
      plan_round(g, buf + off, n - off < window ? n - off : window, &st, sp, rp);
  }
  if (sp != pre) free(sp);
  return ret;
}

static int plan_small_allreduce(struct ring *g, char *buf, size_t count, int redop) {
  const int W = g->world;
  const size_t n = count * g->esz;
  size_t need = (size_t)W * n; /* W-1 received buffers and the rank-order sum */
  if (need > g->gather_cap) {
    char *p = aligned_alloc(64, (need + 63) / 64 * 64);
    if (!p) return -ENOMEM;
    free(g->gather);
    g->gather = p;
    g->gather_cap = need;
  }
  int ret = ring_reserve(g, (size_t)W, (size_t)W);
  if (ret < 0) return ret;
  ring_start_op(g, OP_ALLREDUCE, redop, true, 0, count);
  ring_add_recv(g, &g->hdr_in, HDR_BYTES, ACT_HDR, NULL, 0, 0);
  ring_add_send(g, buf, n, 0);
  /* gather[k-1] holds the buffer of rank r-k, received k-th and forwarded. */
  for (int k = 1; k < W; k++) {
    ring_add_recv(g, g->gather + (size_t)(k - 1) * n, n, ACT_NONE, NULL, 0, 0);
    if (k < W - 1) ring_add_send(g, g->gather + (size_t)(k - 1) * n, n, (size_t)k + 1);
  }
  return 0;
}

/* The small algorithm's result: ranks summed in rank order, identical everywhere. */
static void finish_small(struct ring *g, char *buf, size_t count) {
  const int W = g->world, r = g->rank;
  const size_t n = count * g->esz;
  if (W == 2) {
    /* a + b == b + a exactly, max and min too */
    ring_combine(g->dt, g->op, buf, g->gather, count);
  } else {
    char *sum = g->gather + (size_t)(W - 1) * n;
    for (int x = 0; x < W; x++) {
      const char *src = x == r ? buf : g->gather + (size_t)(mod(r - x, W) - 1) * n;
      if (x == 0)
        memcpy(sum, src, n);
      else
        ring_combine(g->dt, g->op, sum, src, count);
    }
    memcpy(buf, sum, n);
  }
  if (g->op == RING_AVG) dtype_divide(g->dt, buf, count, W);
}

static int plan_broadcast(struct ring *g, char *buf, size_t bytes, int root) {
  size_t k = (bytes + g->slice - 1) / g->slice;
  int ret = ring_reserve(g, k + 1, k + 1);
  if (ret < 0) return ret;
  ring_start_op(g, OP_BROADCAST, 0, false, root, bytes);
  bool recv = g->rank != root, forward = next_rank(g) != root;
  if (recv) ring_add_recv(g, &g->hdr_in, HDR_BYTES, ACT_HDR, NULL, 0, 0);
  if (!forward && recv) g->ns = 0; /* the last rank of the chain sends nothing, not even a header */
  for (size_t i = 0; i < k; i++) {
    size_t off = i * g->slice, l = bytes - off < g->slice ? bytes - off : g->slice;
    if (recv) ring_add_recv(g, buf + off, l, ACT_NONE, NULL, 0, 0);
    if (!recv)
      ring_add_send(g, buf + off, l, 0);
    else if (forward)
      ring_add_send(g, buf + off, l, i + 2); /* after the header and slice i */
  }
  return 0;
}

const char *ring_redop_name(int op) {
  static const char *const names[] = {"sum", "avg", "max", "min"};
  return op >= 0 && op < 4 ? names[op] : "?";
}

void ring_combine(enum dtype dt, enum ring_redop op, void *dst, const void *src, size_t n) {
  dtype_combine(dt,
                op == RING_MAX   ? DTYPE_MAX
                : op == RING_MIN ? DTYPE_MIN
                                 : DTYPE_ADD,
                dst, src, n);
}

bool ring_reduction_ok(enum dtype dt, enum ring_redop op, size_t count, size_t times) {
  size_t z = dtype_size(dt);
  return op >= RING_SUM && op <= RING_MIN && z && count <= SIZE_MAX / 2 / z / times;
}

/* ---- progress ---- */

static void describe(const struct op_hdr *h, char *out, size_t n) {
  const unsigned long long count = (unsigned long long)h->count;
  const char *op = ring_redop_name(h->redop), *dt = dtype_name(h->dtype);
  if (h->magic != HDR_MAGIC) {
    snprintf(out, n, "no ps ring operation (magic 0x%08x)", h->magic);
  } else if (h->kind == OP_ALLREDUCE) {
    snprintf(out, n, "allreduce #%u (count=%llu, %s, %s)", h->seq, count, dt, op);
  } else if (h->kind == OP_BROADCAST) {
    snprintf(out, n, "broadcast #%u (bytes=%llu, root=%u)", h->seq, count, h->root);
  } else if (h->kind == OP_ALLGATHER || h->kind == OP_ALLTOALL) {
    snprintf(out, n, "%s #%u (bytes=%llu per rank)",
             h->kind == OP_ALLGATHER ? "allgather" : "alltoall", h->seq, count);
  } else if (h->kind == OP_REDUCE_SCATTER) {
    snprintf(out, n, "reduce_scatter #%u (count=%llu per rank, %s, %s)", h->seq, count, dt, op);
  } else if (h->kind == OP_REDUCE) {
    snprintf(out, n, "reduce #%u (count=%llu, %s, %s, root=%u)", h->seq, count, dt, op, h->root);
  } else if (h->kind == OP_PAIRWISE_ALLTOALL) {
    snprintf(out, n, "alltoall #%u (bytes=%llu per rank, pairwise)", h->seq, count);
  } else if (h->kind == OP_NODE_ALLREDUCE) {
    snprintf(out, n, "node-first allreduce #%u (count=%llu, %s, %s)", h->seq, count, dt, op);
  } else {
    snprintf(out, n, "operation kind %u #%u", h->kind, h->seq);
  }
}

static int process(struct ring *g, const struct rseg *s) {
  switch (s->act) {
    case ACT_HDR:
      if (memcmp(&g->hdr_in, &g->hdr_out, HDR_BYTES) != 0) {
        char theirs[128], ours[128];
        describe(&g->hdr_in, theirs, sizeof(theirs));
        describe(&g->hdr_out, ours, sizeof(ours));
        return ring_fail(
            g, -EPROTO, -1, /* nobody is lost; the message names both */
            "ranks disagree: rank %d started %s while this rank started %s (every rank "
            "must call the same collectives in the same order)",
            prev_rank(g), theirs, ours);
      }
      return 0;
    case ACT_SLOT_SUM:
      ring_combine(g->dt, g->op, s->dst, s->aux, s->len / g->esz);
      return 0;
    case ACT_BUF_SUM:
      ring_combine(g->dt, g->op, s->aux, s->dst, s->len / g->esz);
      if (g->op == RING_AVG) dtype_divide(g->dt, s->aux, s->len / g->esz, g->world);
      return 0;
    case ACT_TAG: {
      int r = auth_rx_finish(g->rx, g->tag_in);
      if (r == -EBADMSG)
        return ring_fail(
            g, -EBADMSG, prev_rank(g),
            "data from rank %d failed authentication (altered, replayed or injected on "
            "the wire?); the operation's result is discarded",
            prev_rank(g));
      if (r < 0)
        return ring_fail(g, -EIO, -1, "authenticating the data from rank %d failed (libcrypto)",
                         prev_rank(g));
      return 0;
    }
    default:
      return 0;
  }
}

static int lost_io(struct ring *g, int rank, const char *what, int err) {
  if (err == 0)
    return ring_fail(g, -ECONNRESET, rank, "lost rank %d: it closed the ring connection (%s)", rank,
                     what);
  return ring_fail(g, -ECONNRESET, rank, "lost rank %d: %s: %s", rank, what, strerror(err));
}

static int check_abort(struct ring *g) {
  if (g->abort_flag && atomic_load_explicit(g->abort_flag, memory_order_acquire))
    return ring_fail(g, -ECANCELED, -1, "the job was aborted");
  return 0;
}

static int mac_failed(struct ring *g) {
  return ring_fail(g, -EIO, -1, "authenticating the data for rank %d failed (libcrypto)",
                   next_rank(g));
}

int ring_run(struct ring *g) {
  size_t si = 0, soff = 0, ri = 0, roff = 0;
  size_t smac = 0; /* send segments MACed so far (with g->tx) */
  uint64_t stall_start = 0;
  bool stalled = false;
  struct iovec iov[IOV_BATCH];
  if (g->tx && g->ns && auth_tx_begin(g->tx) < 0) return mac_failed(g);
  if (g->rx && g->nr && auth_rx_begin(g->rx) < 0) return mac_failed(g);
  while (si < g->ns || ri < g->nr) {
    int r = check_abort(g);
    if (r) return r;
    bool moved = false;
    short want_in = 0, want_out = 0;
    if (ri < g->nr) {
      int cnt = 0;
      size_t total = 0;
      for (size_t q = ri; q < g->nr && cnt < IOV_BATCH && total < RECV_BATCH_BYTES; q++) {
        const struct rseg *s = &g->rs[q];
        if (s->need_send > si || s->need_recv > ri) break;
        size_t off = q == ri ? roff : 0;
        iov[cnt].iov_base = s->dst + off;
        iov[cnt].iov_len = s->len - off;
        total += s->len - off;
        cnt++;
      }
      if (cnt > 0) {
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)cnt};
        ssize_t n = recvmsg(g->prev, &mh, MSG_DONTWAIT);
        if (n > 0) {
          moved = true;
          size_t left = (size_t)n;
          while (left > 0) {
            const struct rseg *s = &g->rs[ri];
            size_t take = s->len - roff < left ? s->len - roff : left;
            /* MAC the bytes as they came, before process() sums into them. */
            if (g->rx && s->act != ACT_TAG && auth_rx_update(g->rx, s->dst + roff, take) < 0)
              return mac_failed(g);
            roff += take;
            left -= take;
            if (roff == s->len) {
              r = process(g, s);
              if (r) return r;
              ri++;
              roff = 0;
            }
          }
        } else if (n == 0) {
          return lost_io(g, prev_rank(g), "reading", 0);
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
          want_in = POLLIN;
        } else if (errno != EINTR) {
          return lost_io(g, prev_rank(g), "reading", errno);
        }
      }
    }
    if (si < g->ns) {
      int cnt = 0;
      for (size_t q = si; q < g->ns && cnt < IOV_BATCH; q++) {
        const struct sseg *s = &g->ss[q];
        if (s->need_recv > ri) break;
        if (g->tx && q >= smac) { /* ready: its bytes are fixed until sent */
          int m = q + 1 == g->ns ? auth_tx_finish(g->tx, g->tag_out)
                                 : auth_tx_update(g->tx, s->src, s->len);
          if (m < 0) return mac_failed(g);
          smac = q + 1;
        }
        size_t off = q == si ? soff : 0;
        iov[cnt].iov_base = (void *)(s->src + off);
        iov[cnt].iov_len = s->len - off;
        cnt++;
      }
      if (cnt > 0) {
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)cnt};
        ssize_t n = sendmsg(g->next, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
          moved = true;
          size_t left = (size_t)n;
          while (left > 0) {
            size_t take = g->ss[si].len - soff < left ? g->ss[si].len - soff : left;
            soff += take;
            left -= take;
            if (soff == g->ss[si].len) {
              si++;
              soff = 0;
            }
          }
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
          want_out = POLLOUT;
        } else if (n < 0 && errno != EINTR) {
          return lost_io(g, next_rank(g), "writing", errno);
        }
      }
    }
    if (moved) {
      stalled = false;
      continue;
    }
    if (!want_in && !want_out)
      return ring_fail(g, -EDEADLK, -1,
                       "internal error: ring plan stalled (send %zu/%zu, recv %zu/%zu)", si, g->ns,
                       ri, g->nr);
    uint64_t now = clock_now_ns();
    if (!stalled) {
      stalled = true;
      stall_start = now;
    }
    if (now - stall_start < g->spin_ns) continue;
    struct pollfd pfd[3];
    int np = 0;
    if (want_in) pfd[np++] = (struct pollfd){.fd = g->prev, .events = POLLIN};
    if (want_out) pfd[np++] = (struct pollfd){.fd = g->next, .events = POLLOUT};
    if (g->abort_fd >= 0) pfd[np++] = (struct pollfd){.fd = g->abort_fd, .events = POLLIN};
    if (poll(pfd, (nfds_t)np, -1) < 0 && errno != EINTR)
      return ring_fail(g, -errno, -1, "poll: %s", strerror(errno));
    /* Errors and hang-ups surface through the next recvmsg/sendmsg; an abort
     * through check_abort (the flag is set before the eventfd is written). */
    if (g->abort_fd >= 0 && (pfd[np - 1].revents & POLLIN)) {
      r = check_abort(g);
      if (r) return r;
    }
  }
  return 0;
}

int ring_allreduce(struct ring *g, void *buf, size_t count, enum dtype dt, enum ring_redop op) {
  if (g->err) return g->err;
  if (!ring_reduction_ok(dt, op, count, 1) || (count && !buf)) return -EINVAL;
  if (g->world == 1 || count == 0) return 0;
  ring_set_reduction(g, dt, op);
  bool small = count * g->esz <= g->small / (size_t)(g->world - 1);
  int r = small ? plan_small_allreduce(g, buf, count, op) : plan_ring_allreduce(g, buf, count, op);
  if (r < 0)
    return ring_fail(g, r, -1, "cannot plan an all-reduce of %zu %s: %s", count, dtype_name(dt),
                     strerror(-r));
  ring_add_tags(g);
  r = ring_run(g);
  if (r < 0) return r;
  if (small) finish_small(g, buf, count);
  return 0;
}

int ring_agree(struct ring *g, enum ring_agreed kind, size_t count, enum dtype dt,
               enum ring_redop op) {
  if (g->err) return g->err;
  if (g->world == 1) return 0;
  int r = ring_reserve(g, 1, 1);
  if (r < 0) return ring_fail(g, r, -1, "cannot plan an operation header: %s", strerror(-r));
  ring_set_reduction(g, dt, op);
  ring_start_op(g, (enum op_kind)kind, (int)op, false, 0, count);
  ring_add_recv(g, &g->hdr_in, HDR_BYTES, ACT_HDR, NULL, 0, 0);
  ring_add_tags(g);
  return ring_run(g);
}

int ring_broadcast(struct ring *g, void *buf, size_t bytes, int root) {
  if (g->err) return g->err;
  if (root < 0 || root >= g->world || (bytes && !buf)) return -EINVAL;
  if (g->world == 1 || bytes == 0) return 0;
  int r = plan_broadcast(g, buf, bytes, root);
  if (r < 0)
    return ring_fail(g, r, -1, "cannot plan a broadcast of %zu bytes: %s", bytes, strerror(-r));
  ring_add_tags(g);
  return ring_run(g);
}
