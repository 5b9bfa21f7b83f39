/* p2p: send and receive between two ranks of a collective group
 * (ps_coll_send, ps_coll_recv, ps_coll_sendrecv) over the point-to-point
 * connections the rendezvous made (ps_coll_opts.p2p: one per pair of ranks,
 * apart from the ring's, so a message never interleaves with a collective's
 * stream).
 *
 * A message is a 24-byte header (magic, sequence number, length, group id),
 * the payload and, with a token, a 16-byte tag: the streamed MAC of header and
 * payload under the connection's session (auth.h), whose implicit counter
 * ties it to its place in the stream. Without a token the sequence number
 * still catches a stream out of step.
 *
 * Matching is by order per pair and group, as in NCCL and MPI: the k-th
 * receive from rank s in group g takes the k-th message rank s sent to this
 * rank in group g (ps_coll_split's groups share these connections; the job
 * group is id 0). A message of another group than the receive's waits in the
 * queue of early arrivals, so two groups over the same pair never mix. A receive whose
 * length differs from the message's fails the group with PS_ERR_STATE,
 * naming both, as mismatched collectives do.
 *
 * Progress. One loop drives the operation's send and receive with
 * non-blocking socket calls and, while it runs, also reads whatever any
 * other peer sends, into a queue of messages that arrived before their
 * receive (eager). So two ranks sending to each other at once, or a cycle
 * of sends, cannot deadlock on full socket buffers; the price is that such
 * a message is held in memory until its receive. A rank not inside a
 * point-to-point call reads nothing, so a sender waits for its receiver to
 * call in. The loop sleeps in poll and wakes on the group's abort, so a rank
 * lost anywhere stops it with that rank named; a peer of the operation that
 * closes its connection is lost itself. A peer that closes while this rank
 * waits on others has left (or died, which the watchdog reports): only an
 * operation with it fails.
 *
 * All-to-all (p2p_alltoall) is W-1 of these exchanges, one per distance. */
#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "auth.h"
#include "clock.h"
#include "collective_impl.h"
#include "net.h"

#define P2P_MAGIC 0x32505350u /* "PSP2" */
#ifndef P2P_BURST
#define P2P_BURST (256 << 10)
#endif
enum {
  HDR = P2P_HDR,
  /* Bytes written, or read from one peer, before the loop turns to the
   * other direction: small enough that what the kernel copies stays in
   * cache between the two copies (the sender's and the receiver's). */
  READ_BURST = P2P_BURST,
  WRITE_BURST = P2P_BURST,
};

struct p2p_msg {
  struct p2p_msg *next;
  uint64_t gid;
  size_t len;
  char data[];
};

/* The send of an operation: header, payload, tag as one stream. */
struct tx {
  struct p2p_peer *p;
  int to;
  const char *buf;
  size_t len, off, data_end, total; /* off into the stream; data_end = HDR + len */
  uint8_t hdr[HDR], tag[AUTH_TAG_BYTES];
};

/* The receive of an operation. */
struct rx {
  int from;
  uint64_t gid;
  char *buf;
  size_t len;
  bool done;
};

int p2p_init(ps_coll *c) {
  c->p2p = calloc((size_t)c->world, sizeof(*c->p2p));
  if (!c->p2p) return -ENOMEM;
  for (int s = 0; s < c->world; s++) c->p2p[s].fd = -1;
  return 0;
}

void p2p_setup(ps_coll *c) {
  for (int s = 0; c->p2p && s < c->world; s++) {
    if (c->p2p[s].fd < 0) continue;
    net_set_user_timeout(c->p2p[s].fd, c->peer_timeout_ms);
    net_set_nonblocking(c->p2p[s].fd, 1);
  }
}

void p2p_deinit(ps_coll *c) {
  for (int s = 0; c->p2p && s < c->world; s++) {
    struct p2p_peer *p = &c->p2p[s];
    if (p->fd >= 0) close(p->fd);
    auth_session_free(p->auth);
    free(p->msg);
    while (p->head) {
      struct p2p_msg *m = p->head;
      p->head = m->next;
      free(m);
    }
  }
  free(c->p2p);
  c->p2p = NULL;
}

static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* The first queued message of group gid from p (and the one before it, for
 * unlinking), or NULL. */
static struct p2p_msg *queued(struct p2p_peer *p, uint64_t gid, struct p2p_msg **before) {
  struct p2p_msg *prev = NULL;
  for (struct p2p_msg *m = p->head; m; prev = m, m = m->next)
    if (m->gid == gid) {
      if (before) *before = prev;
      return m;
    }
  return NULL;
}

/* r still waits for a message from s that is not queued yet. */
static bool awaits(const struct rx *r, int s, struct p2p_peer *p) {
  return r && r->from == s && !r->done && !queued(p, r->gid, NULL);
}

/* A peer of the operation closed or broke its connection: a rank that
 * failed for a reason tells rank 0, so wait a moment for that first. */
static ps_status lost(ps_coll *c, int s, const char *what) {
  struct pollfd pfd = {.fd = c->abort_efd, .events = POLLIN};
  if (!atomic_load(&c->aborted)) poll(&pfd, 1, GRACE_MS);
  coll_fail(c, PS_ERR_IO, s, "lost rank %d: its point-to-point connection to rank %d %s", s,
            c->rank, what);
  return ps_coll_status(c);
}

static ps_status mismatch(ps_coll *c, int s, size_t sent, size_t expected) {
  coll_fail(c, PS_ERR_STATE, -1,
            "ranks disagree: rank %d sent %zu bytes to rank %d, which expected to receive %zu "
            "(every send must meet a receive of the same length, in the same order)",
            s, sent, c->rank, expected);
  return ps_coll_status(c);
}

/* Moves what the socket has taken into the stream's MAC and, once the
 * payload is all out, seals the tag. */
static int tx_account(struct tx *t, size_t n) {
  size_t a = t->off, b = t->off + n;
  t->off = b;
  if (!t->p->auth || a >= t->data_end) return 0;
  size_t e = b < t->data_end ? b : t->data_end;
  for (size_t i = a; i < e;) { /* header bytes, then payload bytes */
    const char *src = i < HDR ? (const char *)t->hdr + i : t->buf + (i - HDR);
    size_t k = i < HDR ? (e < HDR ? e : HDR) - i : e - i;
    if (auth_tx_update(t->p->auth, src, k) < 0) return -EIO;
    i += k;
  }
  if (e == t->data_end && auth_tx_finish(t->p->auth, t->tag) < 0) return -EIO;
  return 0;
}

/* Writes what it can of t's stream. Returns 1 when all of it is out, 0 to
 * wait for POLLOUT, or a negative errno. */
static int tx_step(struct tx *t) {
  size_t burst = 0;
  while (t->off < t->total && burst < WRITE_BURST) {
    struct iovec v[2];
    int nv = 0;
    if (t->off < HDR) v[nv++] = (struct iovec){t->hdr + t->off, HDR - t->off};
    if (t->off < t->data_end && t->len) {
      size_t at = t->off < HDR ? 0 : t->off - HDR;
      size_t k = t->len - at < WRITE_BURST - burst ? t->len - at : WRITE_BURST - burst;
      v[nv++] = (struct iovec){(void *)(t->buf + at), k};
    }
    if (t->off >= t->data_end) {
      size_t at = t->off - t->data_end;
      v[nv++] = (struct iovec){t->tag + at, AUTH_TAG_BYTES - at};
    }
    struct msghdr mh = {.msg_iov = v, .msg_iovlen = (size_t)nv};
    ssize_t n = sendmsg(t->p->fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -errno;
    }
    if (tx_account(t, (size_t)n) < 0) return -EIO;
    burst += (size_t)n;
  }
  return t->off == t->total;
}

/* The header of a message from rank s is in p->hdr: checks it and picks
 * where the payload goes (r's buffer when it waits for exactly this message,
 * else a queued copy). Returns PS_OK or the group's failure. */
static ps_status rx_header(ps_coll *c, int s, struct p2p_peer *p, struct rx *r) {
  uint64_t len = get_u64(p->hdr + 8), gid = get_u64(p->hdr + 16);
  if (get_u32(p->hdr) != P2P_MAGIC || get_u32(p->hdr + 4) != p->seq_in) {
    coll_fail(c, PS_ERR_IO, s,
              "rank %d's point-to-point stream to rank %d is out of step (message %u expected)", s,
              c->rank, p->seq_in);
    return ps_coll_status(c);
  }
  if (p->auth && (auth_rx_begin(p->auth) < 0 || auth_rx_update(p->auth, p->hdr, HDR) < 0)) {
    coll_fail(c, PS_ERR_IO, -1, "the MAC of a point-to-point message failed");
    return ps_coll_status(c);
  }
  p->len = (size_t)len;
  if (awaits(r, s, p) && gid == r->gid) {
    if (len != r->len) return mismatch(c, s, (size_t)len, r->len);
    p->dst = r->buf;
    p->msg = NULL;
    return PS_OK;
  }
  p->msg = len <= SIZE_MAX - sizeof(struct p2p_msg) ? malloc(sizeof(*p->msg) + len) : NULL;
  if (!p->msg) {
    coll_fail(c, PS_ERR_NOMEM, -1,
              "no memory to hold a %llu-byte message from rank %d until it is received",
              (unsigned long long)len, s);
    return ps_coll_status(c);
  }
  p->msg->next = NULL;
  p->msg->gid = gid;
  p->msg->len = (size_t)len;
  p->dst = p->msg->data;
  return PS_OK;
}

/* A whole message from s arrived (and, with a token, verified). */
static void rx_complete(struct p2p_peer *p, struct rx *r) {
  p->seq_in++;
  p->part = 0;
  p->got = 0;
  if (!p->msg) {
    r->done = true;
    return;
  }
  if (p->tail)
    p->tail->next = p->msg;
  else
    p->head = p->msg;
  p->tail = p->msg;
  p->msg = NULL;
}

/* Reads what rank s has sent, up to READ_BURST bytes (added to *moved).
 * A message that r does not wait for is only begun with drain (the
 * operation is stuck otherwise): taking in the next message early would only
 * cost a copy through the queue. Returns PS_OK or the
 * group's failure; a peer outside the operation that closes is marked gone
 * (between messages) rather than failing. */
static ps_status rx_step(ps_coll *c, int s, struct rx *r, int dst, bool drain, size_t *moved) {
  struct p2p_peer *p = &c->p2p[s];
  size_t burst = 0;
  while (burst < READ_BURST) {
    bool awaited = awaits(r, s, p);
    if (p->part == 0 && p->got == 0 && !awaited && !drain) return PS_OK;
    char *to;
    size_t want;
    if (p->part == 0) {
      to = (char *)p->hdr + p->got;
      want = HDR - p->got;
    } else if (p->part == 1) {
      to = p->dst + p->got;
      want = p->len - p->got;
    } else {
      to = (char *)p->tag + p->got;
      want = AUTH_TAG_BYTES - p->got;
    }
    if (want > READ_BURST - burst) want = READ_BURST - burst;
    ssize_t n = want ? recv(p->fd, to, want, MSG_DONTWAIT) : 0;
    if (want && n == 0) {
      bool ours = s == dst || (r && s == r->from && !r->done);
      if (!ours && p->part == 0 && p->got == 0) {
        p->gone = true; /* it left; an operation with it fails then */
        return PS_OK;
      }
      return lost(c, s, "closed");
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return PS_OK;
      return lost(c, s, strerror(errno));
    }
    burst += (size_t)n;
    *moved += (size_t)n;
    if (p->part == 1 && p->auth && auth_rx_update(p->auth, to, (size_t)n) < 0) {
      coll_fail(c, PS_ERR_IO, -1, "the MAC of a point-to-point message failed");
      return ps_coll_status(c);
    }
    p->got += (size_t)n;
    if (p->part == 0 && p->got == HDR) {
      ps_status st = rx_header(c, s, p, r);
      if (st != PS_OK) return st;
      p->part = 1;
      p->got = 0;
    }
    if (p->part == 1 && p->got == p->len) {
      p->part = 2;
      p->got = 0;
    }
    if (p->part == 2 && (!p->auth || p->got == AUTH_TAG_BYTES)) {
      if (p->auth && auth_rx_finish(p->auth, p->tag) != 0) {
        coll_fail_auth(c, s,
                       "a point-to-point message from rank %d failed authentication at rank %d "
                       "(altered, replayed or injected on the wire?)",
                       s, c->rank);
        return ps_coll_status(c);
      }
      rx_complete(p, r);
    }
  }
  return PS_OK;
}

/* r waits for a message already queued: takes it. */
static ps_status rx_take_queued(ps_coll *c, struct rx *r) {
  if (r->done) return PS_OK; /* also every send-only operation (from = -1) */
  struct p2p_peer *p = &c->p2p[r->from];
  struct p2p_msg *prev = NULL, *m = queued(p, r->gid, &prev);
  if (!m) return PS_OK;
  if (m->len != r->len) return mismatch(c, r->from, m->len, r->len);
  if (prev)
    prev->next = m->next;
  else
    p->head = m->next;
  if (p->tail == m) p->tail = prev;
  if (m->len) memcpy(r->buf, m->data, m->len);
  free(m);
  r->done = true;
  return PS_OK;
}

static ps_status gone(ps_coll *c, int s) {
  coll_fail(c, PS_ERR_IO, s, "rank %d has left the group: its point-to-point connection is closed",
            s);
  return ps_coll_status(c);
}

ps_status p2p_run(ps_coll *c, const void *send, size_t send_bytes, int dst, void *recv,
                  size_t recv_bytes, int src) {
  return p2p_run_gid(c, 0, send, send_bytes, dst, recv, recv_bytes, src);
}

ps_status p2p_run_gid(ps_coll *c, uint64_t gid, const void *send, size_t send_bytes, int dst,
                      void *recv, size_t recv_bytes, int src) {
  struct tx t = {0};
  struct rx r = {.from = src, .gid = gid, .buf = recv, .len = recv_bytes, .done = src < 0};
  bool sent = dst < 0;
  if (!sent) {
    t = (struct tx){.p = &c->p2p[dst], .to = dst, .buf = send, .len = send_bytes};
    t.data_end = HDR + send_bytes;
    t.total = t.data_end + (t.p->auth ? AUTH_TAG_BYTES : 0);
    put_u32(t.hdr, P2P_MAGIC);
    put_u32(t.hdr + 4, t.p->seq_out);
    put_u64(t.hdr + 8, (uint64_t)send_bytes);
    put_u64(t.hdr + 16, gid);
    if (t.p->auth && auth_tx_begin(t.p->auth) < 0) {
      coll_fail(c, PS_ERR_IO, -1, "the MAC of a point-to-point message failed");
      return ps_coll_status(c);
    }
    if (t.p->gone) return gone(c, dst);
  }
  if (!r.done && c->p2p[src].gone && !queued(&c->p2p[src], gid, NULL)) return gone(c, src);
  struct pollfd *pfd = calloc((size_t)c->world + 1, sizeof(*pfd));
  ps_status st = PS_ERR_NOMEM;
  if (!pfd) goto out;
  uint64_t stall_start = 0; /* 0: moving */
  for (;;) {
    st = ps_coll_status(c);
    if (st != PS_OK) goto out;
    size_t moved = 0;
    bool drain = stall_start != 0; /* nothing moved last time round */
    if (!sent) {
      size_t before = t.off;
      int k = tx_step(&t);
      if (k == -EIO) {
        coll_fail(c, PS_ERR_IO, -1, "the MAC of a point-to-point message failed");
        st = ps_coll_status(c);
        goto out;
      }
      if (k < 0) {
        st = lost(c, dst, strerror(-k));
        goto out;
      }
      if (k == 1) {
        sent = true;
        t.p->seq_out++;
      }
      moved += t.off - before;
    }
    st = rx_take_queued(c, &r);
    for (int s = 0; st == PS_OK && s < c->world; s++)
      if (c->p2p[s].fd >= 0 && !c->p2p[s].gone)
        st = rx_step(c, s, &r, sent ? -1 : dst, drain, &moved);
    if (st == PS_OK) st = rx_take_queued(c, &r);
    if (st != PS_OK) goto out;
    if (!r.done && c->p2p[src].gone && !queued(&c->p2p[src], gid, NULL)) {
      st = gone(c, src);
      goto out;
    }
    if (sent && r.done) break;
    /* Nothing moved: spin a little (a small message's answer is microseconds
     * away), then sleep in poll. */
    uint64_t now = clock_now_ns();
    if (moved) stall_start = 0;
    if (moved || !stall_start) {
      stall_start = moved ? 0 : now;
      continue;
    }
    if (now - stall_start < c->spin_ns) continue;
    stall_start = 0;
    int n = 0;
    pfd[n++] = (struct pollfd){.fd = c->abort_efd, .events = POLLIN};
    for (int s = 0; s < c->world; s++) {
      struct p2p_peer *p = &c->p2p[s];
      if (p->fd < 0 || p->gone) continue;
      short ev = POLLIN;
      if (!sent && s == dst) ev |= POLLOUT;
      pfd[n++] = (struct pollfd){.fd = p->fd, .events = ev};
    }
    if (poll(pfd, (nfds_t)n, -1) < 0 && errno != EINTR) {
      coll_fail(c, PS_ERR_IO, -1, "poll in a point-to-point operation: %s", strerror(errno));
      st = ps_coll_status(c);
      goto out;
    }
  }
  st = PS_OK;
out:
  free(pfd);
  return st;
}

ps_status p2p_alltoall(ps_coll *c, const void *send, void *recv, size_t bytes) {
  const int W = c->world, r = c->rank;
  const char *s = send;
  char *d = recv;
  memcpy(d + (size_t)r * bytes, s + (size_t)r * bytes, bytes);
  for (int k = 1; k < W; k++) {
    int to = (r + k) % W, from = (r + W - k) % W;
    ps_status st =
        p2p_run(c, s + (size_t)to * bytes, bytes, to, d + (size_t)from * bytes, bytes, from);
    if (st != PS_OK) return st;
  }
  return PS_OK;
}
