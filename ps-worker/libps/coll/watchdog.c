/* watchdog: liveness of a ring collective group, and the header-only frames
 * the group sends (see collective_impl.h for how it fits with collective.c
 * and rendezvous.c).
 *
 * Watchdog (one thread, asleep in poll between events): owns the control
 * sockets. Every beat_ms it writes a heartbeat on each; a peer silent for
 * peer_timeout_ms, or whose socket closes without a SHUTDOWN first, is lost.
 * Rank 0 watches ranks 1..W-1; the others watch rank 0. A SHUTDOWN frame
 * marks an orderly leave (ps_coll_close), after which silence is expected.
 * When the group fails (coll_fail, from any thread), the watchdog passes the
 * news on once: rank 0 to every rank, other ranks to rank 0.
 *
 * Control frames use the common framing (proto/ps.proto): HEARTBEAT,
 * SHUTDOWN, and ERROR with code PEER_LOST, Header.rank = the lost rank and
 * the reason as text, code PROTOCOL when the ranks disagree on what they
 * call (PS_ERR_STATE everywhere, as where it was seen), or code AUTH when
 * that rank sent something that failed authentication (it is alive, so it
 * is told too). With a token each
 * frame is followed by its tag (auth_seal/auth_open under the connection's
 * session, which only the watchdog thread uses once the group is open, and
 * watchdog_stop after joining it); a frame whose tag fails is a violation by
 * that peer and fails the group like a lost one. The ring's data is
 * authenticated per operation in ring.c with the ring connections'
 * sessions. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "auth.h"
#include "clock.h"
#include "collective_impl.h"
#include "frame.h"
#include "wire.h"
#include "wire_send.h"

/* ---- frames ---- */

/* A frame on a blocking socket (the handshakes of rendezvous.c); the open
 * group's control frames go through ctrl_queue below. */
int watchdog_send_frame(int fd, const wire_header *h, struct auth_session *s) {
  uint8_t buf[FRAME_BUF];
  int64_t n = wire_send_frame(fd, h, NULL, 0, s, buf, sizeof(buf));
  return n < 0 ? (int)n : 0;
}

/* An ERROR frame naming rank (-1: nobody in particular) in h, with e. */
static void error_frame(wire_header *h, Ps__Error *e, Ps__ErrorCode code, int rank,
                        const char *msg) {
  wire_error_frame(h, e, 0, code, msg);
  h->rank = rank < 0 ? UINT32_MAX : (uint32_t)rank;
}

int watchdog_send_error(int fd, Ps__ErrorCode code, int rank, const char *msg,
                        struct auth_session *s) {
  wire_header h;
  Ps__Error e;
  error_frame(&h, &e, code, rank, msg);
  return watchdog_send_frame(fd, &h, s);
}

/* Control frames of the open group go through a queue per peer, whole: the
 * socket is non-blocking, and a frame half written (or tagged and then not
 * sent) would leave the stream or the tag counters out of step with the
 * peer's for good. Each frame is encoded and sealed once into the queue; the
 * queue is written as far as the socket takes it, now and on POLLOUT. A peer
 * whose queue would pass CTRL_OUT_CAP (kilobytes of heartbeats unread) has
 * stopped reading: it is lost. Returns false then, or when the socket fails. */
#define CTRL_OUT_CAP (64u * 1024u)

static bool ctrl_flush(struct ctrl_peer *p) {
  size_t done = 0;
  while (done < p->out_len) {
    ssize_t n = send(p->fd, p->out + done, p->out_len - done, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      done += (size_t)n;
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      break;
    } else {
      return false;
    }
  }
  memmove(p->out, p->out + done, p->out_len - done);
  p->out_len -= done;
  return true;
}

static bool ctrl_queue(ps_coll *c, struct ctrl_peer *p, const wire_header *h) {
  if (!p->out && !(p->out = malloc(CTRL_OUT_CAP))) return false;
  uint8_t buf[FRAME_BUF];
  int n = wire_frame_encode(h, 0, buf, sizeof(buf) - AUTH_TAG_BYTES);
  if (n < 0) return false;
  size_t len = (size_t)n;
  if (p->auth) {
    struct iovec v = {buf, len};
    if (auth_seal(p->auth, &v, 1, buf + len) < 0) return false;
    len += AUTH_TAG_BYTES;
  }
  if (p->out_len + len > CTRL_OUT_CAP) {
    coll_fail(c, PS_ERR_IO, p->rank,
              "lost rank %d: it stopped reading its control connection (%zu bytes unread)", p->rank,
              p->out_len);
    return false;
  }
  memcpy(p->out + p->out_len, buf, len);
  p->out_len += len;
  return ctrl_flush(p);
}

static void ctrl_queue_simple(ps_coll *c, struct ctrl_peer *p, Ps__MsgType type) {
  wire_header h = PS__HEADER__INIT;
  h.type = type;
  h.rank = (uint32_t)c->rank;
  (void)ctrl_queue(c, p, &h); /* a failed peer is found by its reader */
}

static void ctrl_queue_error(ps_coll *c, struct ctrl_peer *p, Ps__ErrorCode code, int rank,
                             const char *msg) {
  wire_header h;
  Ps__Error e;
  error_frame(&h, &e, code, rank, msg);
  (void)ctrl_queue(c, p, &h);
}

/* ---- the thread ---- */

static void ctrl_send_all(ps_coll *c, Ps__MsgType type) {
  for (int i = 0; i < c->nctrl; i++)
    if (c->ctrl[i].fd >= 0 && !c->ctrl[i].left) ctrl_queue_simple(c, &c->ctrl[i], type);
}

/* Passes a failure on: rank 0 to every rank, the others to rank 0. */
static void propagate_failure(ps_coll *c) {
  pthread_mutex_lock(&c->mu);
  int lost = c->lost;
  Ps__ErrorCode code = c->fail_code;
  char msg[sizeof(c->msg)];
  snprintf(msg, sizeof(msg), "%s", c->msg);
  pthread_mutex_unlock(&c->mu);
  for (int i = 0; i < c->nctrl; i++)
    if (c->ctrl[i].fd >= 0 && !c->ctrl[i].left &&
        (c->ctrl[i].rank != lost || code == PS__ERROR_CODE__ERR_AUTH))
      ctrl_queue_error(c, &c->ctrl[i], code, lost, msg);
}

/* A frame from control peer p. */
static void on_ctrl_frame(ps_coll *c, struct ctrl_peer *p, const wire_header *h) {
  if (h->type == PS__MSG_TYPE__MSG_SHUTDOWN) {
    p->left = true;
  } else if (h->type == PS__MSG_TYPE__MSG_ERROR && h->body_case == PS__HEADER__BODY_ERROR) {
    const char *m = h->error->message ? h->error->message : "";
    int lost = h->rank == UINT32_MAX ? -1 : (int)h->rank;
    bool auth = h->error->code == PS__ERROR_CODE__ERR_AUTH;
    ps_status st = h->error->code == PS__ERROR_CODE__ERR_PROTOCOL ? PS_ERR_STATE : PS_ERR_IO;
    if (c->rank == 0 && auth)
      coll_fail_auth(c, lost, "rank %d reports: %s", p->rank, m);
    else if (c->rank == 0)
      coll_fail(c, st, lost, "rank %d reports: %s", p->rank, m);
    else if (auth)
      coll_fail_auth(c, lost, "%s (reported by rank 0)", m);
    else
      coll_fail(c, st, lost, "%s (reported by rank 0)", m);
  }
  /* HEARTBEAT and anything newer: proof of life only */
}

/* A complete frame from p (the decoder holds it until reset). Returns false
 * if its tag fails: p broke the protocol and the group has failed. */
static bool ctrl_frame_done(ps_coll *c, struct ctrl_peer *p, struct wire_arena *a) {
  const struct frame_decoder *d = &p->dec;
  if (p->auth) {
    struct iovec v[2] = {{(void *)frame_decoder_preamble(d), FRAME_PREAMBLE_BYTES},
                         {(void *)frame_decoder_header(d), frame_decoder_header_len(d)}};
    if (auth_open(p->auth, v, 2, frame_decoder_tag(d)) != 0) {
      char msg[200];
      snprintf(msg, sizeof(msg),
               "frame from rank %d failed authentication on its control connection (altered, "
               "replayed or injected on the wire?)",
               p->rank);
      coll_fail_auth(c, p->rank, "%s", msg);
      /* Its stream is out of step for good and is closed; our direction
       * still is not, so tell it first. */
      ctrl_queue_error(c, p, PS__ERROR_CODE__ERR_AUTH, p->rank, msg);
      return false;
    }
  }
  wire_header *h = NULL;
  if (wire_header_unpack(a, frame_decoder_header(d), frame_decoder_header_len(d), &h) == 0)
    on_ctrl_frame(c, p, h);
  return true;
}

/* Reads what p has; returns false once p is gone. */
static bool ctrl_read(ps_coll *c, struct ctrl_peer *p, struct wire_arena *a) {
  uint8_t buf[4096];
  for (;;) {
    ssize_t n = recv(p->fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      if (!p->left)
        coll_fail(c, PS_ERR_IO, p->rank,
                  "lost rank %d: its control connection %s (process exited or was killed?)",
                  p->rank, n == 0 ? "closed" : strerror(errno));
      return false;
    }
    if (n < 0) return true;
    p->last_ns = clock_now_ns();
    size_t off = 0;
    while (off < (size_t)n) {
      size_t used = 0;
      int ev = frame_decoder_feed(&p->dec, buf + off, (size_t)n - off, &used);
      off += used;
      if (ev < 0) {
        coll_fail(c, PS_ERR_IO, p->rank, "rank %d sent a bad control frame: %s", p->rank,
                  frame_strerror(ev));
        return false;
      }
      if (ev == FRAME_HEADER) ev = frame_decoder_set_payload(&p->dec, NULL);
      if (ev == FRAME_DONE) {
        if (!ctrl_frame_done(c, p, a)) return false;
        frame_decoder_reset(&p->dec);
      }
    }
  }
}

static void *watchdog_main(void *arg) {
  ps_coll *c = arg;
  struct wire_arena arena;
  if (wire_arena_init(&arena, 64 * 1024) < 0) return NULL;
  const uint64_t timeout_ns = (uint64_t)c->peer_timeout_ms * 1000000u;
  uint64_t beat_ns = timeout_ns / 4;
  if (beat_ns > 1000000000u) beat_ns = 1000000000u;
  if (beat_ns < 10000000u) beat_ns = 10000000u;
  struct pollfd *pfd = calloc((size_t)c->nctrl + 2, sizeof(*pfd));
  int *who = calloc((size_t)c->nctrl + 2, sizeof(int));
  uint64_t next_beat = 0;
  bool propagated = false;
  for (int i = 0; i < c->nctrl; i++) c->ctrl[i].last_ns = clock_now_ns();
  while (pfd && who) {
    uint64_t now = clock_now_ns();
    if (now >= next_beat) {
      ctrl_send_all(c, PS__MSG_TYPE__MSG_HEARTBEAT);
      next_beat = now + beat_ns;
    }
    for (int i = 0; i < c->nctrl; i++) {
      struct ctrl_peer *p = &c->ctrl[i];
      if (p->fd >= 0 && !p->left && now - p->last_ns > timeout_ns)
        coll_fail(c, PS_ERR_IO, p->rank,
                  "lost rank %d: silent for %d ms (stopped, hung or "
                  "unreachable)",
                  p->rank, c->peer_timeout_ms);
    }
    if (atomic_load(&c->aborted) && !propagated) {
      propagate_failure(c);
      propagated = true;
    }
    int n = 0;
    pfd[n] = (struct pollfd){.fd = c->stop_efd, .events = POLLIN};
    who[n++] = -1;
    if (!propagated) {
      pfd[n] = (struct pollfd){.fd = c->abort_efd, .events = POLLIN};
      who[n++] = -2;
    }
    for (int i = 0; i < c->nctrl; i++) {
      if (c->ctrl[i].fd < 0 || c->ctrl[i].left) continue;
      pfd[n] = (struct pollfd){.fd = c->ctrl[i].fd,
                               .events = (short)(POLLIN | (c->ctrl[i].out_len ? POLLOUT : 0))};
      who[n++] = i;
    }
    int wait = (int)((next_beat - now + 999999u) / 1000000u);
    if (poll(pfd, (nfds_t)n, wait) < 0 && errno != EINTR) break;
    if (pfd[0].revents & POLLIN) { /* ps_coll_close: a failure still goes out first */
      if (atomic_load(&c->aborted) && !propagated) propagate_failure(c);
      break;
    }
    for (int k = 1; k < n; k++) {
      if (who[k] < 0 || !pfd[k].revents) continue;
      struct ctrl_peer *p = &c->ctrl[who[k]];
      if ((pfd[k].revents & POLLOUT) && !ctrl_flush(p))
        coll_fail(c, PS_ERR_IO, p->rank, "lost rank %d: its control connection failed: %s", p->rank,
                  strerror(errno));
      if ((pfd[k].revents & ~POLLOUT) && !ctrl_read(c, p, &arena)) {
        close(p->fd);
        p->fd = -1;
      }
    }
  }
  free(pfd);
  free(who);
  wire_arena_deinit(&arena);
  return NULL;
}

int watchdog_start(ps_coll *c) {
  int r = pthread_create(&c->watchdog, NULL, watchdog_main, c);
  if (r != 0) return -r;
  c->watchdog_started = true;
  return 0;
}

void watchdog_stop(ps_coll *c) {
  if (!c->watchdog_started) return;
  uint64_t one = 1;
  if (write(c->stop_efd, &one, sizeof(one)) < 0) { /* cannot fail on a fresh eventfd */
  }
  pthread_join(c->watchdog, NULL);
  ctrl_send_all(c, PS__MSG_TYPE__MSG_SHUTDOWN);
  /* what is still queued (the SHUTDOWN, a failure) gets a moment to leave */
  uint64_t until = clock_now_ns() + 200000000u;
  for (int i = 0; i < c->nctrl; i++) {
    struct ctrl_peer *p = &c->ctrl[i];
    while (p->fd >= 0 && p->out_len && clock_now_ns() < until && ctrl_flush(p)) {
      struct pollfd w = {.fd = p->fd, .events = POLLOUT};
      (void)poll(&w, 1, 10);
    }
  }
}
