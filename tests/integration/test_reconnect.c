/* A resend after reconnect is recognised and not applied twice.
 *
 * The worker talks to the shard through a small proxy in this test. Armed,
 * the proxy forwards the worker's next push to the shard, swallows the
 * shard's ACK and cuts both connections, so the worker cannot know whether
 * the push was applied. The worker reconnects, resends the same
 * (rank, step, key), the shard answers "duplicate", and the parameters show
 * the update applied exactly once.
 *
 * With PS_TRANSPORT=ucx (the UCX variants, meson.build) the proxy is the
 * same at the level of frames: it takes the worker's UCX connection,
 * forwards each active message, payload included, to the shard over its
 * own UCX connection and back, and cuts both the same way. */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <stdlib.h>

#include "harness.h"
#include "net.h"
#include "ps.h"
#include "ucx_link.h"

#define N 100000 /* several chunks with 64 KiB chunk_bytes */
static struct test_server srv;
static int listen_fd;
static atomic_int armed, cuts, accepted;

static void *proxy_main(void *arg) {
  (void)arg;
  struct net_addr a;
  char err[128];
  net_parse_addr(srv.addr, &a, 0, err, sizeof(err));
  for (;;) {
    int cfd = accept(listen_fd, NULL, NULL);
    if (cfd < 0) return NULL;
    atomic_fetch_add(&accepted, 1);
    struct net_backoff bo = {10, 100, 2000};
    int sfd = net_connect(&a, &bo, err, sizeof(err));
    if (sfd < 0) {
      close(cfd);
      continue;
    }
    static char buf[1 << 16];
    bool sent_up = false;
    for (;;) {
      struct pollfd p[2] = {{cfd, POLLIN, 0}, {sfd, POLLIN, 0}};
      if (poll(p, 2, -1) < 0) break;
      if (p[0].revents) {
        ssize_t n = recv(cfd, buf, sizeof(buf), 0);
        if (n <= 0 || net_write_all(sfd, buf, (size_t)n) < 0) break;
        if (atomic_load(&armed)) sent_up = true;
      }
      if (p[1].revents) {
        ssize_t n = recv(sfd, buf, sizeof(buf), 0);
        if (n <= 0) break;
        if (sent_up) { /* the shard answered the armed push: drop it and cut */
          atomic_store(&armed, 0);
          atomic_fetch_add(&cuts, 1);
          break;
        }
        if (net_write_all(cfd, buf, (size_t)n) < 0) break;
      }
    }
    close(cfd);
    close(sfd);
  }
}

/* ---- the UCX proxy ---- */

/* A frame on its way through: forwarded in arrival order once its payload
 * is in. */
struct fwd {
  struct fwd *next;
  struct ulink_ep *to;
  uint8_t *buf;
  uint64_t len;
  atomic_bool in;
  uint32_t head_len;
  uint8_t head[1024];
};
static struct ulink *ux;
static struct ulink_ep *down, *up; /* the worker's connection, ours to the shard */
static bool sent_up;
static struct fwd *fq_head, *fq_tail;

static void fwd_sent(void *arg, int status) {
  (void)status;
  struct fwd *f = arg;
  free(f->buf);
  free(f);
}

static void fwd_in(void *arg, int status) {
  (void)status;
  atomic_store(&((struct fwd *)arg)->in, true);
}

static void cut(void) {
  if (down) ulink_ep_close(down, false);
  if (up) ulink_ep_close(up, false);
  down = up = NULL;
  sent_up = false;
  for (struct fwd *f = fq_head; f; f = f->next) f->to = NULL; /* dropped when in */
}

static void fwd_pump(void) {
  while (fq_head && atomic_load(&fq_head->in)) {
    struct fwd *f = fq_head;
    fq_head = f->next;
    if (!fq_head) fq_tail = NULL;
    if (!f->to || ulink_send(f->to, f->head, f->head_len, f->buf, f->len, fwd_sent, f) < 0) {
      free(f->buf);
      free(f);
    }
  }
}

static void ux_rx(struct ulink_rx *rx, void *arg) {
  (void)arg;
  bool from_worker = rx->ep == down;
  if ((!from_worker && rx->ep != up) || rx->head_len > sizeof(((struct fwd *)0)->head)) {
    ulink_rx_free(ux, rx);
    return;
  }
  if (!from_worker && sent_up) { /* the shard answered the armed push: drop it and cut */
    ulink_rx_free(ux, rx);
    atomic_store(&armed, 0);
    atomic_fetch_add(&cuts, 1);
    cut();
    return;
  }
  if (from_worker && atomic_load(&armed)) sent_up = true;
  struct fwd *f = calloc(1, sizeof(*f));
  REQUIRE(f && (!rx->len || (f->buf = malloc(rx->len))), "proxy: no memory");
  f->to = from_worker ? up : down;
  f->len = rx->len;
  f->head_len = rx->head_len;
  memcpy(f->head, rx->head, rx->head_len);
  if (fq_tail)
    fq_tail->next = f;
  else
    fq_head = f;
  fq_tail = f;
  if (!rx->len) {
    ulink_rx_free(ux, rx);
    atomic_store(&f->in, true);
  } else {
    REQUIRE(ulink_rx_take(ux, rx, f->buf, fwd_in, f) == 0, "proxy: take");
  }
  fwd_pump();
}

static void ux_conn(struct ulink_ep *ep, const char *peer, void *arg) {
  (void)peer;
  (void)arg;
  cut(); /* one worker connection at a time */
  atomic_fetch_add(&accepted, 1);
  struct net_addr a;
  char err[200];
  REQUIRE(net_parse_addr(srv.addr, &a, 0, err, sizeof(err)) == 0, "addr");
  down = ep;
  REQUIRE(ulink_connect(ux, a.host, a.port, &up, err, sizeof(err)) == 0, "proxy: %s", err);
}

static void ux_error(struct ulink_ep *ep, const char *why, void *arg) {
  (void)why;
  (void)arg;
  if (ep == down || ep == up) cut();
}

static void *ucx_proxy_main(void *arg) {
  (void)arg;
  for (;;) {
    ulink_progress(ux);
    fwd_pump();
    if (!ulink_arm(ux)) continue;
    struct pollfd p = {ulink_efd(ux), POLLIN, 0};
    poll(&p, 1, 50);
  }
  return NULL;
}

/* Listens for the worker on a free port of 127.0.0.1 (proxy_addr). */
static void start_ucx_proxy(char *proxy_addr, size_t len) {
  struct ulink_cbs cbs = {.on_rx = ux_rx, .on_conn = ux_conn, .on_error = ux_error};
  char err[256];
  uint16_t port = 0;
  REQUIRE(ulink_new(false, &cbs, &ux, err, sizeof(err)) == 0, "proxy: %s", err);
  REQUIRE(ulink_listen(ux, "127.0.0.1", 0, &port, err, sizeof(err)) == 0, "proxy: %s", err);
  snprintf(proxy_addr, len, "127.0.0.1:%u", (unsigned)port);
  pthread_t th;
  pthread_create(&th, NULL, ucx_proxy_main, NULL);
}

int main(void) {
  harness_start_server(&srv, 0, 1, 1, 1.0, NULL);
  const char *tr = getenv("PS_TRANSPORT");
  char proxy_addr[64];
  if (tr && strcmp(tr, "ucx") == 0) {
    start_ucx_proxy(proxy_addr, sizeof(proxy_addr));
    goto run;
  }
  listen_fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t sl = sizeof(sa);
  REQUIRE(bind(listen_fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 && listen(listen_fd, 8) == 0 &&
              getsockname(listen_fd, (struct sockaddr *)&sa, &sl) == 0,
          "proxy listen");
  snprintf(proxy_addr, sizeof(proxy_addr), "127.0.0.1:%d", ntohs(sa.sin_port));
  pthread_t th;
  pthread_create(&th, NULL, proxy_main, NULL);
run:;

  const char *addrs[1] = {proxy_addr};
  struct ps_client_opts o = {
      .servers = addrs, .num_servers = 1, .rank = 0, .world_size = 1, .chunk_bytes = 65536};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "connect: %s", err);
  const char *names[] = {"w"};
  uint64_t counts[] = {N};
  REQUIRE(ps_declare(c, 1, names, counts) == PS_OK, "declare");
  static float p[N], g[N];
  for (int i = 0; i < N; i++) p[i] = 0, g[i] = 1.0f;
  REQUIRE(ps_init(c, 0, p) == PS_OK, "init");

  const int steps = 5;
  for (uint64_t s = 0; s < (uint64_t)steps; s++) {
    uint64_t v;
    REQUIRE(ps_pull(c, 0, s, p, &v) == PS_OK && v == s, "pull %llu", (unsigned long long)s);
    for (int i = 0; i < N; i++)
      REQUIRE(p[i] == -(float)s, "p[%d]=%g at step %llu", i, p[i], (unsigned long long)s);
    if (s == 2 || s == 3) atomic_store(&armed, 1); /* cut while this push is in flight */
    ps_status st = ps_push(c, 0, s, g);
    REQUIRE(st == PS_OK, "push %llu: %s", (unsigned long long)s, ps_strerror(st));
  }
  uint64_t v;
  REQUIRE(ps_pull(c, 0, steps, p, &v) == PS_OK && v == (uint64_t)steps, "final pull");
  for (int i = 0; i < N; i++) REQUIRE(p[i] == -(float)steps, "final p[%d]=%g", i, p[i]);
  struct ps_shard_stats st;
  REQUIRE(ps_stats(c, 0, &st) == PS_OK, "stats");
  REQUIRE(atomic_load(&cuts) == 2 && atomic_load(&accepted) >= 3, "cuts %d accepted %d",
          atomic_load(&cuts), atomic_load(&accepted));
  REQUIRE(st.duplicates >= 2, "shard saw %llu duplicates", (unsigned long long)st.duplicates);
  REQUIRE(st.updates == (uint64_t)steps * st.num_keys, "updates %llu for %u keys",
          (unsigned long long)st.updates, st.num_keys);
  ps_client_free(c);
  int status = harness_stop(srv.pid, SIGTERM, 5000);
  REQUIRE(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "shard exit");
  printf("2 connections cut mid-push: %llu resends recognised, each update applied once\n",
         (unsigned long long)st.duplicates);
  return 0;
}
