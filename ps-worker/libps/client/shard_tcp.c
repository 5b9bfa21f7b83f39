/* shard_tcp: libps's connection to one shard over TCP (--transport tcp, the
 * default), one struct shard_transport_ops (client_impl.h) for shard.c.
 *
 * One blocking socket per shard, in struct shard_tcp at sh->tp. Callers
 * write their own frames on it under the shard's send mutex
 * (wire_send_frame: preamble, header and payload in one writev, then the
 * tag); the receiver thread reads replies with recv, straight into the
 * caller's buffer when a large pull payload is being read (the decoder's
 * window), else through sh->rbuf. The socket is published under c->mu so
 * that ps_client_free can shut it down, which is how the receiver thread
 * is woken for good. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include "client_impl.h"
#include "frame.h"
#include "net.h"
#include "wire_send.h"

struct shard_tcp {
  int fd; /* replaced only under send_mu, published under c->mu */
};

static struct shard_tcp *tcp_of(const struct shard *sh) {
  return sh->tp;
}

static int tcp_init(struct shard *sh, char *err, size_t errlen) {
  (void)err;
  (void)errlen;
  struct shard_tcp *t = malloc(sizeof(*t));
  if (!t) return -ENOMEM;
  t->fd = -1;
  sh->tp = t;
  return 0;
}

static void tcp_deinit(struct shard *sh) {
  struct shard_tcp *t = tcp_of(sh);
  if (t->fd >= 0) close(t->fd);
  free(t);
  sh->tp = NULL;
}

static int tcp_connect(struct shard *sh, char *err, size_t errlen) {
  struct shard_tcp *t = tcp_of(sh);
  struct net_backoff once = {0, 0, 0};
  int fd = net_connect(&sh->addr, &once, err, errlen);
  if (fd < 0) return fd;
  /* a shard that vanished without FIN/RST (node lost, partition) is
   * noticed in bounded time, not when the kernel gives up after ~15 min */
  net_set_keepalive(fd, 30, 10, 3);
  net_set_user_timeout(fd, 60000);
  pthread_mutex_lock(&sh->c->mu); /* published for ps_client_free's shutdown */
  t->fd = fd;
  pthread_mutex_unlock(&sh->c->mu);
  return 0;
}

static void tcp_disconnect(struct shard *sh) {
  struct shard_tcp *t = tcp_of(sh);
  if (t->fd >= 0) close(t->fd);
  t->fd = -1;
}

static bool tcp_connected(const struct shard *sh) {
  return tcp_of(sh)->fd >= 0;
}

static int64_t tcp_send(struct shard *sh, const Ps__Header *h, const void *payload, uint64_t plen) {
  return wire_send_frame(tcp_of(sh)->fd, h, payload, plen, sh->sess, sh->sbuf, SHARD_HDR_BUF_BYTES);
}

/* A byte stream: the reply's bounds are the caller's to know. */
static int tcp_read_sync(struct shard *sh, void *buf, size_t len, unsigned flags) {
  (void)flags;
  return net_read_all(tcp_of(sh)->fd, buf, len);
}

/* Reads and dispatches replies until the socket fails (ps_client_free
 * shuts it down to stop us) and returns that negative errno. */
static int tcp_rx_run(struct shard *sh) {
  int fd = tcp_of(sh)->fd;
  for (;;) {
    uint8_t *win;
    size_t want = frame_decoder_payload_window(&sh->dec, &win);
    bool direct = want >= 16384;
    ssize_t n = recv(fd, direct ? win : sh->rbuf, direct ? want : SHARD_RX_BUF_BYTES, 0);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return n == 0 ? -ECONNRESET : -errno;
    }
    atomic_fetch_add_explicit(&sh->c->bytes_received, (uint64_t)n, memory_order_relaxed);
    int e = direct ? shard_rx_advance(sh, (size_t)n) : shard_rx_feed(sh, sh->rbuf, (size_t)n);
    if (e < 0) return e;
  }
}

static void tcp_shutdown(struct shard *sh) {
  struct shard_tcp *t = tcp_of(sh);
  if (t->fd >= 0) shutdown(t->fd, SHUT_RDWR);
}

/* While corked the kernel holds back partial segments, so the frames of a
 * batch leave as full segments and the shard wakes once for many of them;
 * uncorking sends what is held. Errors are ignored: at worst frames leave
 * one by one, as without it. */
static void tcp_cork(struct shard *sh, bool on) {
  int v = on ? 1 : 0;
  int fd = tcp_of(sh)->fd;
  if (fd >= 0) (void)setsockopt(fd, IPPROTO_TCP, TCP_CORK, &v, sizeof(v));
}

const struct shard_transport_ops shard_tcp_ops = {
    .name = "tcp",
    .init = tcp_init,
    .deinit = tcp_deinit,
    .connect = tcp_connect,
    .disconnect = tcp_disconnect,
    .connected = tcp_connected,
    .send = tcp_send,
    .read_sync = tcp_read_sync,
    .rx_run = tcp_rx_run,
    .shutdown = tcp_shutdown,
    .cork = tcp_cork,
};
