/* ucx_guard: refuses peers of a UCX listener that do not speak UCX's
 * connection protocol.
 *
 * Why it is needed. UCX 1.13's TCP connection manager (src/uct/tcp/
 * tcp_sockcm_ep.c) reads a client's first message as a header
 * {size_t length; u8 status} and then `length` bytes of private data into a
 * buffer of UCX_TCP_CM_PRIV_DATA_LEN (2 KiB) + 16. `length` is never checked
 * against that buffer: with random bytes it is huge, so once the buffer is
 * full uct_tcp_sockcm_ep_recv_nb asks recv() for 0 bytes, ucs_socket_do_io_nb
 * counts the 0 it returns as success (ucs/sys/sock.c: a 0-byte request), the
 * message is never complete, and the socket stays readable (the rest of the
 * bytes, or the peer's EOF, which a 0-byte recv never reports) under UCX's
 * level-triggered epoll: its async thread spins at 100% forever and the
 * socket is never closed (CLOSE-WAIT). Nothing reaches ucp's conn_handler,
 * so ucp_listener_reject cannot help, and no UCX_TCP_CM_* or UCX_SOCKADDR_*
 * setting bounds the length. Once 1,024 such sockets pile up, UCX's async
 * handler table is full and each new accept fails into a path that closes
 * the fd twice (tcp_listener.c: UCS_CLASS_DELETE closes it, then
 * ucs_close_fd again: "failed to close fd ...: Bad file descriptor"), which
 * can close another thread's fd. master has the same code.
 *
 * Why a watchdog and not a relay in front. A relay (our own listener that
 * validates the first message, then forwards to a UCX listener on an
 * internal port) would change what UCX sees of the connection: the server
 * takes the device for the connection's lanes from the accepted socket's
 * interface and the client's device address from getpeername()
 * (wireup_cm.c), so every client would look like the relay, and a remote
 * client's TCP lanes would be dialled at the shard's own address. So UCX
 * keeps its listener on the --listen address, and this thread watches the
 * sockets UCX accepted on it (/proc/self/fd, getsockname() == the listen
 * address) that ucp has not handed to us as a connection request:
 *   - one that stays unread (bytes queued, SIOCINQ > 0) or half-closed by
 *     its peer (CLOSE-WAIT) for STUCK_MS: UCX is not reading it, i.e. the
 *     loop above, or a peer that left;
 *   - one that sends nothing valid within IDLE_MS (a slow or silent peer
 *     that holds a slot of UCX's handler table).
 * Such a socket is disconnected with connect(AF_UNSPEC): the kernel sends
 * the peer a RST and sets the socket's error, UCX's epoll reports EPOLLERR,
 * and UCX itself closes its endpoint and fd (the error path of a server
 * endpoint before its connection request): nothing is closed twice and UCX
 * logs nothing above debug. The fd and the peer are checked again right
 * before, so a number UCX reused in between is not touched. Each refusal is
 * counted (uguard_take_refused) and logged once per peer address and
 * LOG_WINDOW_S with the number refused since. A garbage connection costs UCX
 * at most STUCK_MS + SCAN_MS of one core. */
#include "ucx_guard.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/ioctl.h>

#include "clock.h"
#include "log.h"

#define SCAN_MS 100
#define STUCK_MS 300
#define IDLE_MS 10000
#define FORGET_MS 5000
#define LOG_WINDOW_S 60
#define MAX_TRACK 4096
#define MAX_LOGGED 256

struct track { /* a socket seen on the listen port, not admitted */
  int fd;
  struct sockaddr_storage peer;
  uint64_t first, bad_since, scan;
};

struct known {
  struct sockaddr_storage peer;
  uint64_t forget_at; /* 0: connected */
};

struct logged {
  struct sockaddr_storage ip; /* port 0 */
  uint64_t until;
  uint64_t suppressed;
};

struct uguard {
  struct sockaddr_storage bound;
  pthread_t th;
  int stop_pipe[2];
  pthread_mutex_t mu; /* known, refused */
  struct known *known;
  size_t n_known, cap_known;
  uint64_t refused;
  struct track track[MAX_TRACK];
  size_t n_track;
  struct logged logged[MAX_LOGGED];
  size_t n_logged;
  uint64_t scan;
};

static uint16_t port_of(const struct sockaddr_storage *a) {
  return ntohs(a->ss_family == AF_INET6 ? ((const struct sockaddr_in6 *)a)->sin6_port
                                        : ((const struct sockaddr_in *)a)->sin_port);
}

static bool same_ip(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
  if (a->ss_family != b->ss_family) return false;
  if (a->ss_family == AF_INET)
    return ((const struct sockaddr_in *)a)->sin_addr.s_addr ==
           ((const struct sockaddr_in *)b)->sin_addr.s_addr;
  return !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                 &((const struct sockaddr_in6 *)b)->sin6_addr, sizeof(struct in6_addr));
}

static bool same_addr(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
  return same_ip(a, b) && port_of(a) == port_of(b);
}

static bool is_any(const struct sockaddr_storage *a) {
  if (a->ss_family == AF_INET)
    return ((const struct sockaddr_in *)a)->sin_addr.s_addr == htonl(INADDR_ANY);
  return a->ss_family == AF_INET6 &&
         IN6_IS_ADDR_UNSPECIFIED(&((const struct sockaddr_in6 *)a)->sin6_addr);
}

static void addr_str(const struct sockaddr_storage *a, char *buf, size_t len, bool with_port) {
  char ip[INET6_ADDRSTRLEN] = "?";
  if (a->ss_family == AF_INET)
    inet_ntop(AF_INET, &((const struct sockaddr_in *)a)->sin_addr, ip, sizeof(ip));
  else if (a->ss_family == AF_INET6)
    inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)a)->sin6_addr, ip, sizeof(ip));
  if (with_port)
    snprintf(buf, len, "%s:%u", ip, (unsigned)port_of(a));
  else
    snprintf(buf, len, "%s", ip);
}

static bool is_known(struct uguard *g, const struct sockaddr_storage *peer, uint64_t now) {
  bool k = false;
  pthread_mutex_lock(&g->mu);
  for (size_t i = 0; i < g->n_known;) {
    struct known *e = &g->known[i];
    if (e->forget_at && e->forget_at <= now) { /* gone: dropped */
      *e = g->known[--g->n_known];
      continue;
    }
    if (same_addr(&e->peer, peer)) k = true;
    i++;
  }
  pthread_mutex_unlock(&g->mu);
  return k;
}

/* Logs the refusal of peer once per IP and window. */
static void log_refusal(struct uguard *g, const struct sockaddr_storage *peer, const char *why) {
  uint64_t now = clock_now_ns();
  struct logged *l = NULL;
  for (size_t i = 0; i < g->n_logged && !l; i++)
    if (same_ip(&g->logged[i].ip, peer)) l = &g->logged[i];
  if (l && l->until > now) {
    l->suppressed++;
    return;
  }
  if (!l) {
    size_t i = g->n_logged < MAX_LOGGED ? g->n_logged++ : 0;
    for (size_t j = 0; j < g->n_logged; j++) /* full: reuse the oldest */
      if (g->logged[j].until < g->logged[i].until) i = j;
    l = &g->logged[i];
    l->ip = *peer;
    l->suppressed = 0;
  }
  char p[64], b[64];
  addr_str(peer, p, sizeof(p), true);
  addr_str(&g->bound, b, sizeof(b), true);
  log_warn("ucx listener refused a peer",
           "peer=%s listen=%s reason=\"%s\" refused_since_last_log=%" PRIu64
           " note=\"not UCX's connection protocol; logged once per address every %d s\"",
           p, b, why, l->suppressed + 1, LOG_WINDOW_S);
  l->suppressed = 0;
  l->until = now + (uint64_t)LOG_WINDOW_S * 1000000000u;
}

static struct track *track_of(struct uguard *g, int fd, const struct sockaddr_storage *peer,
                              uint64_t now) {
  for (size_t i = 0; i < g->n_track; i++)
    if (g->track[i].fd == fd && same_addr(&g->track[i].peer, peer)) return &g->track[i];
  if (g->n_track == MAX_TRACK) return NULL;
  struct track *t = &g->track[g->n_track++];
  *t = (struct track){.fd = fd, .peer = *peer, .first = now};
  return t;
}

/* fd is a socket UCX accepted on the listen address: returns its peer. */
static bool accepted_here(struct uguard *g, int fd, struct sockaddr_storage *peer) {
  struct sockaddr_storage local;
  socklen_t len = sizeof(local);
  int listening = 0;
  socklen_t ll = sizeof(listening);
  if (getsockname(fd, (struct sockaddr *)&local, &len) < 0) return false;
  if (local.ss_family != g->bound.ss_family || port_of(&local) != port_of(&g->bound)) return false;
  if (!is_any(&g->bound) && !same_ip(&local, &g->bound)) return false;
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &ll) < 0 || listening) return false;
  len = sizeof(*peer);
  return getpeername(fd, (struct sockaddr *)peer, &len) == 0 ||
         errno == ENOTCONN; /* reset meanwhile: still UCX's to close */
}

static void refuse(struct uguard *g, struct track *t, const char *why) {
  struct sockaddr_storage peer;
  if (!accepted_here(g, t->fd, &peer) || !same_addr(&peer, &t->peer)) return; /* fd reused */
  struct sockaddr unspec = {.sa_family = AF_UNSPEC};
  if (connect(t->fd, &unspec, sizeof(unspec)) < 0) return;
  pthread_mutex_lock(&g->mu);
  g->refused++;
  pthread_mutex_unlock(&g->mu);
  log_refusal(g, &t->peer, why);
  t->first = t->bad_since = UINT64_MAX; /* once: UCX closes it now */
}

static void scan(struct uguard *g) {
  uint64_t now = clock_now_ns();
  g->scan++;
  DIR *d = opendir("/proc/self/fd");
  if (!d) return;
  int own = dirfd(d);
  for (struct dirent *de; (de = readdir(d));) {
    char link[64];
    int fd = atoi(de->d_name);
    if (de->d_name[0] < '0' || de->d_name[0] > '9' || fd == own || fd == g->stop_pipe[0]) continue;
    ssize_t n = readlinkat(own, de->d_name, link, sizeof(link) - 1);
    if (n < 8 || strncmp(link, "socket:", 7)) continue;
    struct sockaddr_storage peer;
    if (!accepted_here(g, fd, &peer) || is_known(g, &peer, now)) continue;
    struct track *t = track_of(g, fd, &peer, now);
    if (!t) continue;
    t->scan = g->scan;
    if (t->first == UINT64_MAX) continue; /* refused already */
    struct tcp_info ti;
    socklen_t tl = sizeof(ti);
    int inq = 0;
    bool closed =
        getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &tl) == 0 && ti.tcpi_state == TCP_CLOSE_WAIT;
    bool unread = ioctl(fd, SIOCINQ, &inq) == 0 && inq > 0;
    if (closed || unread) {
      if (!t->bad_since)
        t->bad_since = now;
      else if (now - t->bad_since >= STUCK_MS * 1000000ull)
        refuse(g, t,
               unread ? "UCX left its bytes unread (not a UCX connection request)"
                      : "closed before a valid UCX connection request");
    } else {
      t->bad_since = 0;
      if (now - t->first >= IDLE_MS * 1000000ull)
        refuse(g, t, "no valid UCX connection request within 10 s");
    }
  }
  closedir(d);
  for (size_t i = 0; i < g->n_track;) /* sockets gone: forgotten */
    if (g->track[i].scan != g->scan)
      g->track[i] = g->track[--g->n_track];
    else
      i++;
}

static void *guard_main(void *arg) {
  struct uguard *g = arg;
  struct pollfd p = {.fd = g->stop_pipe[0], .events = POLLIN};
  while (poll(&p, 1, SCAN_MS) == 0) scan(g);
  return NULL;
}

int uguard_start(const struct sockaddr_storage *bound, struct uguard **out) {
  *out = NULL;
  struct uguard *g = calloc(1, sizeof(*g));
  if (!g) return -ENOMEM;
  g->bound = *bound;
  if (pipe2(g->stop_pipe, O_CLOEXEC) < 0) {
    int e = -errno;
    free(g);
    return e;
  }
  pthread_mutex_init(&g->mu, NULL);
  int r = pthread_create(&g->th, NULL, guard_main, g);
  if (r != 0) {
    close(g->stop_pipe[0]);
    close(g->stop_pipe[1]);
    pthread_mutex_destroy(&g->mu);
    free(g);
    return -r;
  }
  *out = g;
  return 0;
}

void uguard_stop(struct uguard *g) {
  if (!g) return;
  (void)!write(g->stop_pipe[1], "x", 1);
  pthread_join(g->th, NULL);
  close(g->stop_pipe[0]);
  close(g->stop_pipe[1]);
  pthread_mutex_destroy(&g->mu);
  free(g->known);
  free(g);
}

void uguard_admit(struct uguard *g, const struct sockaddr_storage *peer) {
  if (!g) return;
  pthread_mutex_lock(&g->mu);
  if (g->n_known == g->cap_known) {
    size_t cap = g->cap_known ? 2 * g->cap_known : 16;
    struct known *k = realloc(g->known, cap * sizeof(*k));
    if (!k) goto out; /* unknown: at worst refused after IDLE_MS */
    g->known = k;
    g->cap_known = cap;
  }
  g->known[g->n_known++] = (struct known){.peer = *peer};
out:
  pthread_mutex_unlock(&g->mu);
}

void uguard_forget(struct uguard *g, const struct sockaddr_storage *peer) {
  if (!g) return;
  pthread_mutex_lock(&g->mu);
  for (size_t i = 0; i < g->n_known; i++)
    if (!g->known[i].forget_at && same_addr(&g->known[i].peer, peer)) {
      g->known[i].forget_at = clock_now_ns() + FORGET_MS * 1000000ull;
      break;
    }
  pthread_mutex_unlock(&g->mu);
}

uint64_t uguard_take_refused(struct uguard *g) {
  if (!g) return 0;
  pthread_mutex_lock(&g->mu);
  uint64_t n = g->refused;
  g->refused = 0;
  pthread_mutex_unlock(&g->mu);
  return n;
}
