/* rendezvous: the table and the shared fate of a job across hosts
 * (rendezvous.h).
 *
 * Wire. Every message is a 4-byte big-endian length and that many bytes of
 * text (no NUL). The service refuses (logs and closes) a message over
 * RDZV_HELLO_MAX, one it cannot parse, a second registration of a node, a
 * node count that differs from its own, a wrong proof, and a connection
 * that has not registered within RDZV_HELLO_MS; a client takes at most
 * RDZV_MSG_MAX. Nothing a peer sends is trusted past these checks.
 *   service -> node   NONCE <64 hex>            at once, on accept
 *   node -> service   HELLO <node> <nodes> <host> <shards|-> <peers|-> <proof|->
 *   service -> node   TABLE <servers|-> <peers|-> <proof|->   once all N registered
 *   both ways         PING                      every RDZV_BEAT_MS
 *   node -> service   FAIL <what>  |  DONE
 *   service -> node   FAIL <node> <host> <what>  a node failed or went silent
 *                     ABORT <what>               the rendezvous timed out, or
 *                                                this node was refused
 * Authentication, when the job has a token (--auth-token-file): the HELLO's
 * proof is auth_proof(token, initiator, SHA-256(HELLO up to the proof),
 * nonce) and the TABLE's the acceptor's over the TABLE's text, so neither
 * a stranger on the port nor a fake service can join or feed the job a
 * table (common/auth.h: the same token and proofs as the shards'). The
 * later messages (PING, FAIL, DONE) are not authenticated: one can only
 * stop the job, as closing the connection does. */
#include "rendezvous.h"

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "auth.h"
#include "clock.h"
#include "log.h"
#include "net.h"

enum { RDZV_HELLO_MS = 10000, RDZV_EXTRA_CONNS = 16, HOST_BYTES = 64 };

/* ---- frames ---- */

struct rbuf {
  char *buf;
  size_t len, cap, max;
};

static int send_msg(int fd, const char *text) {
  size_t n = strlen(text);
  uint32_t be = htonl((uint32_t)n);
  struct iovec iov[2] = {{&be, 4}, {(void *)text, n}};
  return net_writev_all(fd, iov, 2) < 0 ? -1 : 0;
}

/* Reads what is there. Returns 0, or -1 on EOF or an error. */
static int rbuf_fill(int fd, struct rbuf *b) {
  for (;;) {
    if (b->cap - b->len < 4096) {
      size_t cap = b->cap ? b->cap * 2 : 8192;
      if (cap > b->max + 4096) cap = b->max + 4096;
      if (cap <= b->len) return -1;
      char *p = realloc(b->buf, cap);
      if (!p) return -1;
      b->buf = p;
      b->cap = cap;
    }
    ssize_t n = recv(fd, b->buf + b->len, b->cap - b->len, MSG_DONTWAIT);
    if (n > 0) {
      b->len += (size_t)n;
      continue;
    }
    if (n == 0) return -1;
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
  }
}

/* The next whole message, NUL-terminated in out (malloc'd). Returns 1, 0
 * (not yet whole) or -1 (longer than b->max). */
static int rbuf_next(struct rbuf *b, char **out) {
  if (b->len < 4) return 0;
  uint32_t be;
  memcpy(&be, b->buf, 4);
  size_t n = ntohl(be);
  if (n > b->max) return -1;
  if (b->len < 4 + n) return 0;
  char *m = malloc(n + 1);
  if (!m) return -1;
  memcpy(m, b->buf + 4, n);
  m[n] = '\0';
  memmove(b->buf, b->buf + 4 + n, b->len - 4 - n);
  b->len -= 4 + n;
  *out = m;
  return 1;
}

static void to_hex(const uint8_t *p, size_t n, char *out) {
  for (size_t i = 0; i < n; i++) snprintf(out + 2 * i, 3, "%02x", p[i]);
}

static int from_hex(const char *s, uint8_t *p, size_t n) {
  if (strlen(s) != 2 * n) return -1;
  for (size_t i = 0; i < n; i++) {
    unsigned v;
    if (sscanf(s + 2 * i, "%2x", &v) != 1) return -1;
    p[i] = (uint8_t)v;
  }
  return 0;
}

/* "<body> <proof hex>": the proof of role over body and nonce ("-" without a token). */
static char *with_proof(const struct auth_token *tok, enum auth_role role, const char *body,
                        const uint8_t *nonce) {
  size_t n = strlen(body);
  char *m = malloc(n + 2 + 2 * AUTH_PROOF_BYTES + 1);
  if (!m) return NULL;
  memcpy(m, body, n);
  m[n] = ' ';
  if (!tok) {
    strcpy(m + n + 1, "-");
    return m;
  }
  uint8_t th[AUTH_HASH_BYTES], proof[AUTH_PROOF_BYTES];
  auth_transcript(body, n, th);
  auth_proof(tok, role, th, nonce, proof);
  to_hex(proof, sizeof(proof), m + n + 1);
  return m;
}

/* Splits "<body> <proof>" in place and checks the proof. */
static bool check_proof(const struct auth_token *tok, enum auth_role role, char *msg,
                        const uint8_t *nonce) {
  char *sp = strrchr(msg, ' ');
  if (!sp) return false;
  *sp = '\0';
  if (!tok) return true;
  uint8_t th[AUTH_HASH_BYTES], proof[AUTH_PROOF_BYTES];
  if (from_hex(sp + 1, proof, sizeof(proof)) < 0) return false;
  auth_transcript(msg, strlen(msg), th);
  return auth_proof_check(tok, role, th, nonce, proof, sizeof(proof));
}

/* ---- the service (node 0) ---- */

struct conn {
  int fd;
  int node; /* -1 until registered */
  char peer[HOST_BYTES];
  struct rbuf in;
  uint8_t nonce[AUTH_NONCE_BYTES];
  uint64_t since_ms, last_rx_ms;
};

struct node_slot {
  int conn; /* -1 = not registered */
  char host[HOST_BYTES];
  char *shards, *peers;
  bool done, failed;
};

struct rdzv_server {
  int listen_fd, nodes, timeout_ms;
  const struct auth_token *tok;
  struct conn *conns;
  int max_conns;
  struct node_slot *slots;
  int registered;
  bool table_sent, job_failed;
  int wake[2];         /* rdzv_server_stop writes here */
  uint64_t stop_at_ms; /* 0 = running; else leave by then, sooner once all are done */
  pthread_mutex_t mu;
  pthread_t thread;
};

static void drop(struct rdzv_server *s, int i, const char *why) {
  struct conn *c = &s->conns[i];
  if (why) log_warn("rendezvous refused", "peer=%s why=\"%s\"", c->peer, why);
  close(c->fd);
  c->fd = -1;
  free(c->in.buf);
  memset(&c->in, 0, sizeof(c->in));
  if (c->node >= 0) s->slots[c->node].conn = -1;
  c->node = -1;
}

static void refuse(struct rdzv_server *s, int i, const char *why) {
  char m[300];
  snprintf(m, sizeof(m), "ABORT the rendezvous refused this node: %s", why);
  send_msg(s->conns[i].fd, m);
  drop(s, i, why);
}

/* Tells every node but `except` (-1 = all) that node j failed. */
static void broadcast_fail(struct rdzv_server *s, int j, const char *what) {
  char m[512];
  snprintf(m, sizeof(m), "FAIL %d %s %s", j, s->slots[j].host, what);
  log_warn("rendezvous node failed", "node=%d host=%s what=\"%s\"", j, s->slots[j].host, what);
  s->job_failed = true;
  s->slots[j].failed = true;
  for (int n = 0; n < s->nodes; n++)
    if (n != j && s->slots[n].conn >= 0) send_msg(s->conns[s->slots[n].conn].fd, m);
}

static void send_table(struct rdzv_server *s) {
  size_t cap = 64;
  for (int n = 0; n < s->nodes; n++)
    cap += strlen(s->slots[n].shards) + strlen(s->slots[n].peers) + 2;
  char *body = malloc(cap), *sv = malloc(cap), *pr = malloc(cap);
  if (!body || !sv || !pr) goto out;
  size_t a = 0, b = 0;
  for (int n = 0; n < s->nodes; n++) {
    if (s->slots[n].shards[0])
      a += (size_t)snprintf(sv + a, cap - a, "%s%s", a ? "," : "", s->slots[n].shards);
    if (s->slots[n].peers[0])
      b += (size_t)snprintf(pr + b, cap - b, "%s%s", b ? "," : "", s->slots[n].peers);
  }
  snprintf(body, cap, "TABLE %s %s", a ? sv : "-", b ? pr : "-");
  for (int n = 0; n < s->nodes; n++) {
    struct conn *c = &s->conns[s->slots[n].conn];
    char *m = with_proof(s->tok, AUTH_ACCEPTOR, body, c->nonce);
    if (m) send_msg(c->fd, m);
    free(m);
  }
  s->table_sent = true;
  log_info("rendezvous complete", "nodes=%d", s->nodes);
out:
  free(body);
  free(sv);
  free(pr);
}

static bool plausible_list(const char *v) {
  for (const char *p = v; *p; p++)
    if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
          *p == '.' || *p == ':' || *p == ',' || *p == '-' || *p == '[' || *p == ']'))
      return false;
  return true;
}

static void on_hello(struct rdzv_server *s, int i, char *msg) {
  struct conn *c = &s->conns[i];
  if (!check_proof(s->tok, AUTH_INITIATOR, msg, c->nonce))
    return refuse(s, i, "wrong proof of the job's token (--auth-token-file)");
  int node, nodes, used = 0;
  char host[HOST_BYTES], shards[RDZV_HELLO_MAX], peers[RDZV_HELLO_MAX];
  if (sscanf(msg, "HELLO %d %d %63s %65535s %65535s%n", &node, &nodes, host, shards, peers,
             &used) != 5 ||
      msg[used] || !plausible_list(host) || !plausible_list(shards) || !plausible_list(peers))
    return refuse(s, i, "a malformed HELLO");
  char why[160];
  if (nodes != s->nodes) {
    snprintf(why, sizeof(why), "it says --nodes %d, node 0 says %d", nodes, s->nodes);
    return refuse(s, i, why);
  }
  if (node < 0 || node >= s->nodes) {
    snprintf(why, sizeof(why), "--node-rank %d is not in [0, %d)", node, s->nodes);
    return refuse(s, i, why);
  }
  if (s->slots[node].conn >= 0 || s->table_sent) {
    snprintf(why, sizeof(why), "node %d registered already", node);
    return refuse(s, i, why);
  }
  struct node_slot *sl = &s->slots[node];
  free(sl->shards);
  free(sl->peers);
  sl->shards = strdup(strcmp(shards, "-") ? shards : "");
  sl->peers = strdup(strcmp(peers, "-") ? peers : "");
  if (!sl->shards || !sl->peers) return drop(s, i, "out of memory");
  snprintf(sl->host, sizeof(sl->host), "%s", host);
  sl->conn = i;
  c->node = node;
  s->registered++;
  log_info("rendezvous registered", "node=%d host=%s registered=%d nodes=%d", node, host,
           s->registered, s->nodes);
  if (s->registered == s->nodes) send_table(s);
}

static void on_message(struct rdzv_server *s, int i, char *msg) {
  struct conn *c = &s->conns[i];
  if (c->node < 0) {
    if (strncmp(msg, "HELLO ", 6) != 0) return refuse(s, i, "the first message is not a HELLO");
    return on_hello(s, i, msg);
  }
  if (strcmp(msg, "PING") == 0) return;
  if (strcmp(msg, "DONE") == 0) {
    s->slots[c->node].done = true;
    return;
  }
  if (strncmp(msg, "FAIL ", 5) == 0) {
    msg[5 + strnlen(msg + 5, 300)] = '\0';
    return broadcast_fail(s, c->node, msg + 5);
  }
  drop(s, i, "an unknown message");
}

static void accept_one(struct rdzv_server *s) {
  char peer[HOST_BYTES];
  int fd = net_accept(s->listen_fd, peer, sizeof(peer));
  if (fd < 0) return;
  int i = 0;
  while (i < s->max_conns && s->conns[i].fd >= 0) i++;
  if (i == s->max_conns) {
    log_warn("rendezvous refused", "peer=%s why=\"too many connections\"", peer);
    close(fd);
    return;
  }
  struct timeval tv = {2, 0}; /* a peer that does not read cannot hold the service */
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  struct conn *c = &s->conns[i];
  memset(c, 0, sizeof(*c));
  c->fd = fd;
  c->node = -1;
  c->in.max = RDZV_HELLO_MAX;
  snprintf(c->peer, sizeof(c->peer), "%s", peer);
  c->since_ms = c->last_rx_ms = clock_now_ms();
  char m[8 + 2 * AUTH_NONCE_BYTES];
  auth_random(c->nonce, sizeof(c->nonce));
  memcpy(m, "NONCE ", 6);
  to_hex(c->nonce, sizeof(c->nonce), m + 6);
  if (send_msg(fd, m) < 0) drop(s, i, NULL);
}

static void check_times(struct rdzv_server *s, uint64_t now, uint64_t deadline) {
  for (int i = 0; i < s->max_conns; i++) {
    struct conn *c = &s->conns[i];
    if (c->fd < 0) continue;
    if (c->node < 0 && now - c->since_ms > RDZV_HELLO_MS)
      drop(s, i, "no HELLO in time");
    else if (c->node >= 0 && !s->slots[c->node].done && !s->slots[c->node].failed &&
             now - c->last_rx_ms > RDZV_LOST_MS) {
      int j = c->node;
      drop(s, i, NULL);
      char what[96];
      snprintf(what, sizeof(what), "lost: no heartbeat for %d s", RDZV_LOST_MS / 1000);
      broadcast_fail(s, j, what);
    }
  }
  if (!s->table_sent && !s->job_failed && now > deadline) {
    char m[1024];
    size_t n = (size_t)snprintf(m, sizeof(m), "ABORT rendezvous timed out after %d s: node(s)",
                                s->timeout_ms / 1000);
    for (int j = 0; j < s->nodes && n < sizeof(m) - 16; j++)
      if (s->slots[j].conn < 0) n += (size_t)snprintf(m + n, sizeof(m) - n, " %d", j);
    snprintf(m + n, sizeof(m) - n, " never came");
    log_warn("rendezvous timed out", "what=\"%s\"", m + 6);
    for (int j = 0; j < s->nodes; j++)
      if (s->slots[j].conn >= 0) send_msg(s->conns[s->slots[j].conn].fd, m);
    s->job_failed = true;
  }
}

static bool all_settled(const struct rdzv_server *s) {
  for (int j = 0; j < s->nodes; j++)
    if (!s->slots[j].done && !s->slots[j].failed && s->slots[j].conn >= 0) return false;
  return true;
}

static void *serve(void *arg) {
  struct rdzv_server *s = arg;
  uint64_t deadline = clock_now_ms() + (uint64_t)s->timeout_ms, next_beat = 0;
  struct pollfd *pf = calloc((size_t)s->max_conns + 2, sizeof(*pf));
  int *idx = calloc((size_t)s->max_conns + 2, sizeof(int));
  if (!pf || !idx) goto out;
  for (;;) {
    uint64_t now = clock_now_ms();
    pthread_mutex_lock(&s->mu);
    uint64_t stop_at = s->stop_at_ms;
    pthread_mutex_unlock(&s->mu);
    if (stop_at && (now >= stop_at || all_settled(s))) break;
    int n = 0;
    pf[n++] = (struct pollfd){s->wake[0], POLLIN, 0};
    pf[n++] = (struct pollfd){s->listen_fd, POLLIN, 0};
    for (int i = 0; i < s->max_conns; i++)
      if (s->conns[i].fd >= 0) {
        idx[n] = i;
        pf[n++] = (struct pollfd){s->conns[i].fd, POLLIN, 0};
      }
    if (poll(pf, (nfds_t)n, 200) < 0 && errno != EINTR) break;
    if (pf[0].revents) {
      char b[16];
      if (read(s->wake[0], b, sizeof(b)) < 0) { /* woken: looked at above */
      }
    }
    if (pf[1].revents & POLLIN) accept_one(s);
    now = clock_now_ms();
    for (int k = 2; k < n; k++) {
      int i = idx[k];
      struct conn *c = &s->conns[i];
      if (!pf[k].revents || c->fd < 0) continue;
      int node = c->node;
      bool eof = rbuf_fill(c->fd, &c->in) < 0;
      c->last_rx_ms = now;
      char *m;
      int r;
      while (c->fd >= 0 && (r = rbuf_next(&c->in, &m)) == 1) {
        on_message(s, i, m);
        free(m);
      }
      if (c->fd >= 0 && r < 0) {
        drop(s, i, "a message over the size limit");
        eof = false;
      }
      if (eof && c->fd >= 0) {
        drop(s, i, NULL);
        if (node >= 0 && !s->slots[node].done && !s->slots[node].failed)
          broadcast_fail(s, node, "lost: its connection to the rendezvous closed");
      }
    }
    check_times(s, now, deadline);
    if (now >= next_beat) {
      for (int j = 0; j < s->nodes; j++)
        if (s->slots[j].conn >= 0) send_msg(s->conns[s->slots[j].conn].fd, "PING");
      next_beat = now + RDZV_BEAT_MS;
    }
  }
out:
  free(pf);
  free(idx);
  return NULL;
}

int rdzv_serve(struct rdzv_server **out, const char *addr, int nodes, int timeout_ms,
               const struct auth_token *tok, char *err, size_t errlen) {
  struct net_addr a;
  if (net_parse_addr(addr, &a, 0, err, errlen) < 0) return -1;
  struct rdzv_server *s = calloc(1, sizeof(*s));
  if (!s) return snprintf(err, errlen, "out of memory"), -1;
  s->nodes = nodes;
  s->timeout_ms = timeout_ms;
  s->tok = tok;
  s->max_conns = nodes + RDZV_EXTRA_CONNS;
  s->conns = calloc((size_t)s->max_conns, sizeof(*s->conns));
  s->slots = calloc((size_t)nodes, sizeof(*s->slots));
  s->wake[0] = s->wake[1] = -1;
  s->listen_fd = -1;
  if (!s->conns || !s->slots || pipe(s->wake) < 0) {
    snprintf(err, errlen, "out of memory or fds");
    goto fail;
  }
  for (int i = 0; i < s->max_conns; i++) s->conns[i].fd = -1;
  for (int j = 0; j < nodes; j++) s->slots[j].conn = -1;
  s->listen_fd = net_listen(&a, 64, err, errlen);
  if (s->listen_fd < 0) goto fail;
  pthread_mutex_init(&s->mu, NULL);
  if (pthread_create(&s->thread, NULL, serve, s) != 0) {
    snprintf(err, errlen, "cannot start its thread");
    goto fail;
  }
  *out = s;
  return 0;
fail:
  if (s->listen_fd >= 0) close(s->listen_fd);
  if (s->wake[0] >= 0) close(s->wake[0]), close(s->wake[1]);
  free(s->conns);
  free(s->slots);
  free(s);
  return -1;
}

void rdzv_server_stop(struct rdzv_server *s, int wait_ms) {
  if (!s) return;
  pthread_mutex_lock(&s->mu);
  s->stop_at_ms = clock_now_ms() + (uint64_t)(wait_ms > 0 ? wait_ms : 1);
  pthread_mutex_unlock(&s->mu);
  if (write(s->wake[1], "x", 1) < 0) { /* the thread wakes within 200 ms anyway */
  }
  pthread_join(s->thread, NULL);
  for (int i = 0; i < s->max_conns; i++)
    if (s->conns[i].fd >= 0) drop(s, i, NULL);
  for (int j = 0; j < s->nodes; j++) free(s->slots[j].shards), free(s->slots[j].peers);
  close(s->listen_fd);
  close(s->wake[0]);
  close(s->wake[1]);
  pthread_mutex_destroy(&s->mu);
  free(s->conns);
  free(s->slots);
  free(s);
}

/* ---- a node ---- */

struct rdzv_client {
  int fd, node, nodes;
  const struct auth_token *tok;
  char host[HOST_BYTES], service[300];
  uint8_t nonce[AUTH_NONCE_BYTES];
  struct rbuf in;
  uint64_t last_rx_ms, next_beat_ms;
  char *servers, *peers;
  bool have_table, ended;
};

int rdzv_connect(struct rdzv_client **out, const char *addr, int node, int nodes, int timeout_ms,
                 const struct auth_token *tok, char *host, size_t hostlen, char *err,
                 size_t errlen) {
  struct net_addr a;
  if (net_parse_addr(addr, &a, 0, err, errlen) < 0) return -1;
  struct net_backoff bo = {50, 1000, timeout_ms};
  char why[256];
  int fd = net_connect(&a, &bo, why, sizeof(why));
  if (fd < 0) {
    snprintf(err, errlen, "cannot reach the rendezvous at %s within %d s: %s", addr,
             timeout_ms / 1000, why);
    return -1;
  }
  struct rdzv_client *c = calloc(1, sizeof(*c));
  if (!c) {
    close(fd);
    return snprintf(err, errlen, "out of memory"), -1;
  }
  c->fd = fd;
  c->node = node;
  c->nodes = nodes;
  c->tok = tok;
  c->in.max = RDZV_MSG_MAX;
  snprintf(c->service, sizeof(c->service), "%s", addr);
  struct sockaddr_storage ss;
  socklen_t sl = sizeof(ss);
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0 && ss.ss_family == AF_INET)
    inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, c->host, sizeof(c->host));
  else
    snprintf(c->host, sizeof(c->host), "127.0.0.1");
  snprintf(host, hostlen, "%s", c->host);
  /* The nonce comes at once. */
  uint64_t deadline = clock_now_ms() + 5000;
  char *m = NULL;
  int r = 0;
  while (r == 0 && clock_now_ms() < deadline) {
    struct pollfd pf = {fd, POLLIN, 0};
    poll(&pf, 1, 200);
    if (rbuf_fill(fd, &c->in) < 0) break;
    r = rbuf_next(&c->in, &m);
  }
  if (r != 1 || strncmp(m, "NONCE ", 6) != 0 || from_hex(m + 6, c->nonce, sizeof(c->nonce)) < 0) {
    snprintf(err, errlen, "the rendezvous at %s sent no nonce: is it ps-local's?", addr);
    free(m);
    rdzv_close(c);
    return -1;
  }
  free(m);
  c->last_rx_ms = clock_now_ms();
  *out = c;
  return 0;
}

int rdzv_register(struct rdzv_client *c, const char *shards, const char *peers, char *err,
                  size_t errlen) {
  size_t cap = strlen(shards) + strlen(peers) + 200;
  char *body = malloc(cap);
  if (!body) return snprintf(err, errlen, "out of memory"), -1;
  snprintf(body, cap, "HELLO %d %d %s %s %s", c->node, c->nodes, c->host, shards[0] ? shards : "-",
           peers[0] ? peers : "-");
  char *m = with_proof(c->tok, AUTH_INITIATOR, body, c->nonce);
  free(body);
  int r = m && strlen(m) <= RDZV_HELLO_MAX ? send_msg(c->fd, m) : -1;
  free(m);
  if (r < 0) snprintf(err, errlen, "cannot register at the rendezvous at %s", c->service);
  return r;
}

int rdzv_fd(const struct rdzv_client *c) {
  return c->fd;
}

static int on_table(struct rdzv_client *c, char *msg, char *err, size_t errlen) {
  if (!check_proof(c->tok, AUTH_ACCEPTOR, msg, c->nonce)) {
    snprintf(err, errlen, "the rendezvous at %s sent a table without the job's token's proof",
             c->service);
    return -1;
  }
  char *sv = strtok(msg + 6, " "), *pr = sv ? strtok(NULL, " ") : NULL;
  if (!pr) return snprintf(err, errlen, "a malformed table from %s", c->service), -1;
  c->servers = strdup(strcmp(sv, "-") ? sv : "");
  c->peers = strdup(strcmp(pr, "-") ? pr : "");
  if (!c->servers || !c->peers) return snprintf(err, errlen, "out of memory"), -1;
  c->have_table = true;
  return 1;
}

int rdzv_poll(struct rdzv_client *c, char *err, size_t errlen) {
  if (c->ended) return 0;
  uint64_t now = clock_now_ms();
  if (now >= c->next_beat_ms) {
    if (send_msg(c->fd, "PING") == 0) c->next_beat_ms = now + RDZV_BEAT_MS;
  }
  bool eof = rbuf_fill(c->fd, &c->in) < 0;
  char *m;
  int r, ret = 0;
  while (ret == 0 && (r = rbuf_next(&c->in, &m)) == 1) {
    c->last_rx_ms = now;
    int node;
    char host[HOST_BYTES];
    int used = 0;
    if (strncmp(m, "TABLE ", 6) == 0 && !c->have_table) {
      ret = on_table(c, m, err, errlen);
    } else if (strncmp(m, "FAIL ", 5) == 0 &&
               sscanf(m, "FAIL %d %63s %n", &node, host, &used) == 2) {
      snprintf(err, errlen, "node %d (%s) failed: %s", node, host, m + used);
      ret = -1;
    } else if (strncmp(m, "ABORT ", 6) == 0) {
      snprintf(err, errlen, "%s", m + 6);
      ret = -1;
    }
    free(m);
  }
  if (ret == 0 && (eof || r < 0 || now - c->last_rx_ms > RDZV_LOST_MS)) {
    snprintf(err, errlen, "node 0 (the rendezvous at %s) failed: lost: %s", c->service,
             eof     ? "its connection closed"
             : r < 0 ? "a message over the size limit"
                     : "no heartbeat for 5 s");
    ret = -1;
  }
  if (ret < 0) c->ended = true;
  return ret;
}

void rdzv_table(const struct rdzv_client *c, const char **servers, const char **peers) {
  *servers = c->servers;
  *peers = c->peers;
}

void rdzv_fail(struct rdzv_client *c, const char *what) {
  char m[400];
  snprintf(m, sizeof(m), "FAIL %.300s", what);
  if (!c->ended) send_msg(c->fd, m);
  c->ended = true;
}

void rdzv_done(struct rdzv_client *c) {
  if (!c->ended) send_msg(c->fd, "DONE");
  c->ended = true;
}

void rdzv_close(struct rdzv_client *c) {
  if (!c) return;
  close(c->fd);
  free(c->in.buf);
  free(c->servers);
  free(c->peers);
  free(c);
}
