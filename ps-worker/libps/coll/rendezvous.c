/* rendezvous: forms the group of a ring collective (see collective_impl.h):
 * rank r listens, connects to rank r+1 and, when r > 0, to rank 0, accepts
 * rank r-1 and, on rank 0, every other rank's control connection, and hands
 * each finished connection's socket and session to the group.
 *
 * Every connection (ring data and control alike) runs the handshake of
 * proto/handshake.h, the side that connects as initiator: its HELLO (rank,
 * world size, job id, connection kind and, with a token, a nonce) is bound
 * by the transcript hash, so the acceptor checks those fields only once both
 * proofs verified. All handshakes in progress are driven by one poll loop,
 * never by a blocking read: every rank accepts its predecessor while its
 * successor accepts it, and a blocking wait for a proof would wait around
 * the whole ring. Before authentication a connection may only send one small
 * header-only frame at a time (HS_MAX_HEADER); a stranger (garbage, no
 * nonce, a wrong proof, silence) is answered with an ERROR naming why where
 * the stream is still in sync, logged and counted, and the rank keeps
 * waiting for the genuine peer. At most MAX_PENDING handshakes run at once,
 * plus one for each connection this rank expects (rank 0 takes W-1 control
 * connections, and with p2p every rank one from each higher rank).
 * When a connection finds them all taken, room is made from the connections
 * that have invested least: the oldest still without a hello; else the one
 * waiting longest for its proof, if longer than PROOF_GRACE_MS (a genuine
 * initiator answers our AUTH as soon as its loop runs; one blocked
 * connecting elsewhere may take seconds); else the newcomer is turned away.
 * A link that has begun to receive its proof is never dropped for a
 * stranger. A connection turned away or dropped gets ERR_LIMIT, which an
 * initiator takes as "busy": it connects again after a backoff (up to the
 * deadline), so a flood delays the genuine peer but cannot shut it out.
 * Without a token the group warns that anyone can join. */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "auth.h"
#include "clock.h"
#include "collective_impl.h"
#include "frame.h"
#include "handshake.h"
#include "log.h"
#include "net.h"
#include "rendezvous_link.h"
#include "wire.h"
#include "wire_send.h"

enum {
  HELLO_WAIT_MS = 5000,     /* an accepted connection must say hello by then */
  MAX_PENDING = 16,         /* accepted connections in their handshake at once */
  PROOF_GRACE_MS = 2000,    /* a link waiting for its proof this long may make room */
  BUSY_RETRY_MS = 50,       /* an initiator turned away as busy connects again after 50 ms, */
  BUSY_RETRY_MAX_MS = 1000, /* doubling up to 1 s */
  DEFAULT_CONNECT_MS = 60000,
};
#define CLIENT_NAME "ps-ring"

static int send_auth(int fd, Ps__Auth *auth) {
  wire_header h = PS__HEADER__INIT;
  h.type = PS__MSG_TYPE__MSG_AUTH;
  h.body_case = PS__HEADER__BODY_AUTH;
  h.auth = auth;
  return watchdog_send_frame(fd, &h, NULL);
}

/* A connection we make: its link while the handshake runs (NULL once done),
 * or, turned away as busy (ERR_LIMIT), when to connect again (0 = none). */
struct out_link {
  struct link *l;
  uint64_t retry_ns;
  int to, kind;
};

struct rendezvous {
  ps_coll *c;
  const struct ps_coll_opts *o;
  int listen_fd;
  uint64_t deadline_ns; /* UINT64_MAX = none */
  struct wire_arena arena;
  uint8_t hbuf[HS_MAX_HEADER];
  /* ours: [0] ring to rank+1, [1] control to rank 0 (none on rank 0), then
   * point-to-point to every lower rank (ps_coll_opts.p2p) */
  struct out_link *out;
  int nout;
  unsigned busy_retries;
  struct link **in; /* accepted, in their handshake: at most max_in */
  int nin, max_in;
  unsigned refusals;
  char refused[400]; /* the last stranger we turned away, for the timeout message */
};

static int link_unpack(struct rendezvous *z, const struct link *l, wire_header **h) {
  return wire_header_unpack(&z->arena, l->frame + FRAME_PREAMBLE_BYTES, l->hlen, h);
}

/* link_read, then the header decoded into *h once the frame is complete:
 * returns 1 with *h, 0 to wait, or link_read's errors (-EBADMSG also for a
 * header that does not decode). */
static int link_take(struct rendezvous *z, struct link *l, wire_header **h, char *why,
                     size_t whylen) {
  int r = link_read(l, why, whylen);
  if (r == 1 && link_unpack(z, l, h) < 0) {
    snprintf(why, whylen, "undecodable header");
    r = -EBADMSG;
  }
  return r;
}

/* Checks an incoming hello; on refusal writes the reason into why. */
static int check_hello(struct rendezvous *z, const wire_header *h, int *from, int *kind, char *why,
                       size_t n) {
  ps_coll *c = z->c;
  if (h->type != PS__MSG_TYPE__MSG_HELLO || h->body_case != PS__HEADER__BODY_HELLO) {
    snprintf(why, n, "expected a hello, got %s", wire_type_name(h->type));
    return -1;
  }
  const Ps__Hello *hl = h->hello;
  if (!hl->client || strcmp(hl->client, CLIENT_NAME) != 0) {
    snprintf(why, n,
             "this is the ring port of worker rank %d, not a parameter server (client \"%.64s\")",
             c->rank, hl->client ? hl->client : "");
    return -1;
  }
  if (strcmp(hl->job_id ? hl->job_id : "", c->job) != 0) {
    snprintf(why, n, "job id \"%.100s\" differs from rank %d's \"%.100s\"", hl->job_id, c->rank,
             c->job);
    return -1;
  }
  if ((int)hl->world_size != c->world) {
    snprintf(why, n, "world size %u differs from rank %d's %d", hl->world_size, c->rank, c->world);
    return -1;
  }
  if (h->key != (uint64_t)c->rank) {
    snprintf(why, n, "rank %u addressed rank %" PRIu64 " but reached rank %d (peer list order?)",
             hl->rank, h->key, c->rank);
    return -1;
  }
  *from = (int)hl->rank;
  *kind = (int)h->flags;
  int prev = (c->rank + c->world - 1) % c->world;
  if (*kind == KIND_RING) {
    if (*from != prev) {
      snprintf(why, n, "rank %d connected as the ring predecessor of rank %d, expected rank %d",
               *from, c->rank, prev);
      return -1;
    }
    if (c->prev_fd >= 0) {
      snprintf(why, n, "rank %d is already connected (a second process with the same rank?)",
               *from);
      return -1;
    }
    return 0;
  }
  if (*kind == KIND_CTRL && c->rank == 0) {
    if (*from < 1 || *from >= c->world) {
      snprintf(why, n, "rank %d is outside [1, %d)", *from, c->world);
      return -1;
    }
    if (c->ctrl[*from - 1].fd >= 0) {
      snprintf(why, n,
               "rank %d already has a control connection (a second process with the "
               "same rank?)",
               *from);
      return -1;
    }
    return 0;
  }
  if (*kind == KIND_P2P && c->p2p) {
    if (*from <= c->rank || *from >= c->world) {
      snprintf(why, n, "rank %d is outside (%d, %d) for a point-to-point connection to rank %d",
               *from, c->rank, c->world, c->rank);
      return -1;
    }
    if (c->p2p[*from].fd >= 0) {
      snprintf(why, n,
               "rank %d already has a point-to-point connection (a second process with the "
               "same rank?)",
               *from);
      return -1;
    }
    return 0;
  }
  snprintf(
      why, n, "unexpected connection kind %d for rank %d%s", *kind, c->rank,
      *kind == KIND_P2P ? " (point-to-point is on at one rank only: set p2p on every rank)" : "");
  return -1;
}

static int remaining_ms(const struct rendezvous *z) {
  if (z->deadline_ns == UINT64_MAX) return -1;
  uint64_t now = clock_now_ns();
  return now >= z->deadline_ns ? 0 : (int)((z->deadline_ns - now + 999999u) / 1000000u);
}

/* Connects to rank `to` and sends the hello; the reply comes in the loop. */
static ps_status connect_peer(struct rendezvous *z, int to, int kind, struct link **out, char *err,
                              size_t errlen) {
  ps_coll *c = z->c;
  struct net_addr a;
  char why[400];
  if (net_parse_addr(z->o->peers[to], &a, 0, why, sizeof(why)) < 0) {
    snprintf(err, errlen, "peer address of rank %d: %s", to, why);
    return PS_ERR_INVALID;
  }
  struct net_backoff bo = {.initial_ms = 50, .max_ms = 1000, .deadline_ms = remaining_ms(z)};
  if (bo.deadline_ms == 0) bo.deadline_ms = 1; /* one try */
  int fd = net_connect(&a, &bo, why, sizeof(why));
  if (fd < 0) {
    snprintf(err, errlen, "cannot reach rank %d at %s: %s", to, z->o->peers[to], why);
    return PS_ERR_CONNECT;
  }
  struct link *l = link_new(fd, AUTH_INITIATOR, c->token);
  if (!l) {
    close(fd);
    snprintf(err, errlen, "out of memory");
    return PS_ERR_NOMEM;
  }
  l->to = to;
  l->kind = kind;
  l->st = L_REPLY;
  l->deadline_ns = z->deadline_ns;
  *out = l;
  wire_header h = PS__HEADER__INIT;
  Ps__Hello hello = PS__HELLO__INIT;
  hello.rank = (uint32_t)c->rank;
  hello.world_size = (uint32_t)c->world;
  hello.job_id = (char *)c->job;
  hello.client = CLIENT_NAME;
  h.type = PS__MSG_TYPE__MSG_HELLO;
  h.rank = (uint32_t)c->rank;
  h.key = (uint64_t)to;
  h.flags = (uint32_t)kind;
  h.body_case = PS__HEADER__BODY_HELLO;
  h.hello = &hello;
  if (hs_initiator_hello(&l->hs, &hello) < 0) {
    snprintf(err, errlen, "no randomness for the handshake nonce");
    return PS_ERR_IO;
  }
  uint8_t buf[FRAME_BUF];
  int64_t n = wire_send_frame(fd, &h, NULL, 0, NULL, buf, sizeof(buf));
  if (n == -EMSGSIZE) {
    snprintf(err, errlen, "hello does not fit a frame (job id too long?)");
    return PS_ERR_INVALID;
  }
  if (n < 0) {
    snprintf(err, errlen, "rank %d at %s closed the connection before the hello", to,
             z->o->peers[to]);
    return PS_ERR_CONNECT;
  }
  hs_initiator_sent(&l->hs, buf + FRAME_PREAMBLE_BYTES, (size_t)n - FRAME_PREAMBLE_BYTES);
  return PS_OK;
}

/* Our link l to rank l->to is done: the group takes its socket and session. */
static void install_out(struct rendezvous *z, struct link *l) {
  ps_coll *c = z->c;
  if (l->kind == KIND_RING) {
    c->next_fd = l->fd;
    c->next_auth = l->session;
  } else if (l->kind == KIND_P2P) {
    c->p2p[l->to].fd = l->fd;
    c->p2p[l->to].auth = l->session;
  } else {
    c->ctrl[0].fd = l->fd;
    c->ctrl[0].auth = l->session;
  }
  l->fd = -1;
  l->session = NULL;
}

/* Advances our link l with what it received. Returns PS_OK (in progress, or
 * done: *done), or the rendezvous's failure with err. */
static ps_status step_out(struct rendezvous *z, struct link *l, bool *done, bool *busy, char *err,
                          size_t errlen) {
  ps_coll *c = z->c;
  const char *addr = z->o->peers[l->to];
  char why[300] = "";
  *done = false;
  *busy = false;
  wire_header *h = NULL;
  int r = link_take(z, l, &h, why, sizeof(why));
  if (r == 0) return PS_OK;
  if (r == -EBADMSG) {
    snprintf(err, errlen, "%s (rank %d's address) does not speak the ps protocol: %s", addr, l->to,
             why);
    return PS_ERR_REMOTE;
  }
  if (r < 0) {
    snprintf(err, errlen, "rank %d at %s closed the connection during the %s: %s", l->to, addr,
             l->st == L_REPLY ? "hello" : "handshake", strerror(-r));
    return PS_ERR_CONNECT;
  }
  if (h->type == PS__MSG_TYPE__MSG_ERROR && h->body_case == PS__HEADER__BODY_ERROR) {
    snprintf(err, errlen, "the peer at %s (rank %d's address) refused this rank: %s", addr, l->to,
             h->error->message ? h->error->message : "?");
    *busy = h->error->code == PS__ERROR_CODE__ERR_LIMIT; /* its handshakes are full: again */
    return PS_ERR_REMOTE;
  }
  if (l->st == L_REPLY) {
    Ps__Auth auth;
    r = hs_initiator_on_reply(&l->hs, h, &auth, why, sizeof(why));
    if (r < 0) {
      if (h->type == PS__MSG_TYPE__MSG_AUTH) { /* it waits for our proof: tell it why not */
        char msg[200];
        snprintf(
            msg, sizeof(msg), "authentication failed: rank %d %s", c->rank,
            c->token ? "could not verify your proof: wrong token" : "has no --auth-token-file");
        watchdog_send_error(l->fd, PS__ERROR_CODE__ERR_AUTH, c->rank, msg, NULL);
      }
      snprintf(err, errlen, "rank %d at %s: %s", l->to, addr, why);
      return PS_ERR_REMOTE;
    }
    link_next_frame(l);
    if (r == 0) { /* no token on either side */
      *done = true;
      return PS_OK;
    }
    l->session = hs_take_session(&l->hs);
    if (send_auth(l->fd, &auth) < 0) {
      snprintf(err, errlen, "rank %d at %s closed the connection during the handshake", l->to,
               addr);
      return PS_ERR_CONNECT;
    }
    l->st = L_ACK;
    return PS_OK;
  }
  /* L_ACK: the ACK is the first frame with a tag. */
  if (h->type == PS__MSG_TYPE__MSG_ACK &&
      l->got < FRAME_PREAMBLE_BYTES + l->hlen + AUTH_TAG_BYTES) {
    l->want = FRAME_PREAMBLE_BYTES + l->hlen + AUTH_TAG_BYTES;
    r = link_read(l, why, sizeof(why));
    if (r == 0) return PS_OK;
    if (r < 0) {
      snprintf(err, errlen, "rank %d at %s closed the connection during the handshake: %s", l->to,
               addr, strerror(-r));
      return PS_ERR_CONNECT;
    }
  }
  if (h->type == PS__MSG_TYPE__MSG_ACK) {
    struct iovec v = {l->frame, FRAME_PREAMBLE_BYTES + l->hlen};
    if (auth_open(l->session, &v, 1, l->frame + FRAME_PREAMBLE_BYTES + l->hlen) != 0) {
      snprintf(err, errlen, "rank %d at %s: its handshake ACK failed authentication", l->to, addr);
      return PS_ERR_REMOTE;
    }
  }
  if (hs_initiator_on_ack(&l->hs, h, why, sizeof(why)) < 0) {
    snprintf(err, errlen, "rank %d at %s: %s", l->to, addr, why);
    return PS_ERR_REMOTE;
  }
  *done = true;
  return PS_OK;
}

/* Turns the accepted link l away: an ERROR naming why (code 0: none, the
 * stream is out of sync or gone), a warning with its address, and the count
 * and last reason for the timeout message. Frees l. */
static void refuse(struct rendezvous *z, struct link *l, Ps__ErrorCode code, const char *why) {
  if (code) watchdog_send_error(l->fd, code, z->c->rank, why, NULL);
  z->refusals++;
  snprintf(z->refused, sizeof(z->refused), "%s: %s", l->peer, why);
  log_warn("refused a ring connection", "peer=%s reason=\"%s\" refused=%u", l->peer, why,
           z->refusals);
  link_free(l);
}

/* The accepted link l authenticated (or nobody has a token): checks its
 * hello and hands the socket to the group, or refuses it. Frees l. */
static void finish_accept(struct rendezvous *z, struct link *l, const wire_header *hello) {
  ps_coll *c = z->c;
  char why[300] = "";
  int from = -1, kind = 0;
  if (check_hello(z, hello, &from, &kind, why, sizeof(why)) < 0) {
    refuse(z, l, PS__ERROR_CODE__ERR_BAD_RANK, why);
    return;
  }
  wire_header ack = PS__HEADER__INIT;
  ack.type = PS__MSG_TYPE__MSG_ACK;
  ack.rank = (uint32_t)c->rank;
  if (watchdog_send_frame(l->fd, &ack, l->session) < 0) {
    link_free(l);
    return;
  }
  if (kind == KIND_RING) {
    c->prev_fd = l->fd;
    c->prev_auth = l->session;
  } else if (kind == KIND_P2P) {
    c->p2p[from].fd = l->fd;
    c->p2p[from].auth = l->session;
  } else {
    c->ctrl[from - 1].fd = l->fd;
    c->ctrl[from - 1].auth = l->session;
  }
  l->fd = -1;
  l->session = NULL;
  link_free(l);
}

/* Advances the accepted link l. Returns true once l is gone (handed over or
 * refused, and freed). */
static bool step_in(struct rendezvous *z, struct link *l) {
  char why[300] = "";
  wire_header *h = NULL;
  int r = link_take(z, l, &h, why, sizeof(why));
  if (r == 0) return false;
  if (r < 0) {
    if (r != -EBADMSG)
      snprintf(why, sizeof(why), "%s (%s)", l->st == L_HELLO ? "no hello" : "no proof",
               r == -ECONNRESET ? "connection closed" : strerror(-r));
    refuse(z, l, 0, why);
    return true;
  }
  Ps__Auth auth;
  if (l->st == L_HELLO) {
    if (!z->c->token && h->type == PS__MSG_TYPE__MSG_HELLO &&
        h->body_case == PS__HEADER__BODY_HELLO && h->hello->nonce.len > 0) {
      /* It would refuse our plain ACK (handshake.h); say why on both sides. */
      snprintf(why, sizeof(why),
               "authentication mismatch: rank %u has a token (--auth-token-file) but rank %d was "
               "started without one; every rank needs the job's token",
               h->hello->rank, z->c->rank);
      refuse(z, l, PS__ERROR_CODE__ERR_AUTH, why);
      return true;
    }
    r = hs_acceptor_on_hello(&l->hs, l->frame + FRAME_PREAMBLE_BYTES, l->hlen, h, &auth, why,
                             sizeof(why));
    if (r < 0) {
      refuse(z, l, r == -EACCES ? PS__ERROR_CODE__ERR_AUTH : PS__ERROR_CODE__ERR_PROTOCOL, why);
      return true;
    }
    if (r == 0) { /* no token here: the hello is all there is */
      finish_accept(z, l, h);
      return true;
    }
    memcpy(l->hello, l->frame + FRAME_PREAMBLE_BYTES, l->hlen);
    l->hello_len = l->hlen;
    if (send_auth(l->fd, &auth) < 0) {
      refuse(z, l, 0, "connection closed during the handshake");
      return true;
    }
    link_next_frame(l);
    l->st = L_PROOF;
    l->proof_since_ns = clock_now_ns();
    l->deadline_ns = z->deadline_ns; /* its initiator may be busy connecting elsewhere */
    return false;
  }
  /* L_PROOF */
  if (h->type == PS__MSG_TYPE__MSG_ERROR && h->body_case == PS__HEADER__BODY_ERROR) {
    snprintf(why, sizeof(why), "it gave up the handshake: %.200s",
             h->error->message ? h->error->message : "?");
    refuse(z, l, 0, why);
    return true;
  }
  r = hs_acceptor_on_auth(&l->hs, h, why, sizeof(why));
  if (r < 0) {
    refuse(z, l, r == -EACCES ? PS__ERROR_CODE__ERR_AUTH : PS__ERROR_CODE__ERR_PROTOCOL, why);
    return true;
  }
  l->session = hs_take_session(&l->hs);
  if (wire_header_unpack(&z->arena, l->hello, l->hello_len, &h) < 0) { /* decoded once before */
    refuse(z, l, PS__ERROR_CODE__ERR_PROTOCOL, "undecodable hello");
    return true;
  }
  finish_accept(z, l, h);
  return true;
}

static void drop_in(struct rendezvous *z, int i) {
  z->in[i] = z->in[--z->nin];
  z->in[z->nin] = NULL;
}

/* The accepted link to drop for a newcomer when all max_in are taken
 * (see the top of the file), or -1: the newcomer is turned away. */
static int room_for_one(const struct rendezvous *z) {
  uint64_t now = clock_now_ns(), grace = (uint64_t)PROOF_GRACE_MS * 1000000u;
  int hello = -1, proof = -1;
  for (int i = 0; i < z->nin; i++) {
    const struct link *l = z->in[i];
    if (l->st == L_HELLO) {
      if (hello < 0 || l->since_ns < z->in[hello]->since_ns) hello = i;
    } else if (l->got == 0 && now - l->proof_since_ns > grace) { /* no byte of its proof yet */
      if (proof < 0 || l->proof_since_ns < z->in[proof]->proof_since_ns) proof = i;
    }
  }
  return hello >= 0 ? hello : proof;
}

/* One connection is waiting on the listening socket. */
static void accept_one(struct rendezvous *z) {
  char peer[80] = "?";
  int fd = net_accept(z->listen_fd, peer, sizeof(peer));
  if (fd < 0) return;
  if (z->nin == z->max_in) { /* a flood must neither lock the genuine peer out nor drop it */
    int i = room_for_one(z);
    if (i < 0) {
      char why[120];
      snprintf(why, sizeof(why), "busy: %d connections in their handshake; try again", z->nin);
      watchdog_send_error(fd, PS__ERROR_CODE__ERR_LIMIT, z->c->rank, why, NULL);
      /* its hello unread at close would turn our FIN into a reset that can
       * destroy the ERROR before it is read: take what has arrived */
      shutdown(fd, SHUT_WR);
      char sink[512];
      while (recv(fd, sink, sizeof(sink), MSG_DONTWAIT) > 0) {
      }
      close(fd);
      z->refusals++;
      snprintf(z->refused, sizeof(z->refused), "%s: %s", peer, why);
      return;
    }
    struct link *l = z->in[i];
    drop_in(z, i);
    refuse(z, l, PS__ERROR_CODE__ERR_LIMIT, "too many connections in their handshake; dropped");
  }
  struct link *l = link_new(fd, AUTH_ACCEPTOR, z->c->token);
  if (!l) {
    close(fd);
    return;
  }
  snprintf(l->peer, sizeof(l->peer), "%s", peer);
  l->st = L_HELLO;
  uint64_t d = l->since_ns + (uint64_t)HELLO_WAIT_MS * 1000000u;
  l->deadline_ns = d < z->deadline_ns ? d : z->deadline_ns;
  z->in[z->nin++] = l;
}

static void describe_missing(const ps_coll *c, char *out, size_t n) {
  size_t len = 0;
  out[0] = 0;
  if (c->prev_fd < 0)
    len +=
        (size_t)snprintf(out + len, n - len, "rank %d (ring)", (c->rank + c->world - 1) % c->world);
  for (int i = 0; i < c->nctrl && c->rank == 0 && len < n; i++)
    if (c->ctrl[i].fd < 0)
      len += (size_t)snprintf(out + len, n - len, "%srank %d (control)", len ? ", " : "",
                              c->ctrl[i].rank);
  for (int s = c->rank + 1; c->p2p && s < c->world && len < n; s++)
    if (c->p2p[s].fd < 0)
      len += (size_t)snprintf(out + len, n - len, "%srank %d (point-to-point)", len ? ", " : "", s);
}

static bool accepted_all(const ps_coll *c) {
  bool complete = c->prev_fd >= 0;
  for (int i = 0; c->rank == 0 && i < c->nctrl; i++) complete = complete && c->ctrl[i].fd >= 0;
  for (int s = c->rank + 1; c->p2p && s < c->world; s++) complete = complete && c->p2p[s].fd >= 0;
  return complete;
}

/* Ours still in a handshake or waiting to connect again. */
static bool ours_pending(const struct rendezvous *z) {
  for (int k = 0; k < z->nout; k++)
    if (z->out[k].l || z->out[k].retry_ns) return true;
  return false;
}

/* The deadline passed: says what is missing. */
static ps_status timed_out(struct rendezvous *z, char *err, size_t errlen) {
  ps_coll *c = z->c;
  if (!accepted_all(c)) {
    char missing[300];
    describe_missing(c, missing, sizeof(missing));
    snprintf(err, errlen, "rendezvous timed out: %s never connected to rank %d%s%s", missing,
             c->rank, z->refused[0] ? "; refused: " : "", z->refused);
    return z->refused[0] ? PS_ERR_REMOTE : PS_ERR_CONNECT;
  }
  for (int k = 0; k < z->nout; k++)
    if (z->out[k].l) {
      snprintf(err, errlen, "rank %d at %s accepted but did not answer the hello in time",
               z->out[k].to, z->o->peers[z->out[k].to]);
      return PS_ERR_CONNECT;
    }
  int k = 0; /* only retries left: the peer stayed busy */
  while (k < z->nout - 1 && !z->out[k].retry_ns) k++;
  snprintf(err, errlen,
           "rank %d at %s stayed busy until the deadline (%u tries): too many connections "
           "in their handshake there, a flood of strangers?",
           z->out[k].to, z->o->peers[z->out[k].to], z->busy_retries);
  return PS_ERR_CONNECT;
}

/* Our link out[k] received something: advances it, and on ERR_LIMIT
 * schedules it to connect again. */
static ps_status step_ours(struct rendezvous *z, int k, char *err, size_t errlen) {
  struct out_link *o = &z->out[k];
  bool done = false, busy = false;
  ps_status st = step_out(z, o->l, &done, &busy, err, errlen);
  if (st != PS_OK && busy) {
    unsigned ms = BUSY_RETRY_MS << (z->busy_retries < 5 ? z->busy_retries : 5);
    ms = ms < BUSY_RETRY_MAX_MS ? ms : BUSY_RETRY_MAX_MS;
    z->busy_retries++;
    log_info("ring peer busy; connecting again", "rank=%d retry_ms=%u detail=\"%s\"", o->to, ms,
             err);
    o->retry_ns = clock_now_ns() + (uint64_t)ms * 1000000u;
    link_free(o->l);
    o->l = NULL;
    return PS_OK;
  }
  if (st != PS_OK) return st;
  if (done) {
    install_out(z, o->l);
    link_free(o->l);
    o->l = NULL;
  }
  return PS_OK;
}

/* Drives every handshake (ours and the accepted ones) until the group is
 * connected, a peer refuses us, or the deadline passes. */
static ps_status handshake_all(struct rendezvous *z, char *err, size_t errlen) {
  ps_coll *c = z->c;
  size_t cap = 1 + (size_t)z->nout + (size_t)z->max_in;
  struct pollfd *pfd = calloc(cap, sizeof(*pfd));
  struct link **who = calloc(cap, sizeof(*who));
  int *slot = calloc(cap, sizeof(*slot));
  ps_status st = PS_ERR_NOMEM;
  if (!pfd || !who || !slot) {
    snprintf(err, errlen, "out of memory");
    goto out;
  }
  for (;;) {
    if (!ours_pending(z) && accepted_all(c)) {
      st = PS_OK;
      goto out;
    }
    uint64_t now = clock_now_ns();
    for (int k = 0; k < z->nout; k++) { /* ours turned away as busy: again, once their time comes */
      struct out_link *o = &z->out[k];
      if (!o->retry_ns || now < o->retry_ns || now >= z->deadline_ns) continue;
      o->retry_ns = 0;
      st = connect_peer(z, o->to, o->kind, &o->l, err, errlen);
      if (st != PS_OK) goto out;
    }
    if (now >= z->deadline_ns) {
      st = timed_out(z, err, errlen);
      goto out;
    }
    for (int i = 0; i < z->nin;) { /* accepted links past their deadline */
      struct link *l = z->in[i];
      if (now < l->deadline_ns) {
        i++;
        continue;
      }
      drop_in(z, i);
      refuse(z, l, 0, l->st == L_HELLO ? "no hello (timed out)" : "no proof (timed out)");
    }
    uint64_t wake = z->deadline_ns;
    int n = 0;
    pfd[n] = (struct pollfd){.fd = z->listen_fd, .events = POLLIN};
    who[n++] = NULL;
    for (int k = 0; k < z->nout; k++) {
      if (z->out[k].retry_ns && z->out[k].retry_ns < wake) wake = z->out[k].retry_ns;
      if (!z->out[k].l) continue;
      pfd[n] = (struct pollfd){.fd = z->out[k].l->fd, .events = POLLIN};
      slot[n] = k;
      who[n++] = z->out[k].l;
    }
    int first_in = n;
    for (int i = 0; i < z->nin; i++) {
      pfd[n] = (struct pollfd){.fd = z->in[i]->fd, .events = POLLIN};
      who[n++] = z->in[i];
      if (z->in[i]->deadline_ns < wake) wake = z->in[i]->deadline_ns;
    }
    int wait = wake == UINT64_MAX ? -1 : (int)((wake - now + 999999u) / 1000000u);
    int pr = poll(pfd, (nfds_t)n, wait);
    if (pr < 0 && errno != EINTR) {
      snprintf(err, errlen, "poll during the rendezvous: %s", strerror(errno));
      st = PS_ERR_CONNECT;
      goto out;
    }
    if (pr <= 0) continue;
    for (int k = 1; k < n; k++) {
      if (!pfd[k].revents) continue;
      if (k < first_in) {
        st = step_ours(z, slot[k], err, errlen);
        if (st != PS_OK) goto out;
        continue;
      }
      for (int i = 0; i < z->nin; i++)
        if (z->in[i] == who[k]) {
          if (step_in(z, who[k])) drop_in(z, i); /* freed */
          break;
        }
    }
    if (pfd[0].revents & POLLIN) accept_one(z);
  }
out:
  free(pfd);
  free(who);
  free(slot);
  return st;
}

/* The rendezvous failed here: tell whoever is still in a handshake with us
 * (either way), or waiting in our backlog, why (their own mismatch if their hello has one
 * and nobody needs a token, else our error) rather than leaving them a bare
 * reset. Stops after GRACE_MS without a caller. */
static void refuse_pending(struct rendezvous *z, const char *why_we_fail) {
  ps_coll *c = z->c;
  char msg[600];
  snprintf(msg, sizeof(msg), "rank %d cannot join: %s", c->rank, why_we_fail);
  /* A peer waiting for our proof is told too. Only then: a peer that sent
   * its ACK already reads the stream as ring data or tagged frames. */
  for (int k = 0; k < z->nout; k++)
    if (c->token && z->out[k].l && z->out[k].l->st == L_REPLY)
      watchdog_send_error(z->out[k].l->fd, PS__ERROR_CODE__ERR_PROTOCOL, c->rank, msg, NULL);
  while (z->nin > 0) {
    struct link *l = z->in[0];
    drop_in(z, 0);
    watchdog_send_error(l->fd, PS__ERROR_CODE__ERR_PROTOCOL, c->rank, msg, NULL);
    link_free(l);
  }
  for (;;) {
    struct pollfd pfd = {.fd = z->listen_fd, .events = POLLIN};
    if (poll(&pfd, 1, GRACE_MS) <= 0) return;
    int fd = net_accept(z->listen_fd, NULL, 0);
    if (fd < 0) return;
    wire_header *h;
    char why[300] = "";
    uint64_t deadline = clock_now_ns() + (uint64_t)GRACE_MS * 1000000u;
    int from, kind;
    if (link_recv_frame(fd, &z->arena, z->hbuf, deadline, &h, why, sizeof(why)) == 0) {
      /* With a token, an unauthenticated caller learns nothing of our configuration. */
      bool mismatch = !c->token && check_hello(z, h, &from, &kind, why, sizeof(why)) < 0;
      watchdog_send_error(fd, PS__ERROR_CODE__ERR_PROTOCOL, c->rank, mismatch ? why : msg, NULL);
    }
    close(fd);
  }
}

static void rendezvous_deinit(struct rendezvous *z) {
  for (int k = 0; k < z->nout; k++) link_free(z->out[k].l);
  free(z->out);
  while (z->nin > 0) {
    link_free(z->in[z->nin - 1]);
    drop_in(z, z->nin - 1);
  }
  free(z->in);
  if (z->listen_fd >= 0) close(z->listen_fd);
  wire_arena_deinit(&z->arena);
}

static ps_status rendezvous_steps(struct rendezvous *z, char *err, size_t errlen) {
  ps_coll *c = z->c;
  z->nout = 2 + (c->p2p ? c->rank : 0);
  z->out = calloc((size_t)z->nout, sizeof(*z->out));
  if (!z->out) {
    z->nout = 0;
    snprintf(err, errlen, "out of memory");
    return PS_ERR_NOMEM;
  }
  ps_status st = PS_OK;
  for (int k = 0; k < z->nout && st == PS_OK; k++) {
    struct out_link *o = &z->out[k];
    o->to = k == 0 ? (c->rank + 1) % c->world : k == 1 ? 0 : k - 2;
    o->kind = k == 0 ? KIND_RING : k == 1 ? KIND_CTRL : KIND_P2P;
    if (k != 1 || c->rank != 0) st = connect_peer(z, o->to, o->kind, &o->l, err, errlen);
  }
  if (st == PS_OK) st = handshake_all(z, err, errlen);
  return st;
}

/* ---- entry point ---- */

static ps_status open_listener(const struct ps_coll_opts *o, int *fd_out, char *err,
                               size_t errlen) {
  if (o->listen_fd > 0) {
    *fd_out = o->listen_fd;
    return PS_OK;
  }
  struct net_addr a;
  char why[400];
  if (o->listen_addr && o->listen_addr[0]) {
    if (net_parse_addr(o->listen_addr, &a, 0, why, sizeof(why)) < 0) {
      snprintf(err, errlen, "listen address: %s", why);
      return PS_ERR_INVALID;
    }
  } else {
    if (net_parse_addr(o->peers[o->rank], &a, 0, why, sizeof(why)) < 0) {
      snprintf(err, errlen, "peer address of rank %d (this rank): %s", o->rank, why);
      return PS_ERR_INVALID;
    }
    snprintf(a.host, sizeof(a.host), "0.0.0.0");
  }
  int fd = net_listen(&a, SOMAXCONN, why, sizeof(why));
  if (fd < 0) {
    snprintf(err, errlen, "cannot listen for ring peers: %s", why);
    return fd == -EADDRINUSE ? PS_ERR_CONNECT : PS_ERR_INVALID;
  }
  *fd_out = fd;
  return PS_OK;
}

ps_status rendezvous_run(ps_coll *c, const struct ps_coll_opts *o, char *err, size_t errlen) {
  struct rendezvous z = {.c = c, .o = o, .listen_fd = -1};
  if (wire_arena_init(&z.arena, 64 * 1024) < 0) return PS_ERR_NOMEM;
  z.max_in =
      MAX_PENDING + 1 + (c->rank == 0 ? c->world - 1 : 0) + (c->p2p ? c->world - 1 - c->rank : 0);
  z.in = calloc((size_t)z.max_in, sizeof(*z.in));
  if (!z.in) {
    wire_arena_deinit(&z.arena);
    return PS_ERR_NOMEM;
  }
  int cto = o->connect_timeout_ms == 0 ? DEFAULT_CONNECT_MS : o->connect_timeout_ms;
  z.deadline_ns = cto < 0 ? UINT64_MAX : clock_now_ns() + (uint64_t)cto * 1000000u;
  ps_status st = open_listener(o, &z.listen_fd, err, errlen);
  if (st != PS_OK) goto out;
  if (!c->token)
    log_warn("ring peers are not authenticated",
             "rank=%d listen=%s note=\"anyone who can reach this port can join the ring or "
             "feed it data; start every rank with --auth-token-file\"",
             c->rank, o->listen_addr && o->listen_addr[0] ? o->listen_addr : o->peers[c->rank]);
  st = rendezvous_steps(&z, err, errlen);
  if (st != PS_OK) refuse_pending(&z, err);
out:
  rendezvous_deinit(&z);
  return st;
}
