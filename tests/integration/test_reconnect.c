/* A resend after reconnect is recognised and not applied twice.
 *
 * The worker talks to the shard through a small proxy in this test. Armed,
 * the proxy forwards the worker's next push to the shard, swallows the
 * shard's ACK and cuts both connections, so the worker cannot know whether
 * the push was applied. The worker reconnects, resends the same
 * (rank, step, key), the shard answers "duplicate", and the parameters show
 * the update applied exactly once. With PS_TEST_OWNERS set the layout names
 * the tensor's owner (ps_declare_owned): the same holds per key.
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
#include "ucx_proxy.h"

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

/* ---- the UCX proxy's hook ---- */

/* Armed, the worker's next frame goes up and the shard's answer to it is
 * dropped, cutting both connections. */
static bool ux_sent_up;
static enum ucx_proxy_verdict ux_hook(bool up, uint8_t *head, uint32_t head_len, uint8_t *payload,
                                      uint64_t len, void *arg) {
  (void)head, (void)head_len, (void)payload, (void)len, (void)arg;
  if (up) {
    if (atomic_load(&armed)) ux_sent_up = true;
    return UCX_PROXY_FORWARD;
  }
  if (!ux_sent_up) return UCX_PROXY_FORWARD;
  ux_sent_up = false;
  atomic_store(&armed, 0);
  atomic_fetch_add(&cuts, 1);
  return UCX_PROXY_CUT;
}

int main(void) {
  harness_start_server(&srv, 0, 1, 1, 1.0, NULL);
  const char *tr = getenv("PS_TRANSPORT");
  char proxy_addr[64];
  if (tr && strcmp(tr, "ucx") == 0) {
    ucx_proxy_start(srv.addr, ux_hook, NULL, proxy_addr, sizeof(proxy_addr));
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
  /* PS_TEST_OWNERS (test reconnect_owners): the tensor names its owner,
   * so the shard's duplicate check runs on a key with an owner set */
  static const int me[] = {0}, *const owners[] = {me}, num_owners[] = {1};
  if (getenv("PS_TEST_OWNERS"))
    REQUIRE(ps_declare_owned(c, 1, names, counts, owners, num_owners) == PS_OK, "declare owned");
  else
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
  if (tr && strcmp(tr, "ucx") == 0) atomic_store(&accepted, ucx_proxy_accepted());
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
