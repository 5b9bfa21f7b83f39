/* hostile: connections, replies, outcomes and the reaper of ps-hostile (see
 * hostile.h).
 *
 * Counting mirrors the shard's: every error frame read is counted by its
 * code, once, wherever it is read (a probe's setup step, a judged frame, the
 * reaper), and a connection the shard closes without having sent one is a
 * silent close (the shard counts those drops as kind "limit"). A connection
 * the attacker closes itself after an outcome is not counted anywhere: the
 * shard sees a plain EOF. */
#include "hostile.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "frame.h"
#include "wire_send.h"

enum {
  RBUF_BYTES = 16384, /* replies are small; a payload reply is a finding and not read */
  SETUP_MS = 5000,
  NUM_CODES = 32,
  MAX_REPORTS = 40, /* detail lines per outcome on stderr */
  MAX_PROBES = 64,
};
#define NS 1000000000ull

static const char *const outcome_names[HOSTILE_NUM_OUTCOMES] = {
    "rejected", "dropped", "tolerated", "accepted", "unexpected", "closed", "stuck"};
static const char *const holder_names[HOSTILE_NUM_HOLDERS] = {"slowloris", "auth_slowloris", "idle",
                                                              "auth_idle", "reply_flood"};

struct hostile_conn {
  int fd;
  bool slot;                 /* counts against opts.connections */
  struct auth_session *sess; /* replies carry tags under it (tags) */
  enum hostile_tags tags;
  bool got_error, eof;
  size_t have;
  uint8_t rbuf[RBUF_BYTES];
  /* parked with the reaper */
  struct hostile_conn *next;
  struct hostile_expect e;
  int probe;
  char variant[96];
  int holder; /* enum hostile_holder, or -1: a judged frame */
  uint64_t since_ns, deadline_ns, next_byte_ns;
  /* HOSTILE_FLOOD: the sealed request being written, and how far */
  uint8_t pend[64];
  size_t pend_len, pend_off;
  uint64_t flood_id;
  bool flood_over; /* the attack is over: reading until the shard drops it */
};

struct hostile {
  struct hostile_opts o;
  /* a handshake captured for the replay probe */
  pthread_mutex_t cap_mu;
  bool have_cap;
  uint8_t cap_hello[HOSTILE_CAPTURE_BYTES], cap_auth[HOSTILE_CAPTURE_BYTES];
  size_t cap_hello_len, cap_auth_len;
  /* connection slots */
  pthread_mutex_t slot_mu;
  pthread_cond_t slot_cv;
  int slots_used;
  /* the reaper's connections */
  pthread_mutex_t park_mu;
  struct hostile_conn *parked;
  atomic_bool finishing;
  pthread_t reaper;
  atomic_uint_fast64_t sent;
  /* counts, under mu */
  pthread_mutex_t mu;
  uint64_t frames, outcome[HOSTILE_NUM_OUTCOMES], per_probe[MAX_PROBES][HOSTILE_NUM_OUTCOMES];
  uint64_t errors[NUM_CODES + 1]; /* [NUM_CODES]: codes beyond */
  uint64_t silent_closes, connections, setup_failures, bad_tags, flood_requests;
  uint64_t holders[HOSTILE_NUM_HOLDERS], held_dropped[HOSTILE_NUM_HOLDERS];
  double held_max_s[HOSTILE_NUM_HOLDERS];
  int reported[HOSTILE_NUM_OUTCOMES];
};

/* The label of ps_server_errors_total for a code: ERR_BAD_FRAME -> bad_frame. */
static const char *code_kind(int code, char *buf, size_t len) {
  const ProtobufCEnumValue *v =
      protobuf_c_enum_descriptor_get_value(&ps__error_code__descriptor, code);
  const char *s = v ? v->name : "other";
  if (strncmp(s, "ERR_", 4) == 0) s += 4;
  size_t i = 0;
  for (; s[i] && i + 1 < len; i++) buf[i] = (char)(s[i] >= 'A' && s[i] <= 'Z' ? s[i] + 32 : s[i]);
  buf[i] = 0;
  return buf;
}

/* ---- outcomes ------------------------------------------------------------ */

static enum hostile_outcome classify(const struct hostile_expect *e, enum hostile_read r,
                                     const struct hostile_reply *rep) {
  switch (r) {
    case HOSTILE_EOF:
      if (e->flags & HOSTILE_DROP) return HOSTILE_DROPPED;
      return e->flags & HOSTILE_HDR_ONLY ? HOSTILE_ACCEPTED : HOSTILE_CLOSED;
    case HOSTILE_TIMEOUT:
      return HOSTILE_STUCK;
    case HOSTILE_BAD:
      return HOSTILE_UNEXPECTED;
    case HOSTILE_FRAME:
      break;
  }
  if (rep->type == PS__MSG_TYPE__MSG_ERROR) {
    uint32_t bit = rep->code > 0 && rep->code < 32 ? 1u << rep->code : 0;
    if (e->ok & bit) return HOSTILE_REJECTED;
    return e->bad & bit ? HOSTILE_ACCEPTED : HOSTILE_UNEXPECTED;
  }
  if (e->flags & HOSTILE_TOLERATE) return HOSTILE_TOLERATED;
  if ((e->flags & HOSTILE_TOLERATE_DUP) && rep->type == PS__MSG_TYPE__MSG_ACK && (rep->flags & 1))
    return HOSTILE_TOLERATED;
  return HOSTILE_ACCEPTED;
}

/* Counts one outcome; the first few findings and surprises are described
 * on stderr. */
static void record(struct hostile *h, int probe, const char *variant, enum hostile_outcome o,
                   enum hostile_read r, const struct hostile_reply *rep) {
  pthread_mutex_lock(&h->mu);
  h->frames++;
  h->outcome[o]++;
  if (probe >= 0 && probe < MAX_PROBES) h->per_probe[probe][o]++;
  bool report = o >= HOSTILE_ACCEPTED && h->reported[o]++ < MAX_REPORTS;
  pthread_mutex_unlock(&h->mu);
  if (!report) return;
  char kind[48] = "";
  if (r == HOSTILE_FRAME && rep->type == PS__MSG_TYPE__MSG_ERROR)
    code_kind(rep->code, kind, sizeof(kind));
  const char *what = r == HOSTILE_EOF       ? "closed"
                     : r == HOSTILE_TIMEOUT ? "none"
                     : r == HOSTILE_BAD     ? "unparsable"
                                            : wire_type_name(rep->type);
  fprintf(stderr, "ps-hostile: %s: probe=%s variant=\"%s\" reply=%s%s%s%s message=\"%s\"\n",
          outcome_names[o], probe >= 0 && probe < h->o.num_probes ? h->o.probe_names[probe] : "-",
          variant, what, kind[0] ? "(" : "", kind, kind[0] ? ")" : "",
          r == HOSTILE_FRAME ? rep->msg : "");
}

void hostile_setup_failed(struct hostile *h, const char *what) {
  pthread_mutex_lock(&h->mu);
  bool report = h->setup_failures++ < MAX_REPORTS;
  pthread_mutex_unlock(&h->mu);
  if (report) fprintf(stderr, "ps-hostile: setup failed: %s\n", what);
}

uint64_t hostile_sent(struct hostile *h) {
  return atomic_load(&h->sent);
}

bool hostile_findings(struct hostile *h) {
  pthread_mutex_lock(&h->mu);
  bool f = h->outcome[HOSTILE_ACCEPTED] > 0 || h->outcome[HOSTILE_STUCK] > 0;
  for (int k = 0; k < HOSTILE_NUM_HOLDERS; k++) f |= h->held_dropped[k] < h->holders[k];
  pthread_mutex_unlock(&h->mu);
  return f;
}

/* ---- connections --------------------------------------------------------- */

static void slot_release(struct hostile *h) {
  pthread_mutex_lock(&h->slot_mu);
  h->slots_used--;
  pthread_cond_signal(&h->slot_cv);
  pthread_mutex_unlock(&h->slot_mu);
}

struct hostile_conn *hostile_conn_open(struct hostile *h, bool slot) {
  if (slot) {
    pthread_mutex_lock(&h->slot_mu);
    while (h->slots_used >= h->o.connections) pthread_cond_wait(&h->slot_cv, &h->slot_mu);
    h->slots_used++;
    pthread_mutex_unlock(&h->slot_mu);
  }
  struct hostile_conn *c = calloc(1, sizeof(*c));
  char err[256] = "out of memory";
  struct net_backoff bo = {20, 200, 3000};
  int fd = c ? net_connect(&h->o.addr, &bo, err, sizeof(err)) : -ENOMEM;
  if (fd < 0) {
    hostile_setup_failed(h, err);
    free(c);
    if (slot) slot_release(h);
    return NULL;
  }
  c->fd = fd;
  c->slot = slot;
  c->holder = -1;
  c->probe = -1;
  pthread_mutex_lock(&h->mu);
  h->connections++;
  pthread_mutex_unlock(&h->mu);
  return c;
}

void hostile_conn_close(struct hostile *h, struct hostile_conn *c) {
  if (!c) return;
  close(c->fd);
  auth_session_free(c->sess);
  if (c->slot) slot_release(h);
  free(c);
}

void hostile_conn_shutdown_write(struct hostile_conn *c) {
  shutdown(c->fd, SHUT_WR);
}

void hostile_conn_write(struct hostile_conn *c, const void *a, size_t alen, const void *b,
                        size_t blen, const void *t, size_t tlen) {
  struct iovec parts[3] = {{(void *)a, alen}, {(void *)b, blen}, {(void *)t, tlen}}, iov[3];
  int n = 0;
  for (int i = 0; i < 3; i++)
    if (parts[i].iov_len) iov[n++] = parts[i];
  if (n) (void)net_writev_all(c->fd, iov, n);
}

void hostile_conn_seal(struct hostile_conn *c, const uint8_t *hdr, size_t hlen, const void *pay,
                       size_t plen, uint8_t tag[AUTH_TAG_BYTES]) {
  struct iovec iov[2] = {{(void *)hdr, hlen}, {(void *)pay, plen}};
  if (!c->sess || auth_seal(c->sess, iov, plen ? 2 : 1, tag) < 0) memset(tag, 0, AUTH_TAG_BYTES);
}

void hostile_conn_send_sealed(struct hostile_conn *c, const uint8_t *hdr, size_t hlen,
                              const void *pay, size_t plen, uint8_t tag[AUTH_TAG_BYTES]) {
  hostile_conn_seal(c, hdr, hlen, pay, plen, tag);
  hostile_conn_write(c, hdr, hlen, pay, plen, tag, AUTH_TAG_BYTES);
}

void hostile_conn_set_session(struct hostile_conn *c, struct auth_session *sess,
                              enum hostile_tags mode) {
  if (sess != c->sess) auth_session_free(c->sess);
  c->sess = sess;
  c->tags = mode;
}

/* Complete frame at the front of c->rbuf: decoded, its tag checked, counted
 * and consumed. Returns HOSTILE_FRAME, HOSTILE_TIMEOUT (incomplete) or
 * HOSTILE_BAD. */
static enum hostile_read take_frame(struct hostile *h, struct hostile_conn *c,
                                    struct wire_arena *arena, struct hostile_reply *out,
                                    wire_header **hp) {
  struct frame_preamble pre;
  struct frame_limits lim = {FRAME_MAX_HEADER, UINT64_MAX};
  if (c->have < FRAME_PREAMBLE_BYTES) return HOSTILE_TIMEOUT;
  if (frame_preamble_decode(c->rbuf, &lim, &pre) < 0) return HOSTILE_BAD;
  size_t need = FRAME_PREAMBLE_BYTES + pre.header_len;
  if (c->have < need) return HOSTILE_TIMEOUT;
  wire_header *hd;
  if (wire_header_unpack(arena, c->rbuf + FRAME_PREAMBLE_BYTES, pre.header_len, &hd) < 0)
    return HOSTILE_BAD;
  *out = (struct hostile_reply){.type = hd->type, .code = -1, .flags = hd->flags};
  bool is_err = hd->type == PS__MSG_TYPE__MSG_ERROR;
  if (is_err && hd->body_case == PS__HEADER__BODY_ERROR) {
    out->code = hd->error->code;
    snprintf(out->msg, sizeof(out->msg), "%s", hd->error->message ? hd->error->message : "");
  }
  if (hp) *hp = hd;
  if (pre.payload_len > RBUF_BYTES) { /* a payload reply: never expected, not read */
    c->have = 0;
    c->eof = c->got_error = true; /* unusable from here; not a silent close */
    return HOSTILE_FRAME;
  }
  bool tagged = c->tags == HOSTILE_TAG_ALL || (c->tags == HOSTILE_TAG_NOT_ON_ERROR && !is_err);
  size_t total = need + (size_t)pre.payload_len + (tagged ? AUTH_TAG_BYTES : 0);
  if (total > RBUF_BYTES) return HOSTILE_BAD;
  if (c->have < total) return HOSTILE_TIMEOUT;
  pthread_mutex_lock(&h->mu);
  if (tagged && c->sess) {
    struct iovec iov[2] = {{c->rbuf, need}, {c->rbuf + need, (size_t)pre.payload_len}};
    if (auth_open(c->sess, iov, pre.payload_len ? 2 : 1, c->rbuf + need + pre.payload_len) < 0)
      h->bad_tags++;
  }
  if (is_err) {
    c->got_error = true;
    h->errors[out->code >= 0 && out->code < NUM_CODES ? out->code : NUM_CODES]++;
  }
  pthread_mutex_unlock(&h->mu);
  memmove(c->rbuf, c->rbuf + total, c->have - total);
  c->have -= total;
  return HOSTILE_FRAME;
}

enum hostile_read hostile_read(struct hostile *h, struct hostile_conn *c, struct wire_arena *arena,
                               int ms, struct hostile_reply *out, wire_header **hp) {
  uint64_t deadline = clock_now_ns() + (uint64_t)ms * 1000000u;
  for (;;) {
    enum hostile_read r = take_frame(h, c, arena, out, hp);
    if (r != HOSTILE_TIMEOUT) return r;
    if (c->eof) {
      if (!c->got_error) { /* counted once */
        c->got_error = true;
        pthread_mutex_lock(&h->mu);
        h->silent_closes++;
        pthread_mutex_unlock(&h->mu);
      }
      return HOSTILE_EOF;
    }
    uint64_t now = clock_now_ns();
    int wait = now >= deadline ? 0 : (int)((deadline - now + 999999) / 1000000);
    struct pollfd pfd = {c->fd, POLLIN, 0};
    int n = poll(&pfd, 1, wait);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) return HOSTILE_TIMEOUT;
    if (c->have == RBUF_BYTES) return HOSTILE_BAD;
    ssize_t got = recv(c->fd, c->rbuf + c->have, RBUF_BYTES - c->have, MSG_DONTWAIT);
    if (got > 0)
      c->have += (size_t)got;
    else if (got == 0 || (errno != EAGAIN && errno != EINTR))
      c->eof = true; /* FIN or RST; what arrived before is read first */
    else if (wait == 0)
      return HOSTILE_TIMEOUT;
  }
}

int hostile_read_setup(struct hostile *h, struct hostile_conn *c, struct wire_arena *arena,
                       const char *what, struct hostile_reply *rep, wire_header **hp) {
  enum hostile_read r = hostile_read(h, c, arena, SETUP_MS, rep, hp);
  if (r == HOSTILE_FRAME) return 0;
  char why[200];
  snprintf(why, sizeof(why), "%s: %s", what,
           r == HOSTILE_EOF       ? "the shard closed the connection"
           : r == HOSTILE_TIMEOUT ? "no reply"
                                  : "bad reply");
  hostile_setup_failed(h, why);
  return -1;
}

/* ---- the reaper ------------------------------------------------------------ */

static void park(struct hostile *h, struct hostile_conn *c) {
  pthread_mutex_lock(&h->park_mu);
  c->next = h->parked;
  h->parked = c;
  pthread_mutex_unlock(&h->park_mu);
}

static void unpark(struct hostile *h, struct hostile_conn *c) {
  pthread_mutex_lock(&h->park_mu);
  for (struct hostile_conn **pp = &h->parked; *pp; pp = &(*pp)->next)
    if (*pp == c) {
      *pp = c->next;
      break;
    }
  pthread_mutex_unlock(&h->park_mu);
}

int hostile_judge(struct hostile *h, struct hostile_conn **cp, struct wire_arena *arena,
                  struct hostile_expect e, int ms, int probe, const char *variant,
                  struct hostile_reply *rep_out) {
  struct hostile_conn *c = *cp;
  atomic_fetch_add(&h->sent, 1);
  struct hostile_reply rep = {0};
  enum hostile_read r = hostile_read(h, c, arena, ms, &rep, NULL);
  if (rep_out) *rep_out = rep;
  if (r == HOSTILE_TIMEOUT) {
    c->e = e;
    c->probe = probe;
    snprintf(c->variant, sizeof(c->variant), "%s", variant);
    c->deadline_ns = clock_now_ns() + (uint64_t)(h->o.drain_seconds * 1e9);
    park(h, c);
    *cp = NULL;
    return HOSTILE_PENDING;
  }
  enum hostile_outcome o = classify(&e, r, &rep);
  record(h, probe, variant, o, r, &rep);
  return o;
}

void hostile_hold(struct hostile *h, struct hostile_conn *c, enum hostile_holder kind) {
  c->holder = kind;
  c->since_ns = clock_now_ns();
  c->next_byte_ns = c->since_ns + NS;
  /* a flood's deadline starts when the attack ends */
  c->deadline_ns =
      kind == HOSTILE_FLOOD ? UINT64_MAX : c->since_ns + (uint64_t)(h->o.drain_seconds * 1e9);
  pthread_mutex_lock(&h->mu);
  h->holders[kind]++;
  pthread_mutex_unlock(&h->mu);
  park(h, c);
}

/* A held connection is over: dropped by the shard (r = EOF or an error
 * frame) or still open at its deadline. */
static void holder_done(struct hostile *h, struct hostile_conn *c, enum hostile_read r,
                        uint64_t now) {
  double s = (double)(now - c->since_ns) / 1e9;
  pthread_mutex_lock(&h->mu);
  if (r == HOSTILE_EOF || r == HOSTILE_FRAME) {
    h->held_dropped[c->holder]++;
    if (s > h->held_max_s[c->holder]) h->held_max_s[c->holder] = s;
  }
  pthread_mutex_unlock(&h->mu);
  if (r == HOSTILE_TIMEOUT)
    fprintf(stderr, "ps-hostile: stuck: %s connection still open after %.1f s\n",
            holder_names[c->holder], s);
}

/* A close the shard made without an error frame (it counts those as
 * dropped connections, kind "limit"). */
static void count_silent(struct hostile *h, struct hostile_conn *c) {
  if (c->got_error) return;
  c->got_error = true;
  pthread_mutex_lock(&h->mu);
  h->silent_closes++;
  pthread_mutex_unlock(&h->mu);
}

/* HOSTILE_FLOOD: sealed STATS requests until the socket takes no more (a
 * batch per turn). A request sealed but not yet written stays pending, so
 * the tag counters never disagree. */
static void flood_write(struct hostile *h, struct hostile_conn *c) {
  uint64_t sealed = 0;
  for (int i = 0; i < 4096; i++) {
    if (c->pend_off == c->pend_len) {
      Ps__Header hd = PS__HEADER__INIT;
      hd.type = PS__MSG_TYPE__MSG_STATS;
      hd.request_id = ++c->flood_id;
      hd.rank = h->o.rank;
      int n = wire_frame_encode(&hd, 0, c->pend, sizeof(c->pend) - AUTH_TAG_BYTES);
      if (n <= 0) break;
      hostile_conn_seal(c, c->pend, (size_t)n, NULL, 0, c->pend + n);
      c->pend_len = (size_t)n + AUTH_TAG_BYTES;
      c->pend_off = 0;
      sealed++;
    }
    ssize_t w =
        send(c->fd, c->pend + c->pend_off, c->pend_len - c->pend_off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w <= 0) break;
    c->pend_off += (size_t)w;
  }
  pthread_mutex_lock(&h->mu);
  h->flood_requests += sealed;
  pthread_mutex_unlock(&h->mu);
}

/* HOSTILE_FLOOD after the attack: the replies are read (and dropped) until
 * the shard closes. Returns true at its close. */
static bool flood_drain(struct hostile_conn *c) {
  uint8_t buf[65536];
  for (;;) {
    ssize_t r = recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (r > 0) continue;
    return !(r < 0 && (errno == EAGAIN || errno == EINTR));
  }
}

/* One turn of a flooding connection; true when it is over (dropped, or
 * still open at its deadline: r says which). */
static bool flood_turn(struct hostile *h, struct hostile_conn *c, short revents, uint64_t now,
                       enum hostile_read *r) {
  bool gone = false;
  if (!c->flood_over) {
    if (revents & (POLLHUP | POLLERR | POLLRDHUP))
      gone = true;
    else if (revents & POLLOUT)
      flood_write(h, c);
  } else if (revents) {
    gone = flood_drain(c);
  }
  if (!gone && now < c->deadline_ns) return false;
  if (gone) count_silent(h, c);
  *r = gone ? HOSTILE_EOF : HOSTILE_TIMEOUT;
  return true;
}

/* Polls every parked connection: outcomes that came late, drops of held
 * ones, deadlines passed; a slowloris gets its next byte each second, a
 * flood as many requests as the shard takes (never reading its replies)
 * until hostile_finish. Ends once hostile_finish was called and nothing is
 * left. */
static void *reaper_main(void *arg) {
  struct hostile *h = arg;
  struct wire_arena arena;
  if (wire_arena_init(&arena, 64 * 1024) < 0) return NULL;
  size_t cap = 0;
  struct pollfd *pfd = NULL;
  struct hostile_conn **cs = NULL;
  for (;;) {
    pthread_mutex_lock(&h->park_mu);
    size_t n = 0;
    for (struct hostile_conn *c = h->parked; c; c = c->next) n++;
    if (n > cap) {
      struct pollfd *np = realloc(pfd, 2 * n * sizeof(*pfd));
      if (np) pfd = np;
      struct hostile_conn **nc = realloc(cs, 2 * n * sizeof(*cs));
      if (nc) cs = nc;
      if (np && nc) cap = 2 * n;
    }
    n = 0;
    bool finishing = atomic_load(&h->finishing);
    for (struct hostile_conn *c = h->parked; c && n < cap; c = c->next) {
      short ev = POLLIN;
      if (c->holder == HOSTILE_FLOOD && !c->flood_over && finishing) {
        c->flood_over = true;
        c->deadline_ns = clock_now_ns() + (uint64_t)(h->o.drain_seconds * 1e9);
      }
      if (c->holder == HOSTILE_FLOOD && !c->flood_over) ev = POLLOUT | POLLRDHUP;
      cs[n] = c;
      pfd[n++] = (struct pollfd){c->fd, ev, 0};
    }
    bool done = n == 0 && finishing;
    pthread_mutex_unlock(&h->park_mu);
    if (done) break;
    if (poll(pfd, n, 20) < 0 && errno != EINTR) break;
    uint64_t now = clock_now_ns();
    for (size_t i = 0; i < n; i++) {
      struct hostile_conn *c = cs[i];
      enum hostile_read r = HOSTILE_TIMEOUT;
      struct hostile_reply rep = {0};
      if (c->holder == HOSTILE_FLOOD) {
        if (!flood_turn(h, c, pfd[i].revents, now, &r)) continue;
        unpark(h, c);
        holder_done(h, c, r, now);
        hostile_conn_close(h, c);
        continue;
      }
      if (pfd[i].revents) r = hostile_read(h, c, &arena, 0, &rep, NULL);
      if (r == HOSTILE_TIMEOUT && now < c->deadline_ns) {
        bool slow = c->holder == HOSTILE_SLOW || c->holder == HOSTILE_SLOW_AUTH;
        if (slow && now >= c->next_byte_ns) {
          uint8_t b = 0x7a; /* never completes the header it started */
          (void)send(c->fd, &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
          c->next_byte_ns += NS;
        }
        continue;
      }
      unpark(h, c);
      if (c->holder >= 0)
        holder_done(h, c, r, now);
      else
        record(h, c->probe, c->variant, classify(&c->e, r, &rep), r, &rep);
      hostile_conn_close(h, c);
    }
  }
  free(pfd);
  free(cs);
  wire_arena_deinit(&arena);
  return NULL;
}

int hostile_new(const struct hostile_opts *o, struct hostile **out) {
  struct hostile *h = calloc(1, sizeof(*h));
  if (!h) return -ENOMEM;
  h->o = *o;
  if (h->o.num_probes > MAX_PROBES) h->o.num_probes = MAX_PROBES;
  pthread_mutex_init(&h->mu, NULL);
  pthread_mutex_init(&h->cap_mu, NULL);
  pthread_mutex_init(&h->slot_mu, NULL);
  pthread_mutex_init(&h->park_mu, NULL);
  pthread_cond_init(&h->slot_cv, NULL);
  if (pthread_create(&h->reaper, NULL, reaper_main, h) != 0) {
    free(h);
    return -EAGAIN;
  }
  *out = h;
  return 0;
}

void hostile_finish(struct hostile *h) {
  atomic_store(&h->finishing, true);
  pthread_join(h->reaper, NULL);
}

void hostile_free(struct hostile *h) {
  if (!h) return;
  pthread_mutex_destroy(&h->mu);
  pthread_mutex_destroy(&h->cap_mu);
  pthread_mutex_destroy(&h->slot_mu);
  pthread_mutex_destroy(&h->park_mu);
  pthread_cond_destroy(&h->slot_cv);
  free(h);
}

/* ---- handshakes ------------------------------------------------------------- */

/* An AUTH header carrying proof (a points to it; both are the caller's). */
static void auth_header(Ps__Header *hd, Ps__Auth *a, const uint8_t *proof, size_t len) {
  *hd = (Ps__Header)PS__HEADER__INIT;
  *a = (Ps__Auth)PS__AUTH__INIT;
  a->proof.data = (uint8_t *)proof;
  a->proof.len = len;
  hd->type = PS__MSG_TYPE__MSG_AUTH;
  hd->body_case = PS__HEADER__BODY_AUTH;
  hd->auth = a;
}

size_t hostile_enc_auth(uint8_t *buf, size_t cap, const uint8_t *proof, size_t len) {
  Ps__Header hd;
  Ps__Auth a;
  auth_header(&hd, &a, proof, len);
  int n = wire_frame_encode(&hd, 0, buf, cap);
  return n > 0 ? (size_t)n : 0;
}

int hostile_hello(struct hostile *h, struct hostile_conn *c, struct wire_arena *arena,
                  struct hs *hs, uint32_t rank, uint32_t world, uint8_t *buf, size_t cap,
                  size_t *len, uint8_t pa[AUTH_PROOF_BYTES]) {
  Ps__Header hd = PS__HEADER__INIT;
  Ps__Hello hello = PS__HELLO__INIT;
  hello.rank = rank;
  hello.world_size = world;
  hello.job_id = "ps-hostile";
  hello.client = "ps-hostile";
  hd.type = PS__MSG_TYPE__MSG_HELLO;
  hd.rank = rank;
  hd.body_case = PS__HEADER__BODY_HELLO;
  hd.hello = &hello;
  if (hs_initiator_hello(hs, &hello) < 0) return -1;
  int64_t n = wire_send_frame(c->fd, &hd, NULL, 0, NULL, buf, cap);
  if (n == -EMSGSIZE) return -1;
  /* A shard that already closed is not an error here: the read that follows
   * says what happened (never an AUTH, which takes the whole hello). */
  if (n > 0) {
    *len = (size_t)n;
    hs_initiator_sent(hs, buf + FRAME_PREAMBLE_BYTES, (size_t)n - FRAME_PREAMBLE_BYTES);
  }
  struct hostile_reply rep;
  wire_header *rh;
  if (hostile_read_setup(h, c, arena, "hello", &rep, &rh) < 0) return -1;
  char why[300];
  if (rep.type == PS__MSG_TYPE__MSG_ERROR) {
    snprintf(why, sizeof(why), "hello refused: %s", rep.msg);
    hostile_setup_failed(h, why);
    return 1;
  }
  if (pa && rh->body_case == PS__HEADER__BODY_AUTH && rh->auth->proof.len == AUTH_PROOF_BYTES)
    memcpy(pa, rh->auth->proof.data, AUTH_PROOF_BYTES);
  Ps__Auth auth;
  if (hs_initiator_on_reply(hs, rh, &auth, why, sizeof(why)) != 1) {
    hostile_setup_failed(h, why);
    return -1;
  }
  return 0;
}

int hostile_handshake(struct hostile *h, struct hostile_conn *c, struct wire_arena *arena) {
  struct hs hs;
  hs_init(&hs, AUTH_INITIATOR, h->o.token);
  uint8_t hello[HOSTILE_CAPTURE_BYTES], auth[HOSTILE_CAPTURE_BYTES];
  size_t hello_len = 0, auth_len = 0;
  int ret = -1;
  if (hostile_hello(h, c, arena, &hs, h->o.rank, h->o.world, hello, sizeof(hello), &hello_len,
                    NULL) != 0)
    goto out;
  Ps__Header ah;
  Ps__Auth a;
  auth_header(&ah, &a, hs.proof, AUTH_PROOF_BYTES);
  int64_t n = wire_send_frame(c->fd, &ah, NULL, 0, NULL, auth, sizeof(auth));
  auth_len = n > 0 ? (size_t)n : 0; /* kept only once the shard's ACK proves it arrived */
  hostile_conn_set_session(c, hs_take_session(&hs), HOSTILE_TAG_NOT_ON_ERROR);
  struct hostile_reply rep;
  wire_header *rh;
  if (hostile_read_setup(h, c, arena, "auth", &rep, &rh) < 0) goto out;
  char why[300];
  if (hs_initiator_on_ack(&hs, rh, why, sizeof(why)) < 0) {
    hostile_setup_failed(h, why);
    goto out;
  }
  c->tags = HOSTILE_TAG_ALL;
  pthread_mutex_lock(&h->cap_mu);
  if (!h->have_cap) {
    memcpy(h->cap_hello, hello, hello_len);
    h->cap_hello_len = hello_len;
    memcpy(h->cap_auth, auth, auth_len);
    h->cap_auth_len = auth_len;
    h->have_cap = true;
  }
  pthread_mutex_unlock(&h->cap_mu);
  ret = 0;
out:
  hs_deinit(&hs);
  return ret;
}

bool hostile_captured(struct hostile *h, uint8_t *hello, size_t *hello_len, uint8_t *auth,
                      size_t *auth_len) {
  pthread_mutex_lock(&h->cap_mu);
  bool have = h->have_cap;
  if (have) {
    memcpy(hello, h->cap_hello, h->cap_hello_len);
    *hello_len = h->cap_hello_len;
    memcpy(auth, h->cap_auth, h->cap_auth_len);
    *auth_len = h->cap_auth_len;
  }
  pthread_mutex_unlock(&h->cap_mu);
  return have;
}

/* ---- the report --------------------------------------------------------------- */

void hostile_report(struct hostile *h, FILE *out, FILE *err, int keys, double seconds) {
  pthread_mutex_lock(&h->mu);
  fprintf(err, "ps-hostile: %-22s %7s", "probe", "frames");
  for (int o = 0; o < HOSTILE_NUM_OUTCOMES; o++) fprintf(err, " %10s", outcome_names[o]);
  fprintf(err, "\n");
  for (int i = 0; i < h->o.num_probes; i++) {
    uint64_t sum = 0;
    for (int o = 0; o < HOSTILE_NUM_OUTCOMES; o++) sum += h->per_probe[i][o];
    if (!sum) continue;
    fprintf(err, "ps-hostile: %-22s %7" PRIu64, h->o.probe_names[i], sum);
    for (int o = 0; o < HOSTILE_NUM_OUTCOMES; o++) fprintf(err, " %10" PRIu64, h->per_probe[i][o]);
    fprintf(err, "\n");
  }
  fprintf(out, "hostile frames=%" PRIu64, h->frames);
  for (int o = 0; o < HOSTILE_NUM_OUTCOMES; o++)
    fprintf(out, " %s=%" PRIu64, outcome_names[o], h->outcome[o]);
  fprintf(out,
          " connections=%" PRIu64 " silent_closes=%" PRIu64 " keys=%d setup_failures=%" PRIu64
          " bad_reply_tags=%" PRIu64,
          h->connections, h->silent_closes, keys, h->setup_failures, h->bad_tags);
  for (int k = 0; k < HOSTILE_NUM_HOLDERS; k++)
    fprintf(out, " %s=%" PRIu64 " %s_dropped=%" PRIu64 " %s_max_s=%.2f", holder_names[k],
            h->holders[k], holder_names[k], h->held_dropped[k], holder_names[k], h->held_max_s[k]);
  fprintf(out, " reply_flood_requests=%" PRIu64 " seconds=%.1f errors_by_code=", h->flood_requests,
          seconds);
  bool first = true;
  for (int code = 0; code <= NUM_CODES; code++) {
    if (!h->errors[code]) continue;
    char kind[48];
    fprintf(out, "%s%s:%" PRIu64, first ? "" : ",",
            code < NUM_CODES ? code_kind(code, kind, sizeof(kind)) : "other", h->errors[code]);
    first = false;
  }
  fprintf(out, "%s\n", first ? "none" : "");
  pthread_mutex_unlock(&h->mu);
  fflush(out);
}
