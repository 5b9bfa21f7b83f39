/* conn_tcp: the shard's connections over TCP (--transport tcp), behind
 * struct conn_transport_ops (server_impl.h); conn.c owns everything else
 * about a connection (its states, decoder, limits, tags, output queue).
 *
 * A listener accepts into a struct conn_tcp, which begins with its struct
 * conn and holds the libuv handle, the read buffer and whether the last read
 * went straight into the decoder's payload window (a large payload is read in
 * place, never copied). conn.c's output queue leaves as one uv_write per
 * connection and loop iteration (tcp_write), a batch living until its write
 * callback; a large payload on an authenticated connection is tagged and
 * written piece by piece instead (tcp_write_pieces). Closing after the last
 * replies shuts the socket down first; the memory is freed in the close
 * callback. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "listener.h"
#include "log.h"
#include "net.h"
#include "server_impl.h"

/* A TCP connection: conn.c's part first (conn_new allocates conn_size). */
struct conn_tcp {
  struct conn c;
  uv_tcp_t tcp;
  uv_shutdown_t shutdown_req;
  uint8_t *rbuf; /* READ_BUF_BYTES: reads that do not go to the payload window */
  bool direct;   /* the last on_alloc handed out the payload window */
};

/* The shard's listener (server.tp_state). Its memory outlives the loop. */
struct tcp_shard {
  struct server *s;
  uv_tcp_t listener;
  bool listening; /* listener open */
};

/* One uv_write of every reply a connection queued in a loop iteration; it
 * and its messages live until the write callback. */
struct out_batch {
  uv_write_t req;
  struct conn *c;
  struct out_msg *head; /* freed once written (may be NULL) */
  struct vbuf *pin;     /* a piece of a payload: referenced until written (may be NULL) */
};

static struct conn_tcp *tcp_of(struct conn *c) {
  return container_of(c, struct conn_tcp, c);
}

static const struct conn_tcp *tcp_of_const(const struct conn *c) {
  return container_of(c, const struct conn_tcp, c);
}

/* ---- writing ------------------------------------------------------------ */

/* A batch's bytes are no longer queued: conn.c resumes a paused client. */
static void on_write(uv_write_t *req, int status) {
  struct out_batch *b = container_of(req, struct out_batch, req);
  struct conn *c = b->c;
  (void)status; /* a failed write shows up as a read error on the same socket */
  for (struct out_msg *m = b->head, *next; m; m = next) {
    next = m->next;
    conn_out_done(c, m);
  }
  vbuf_unref(b->pin);
  free(b);
  conn_read_resume(c);
}

/* Hands the queued replies to libuv in one uv_write. */
static void tcp_write(struct conn *c, struct out_msg *head) {
  unsigned n = 0;
  for (struct out_msg *m = head; m; m = m->next) n += 1u + (m->vb != NULL) + (c->sess != NULL);
  uv_buf_t small[48], *bufs = n <= 48 ? small : malloc(n * sizeof(*bufs));
  struct out_batch *b = malloc(sizeof(*b));
  if (!b || !bufs) goto fail;
  b->c = c;
  b->head = head;
  b->pin = NULL;
  unsigned k = 0;
  for (struct out_msg *m = head; m; m = m->next) {
    uint64_t plen = m->vb ? m->vb->count * sizeof(float) : 0;
    bufs[k++] = uv_buf_init((char *)m->hdr, m->hdr_len);
    if (m->vb) bufs[k++] = uv_buf_init((char *)m->vb->data, (unsigned)plen);
    if (c->sess) bufs[k++] = uv_buf_init((char *)m->tag, AUTH_TAG_BYTES);
  }
  int r = uv_write(&b->req, (uv_stream_t *)&tcp_of(c)->tcp, bufs, k, on_write);
  if (bufs != small) free(bufs);
  if (r < 0) {
    free(b);
    goto drop;
  }
  return;
fail:
  if (bufs != small) free(bufs);
  free(b);
drop: /* the stream has lost replies: the client must not go on with it */
  for (struct out_msg *m = head, *next; m; m = next) {
    next = m->next;
    conn_out_done(c, m);
  }
  conn_doom(c, "cannot write replies", 0);
}

/* Hands bufs to libuv as one write that pins vb (may be NULL) and frees m
 * (may be NULL) once written. Returns 0 or a negative errno. */
static int write_piece(struct conn *c, uv_buf_t *bufs, unsigned n, struct vbuf *vb,
                       struct out_msg *m) {
  struct out_batch *b = malloc(sizeof(*b));
  if (!b) return -ENOMEM;
  b->c = c;
  b->head = m;
  b->pin = vb ? vbuf_ref(vb) : NULL;
  int r = uv_write(&b->req, (uv_stream_t *)&tcp_of(c)->tcp, bufs, n, on_write);
  if (r < 0) {
    vbuf_unref(b->pin);
    free(b);
  }
  return r;
}

/* A large payload on an authenticated connection is tagged and handed to
 * libuv piece by piece rather than tagged whole and then written: libuv
 * writes a piece at once when the socket takes it, so the peer receives and
 * checks piece i while this side tags piece i+1, and the kernel copies each
 * piece while the tag pass left it in cache. Earlier queued replies go
 * first, so the stream (and the tag counter) keeps their order. */
static int tcp_write_pieces(struct conn *c, struct out_msg *m, uint64_t plen) {
  conn_flush(c);
  if (c->doomed || uv_is_closing((uv_handle_t *)&tcp_of(c)->tcp)) return -EPIPE;
  const uint8_t *p = (const uint8_t *)m->vb->data;
  if (auth_tx_begin(c->sess) < 0 || auth_tx_update(c->sess, m->hdr, m->hdr_len) < 0) return -EIO;
  for (uint64_t off = 0; off < plen; off += SEAL_PIECE_BYTES) {
    uint64_t len = plen - off < SEAL_PIECE_BYTES ? plen - off : SEAL_PIECE_BYTES;
    uv_buf_t bufs[2];
    unsigned n = 0;
    if (off == 0) bufs[n++] = uv_buf_init((char *)m->hdr, m->hdr_len);
    bufs[n++] = uv_buf_init((char *)p + off, (unsigned)len);
    if (auth_tx_update(c->sess, p + off, len) < 0 || write_piece(c, bufs, n, m->vb, NULL) < 0)
      return -EIO;
  }
  if (auth_tx_finish(c->sess, m->tag) < 0) return -EIO;
  uv_buf_t tag = uv_buf_init((char *)m->tag, AUTH_TAG_BYTES);
  return write_piece(c, &tag, 1, NULL, m) < 0 ? -EIO : 0;
}

/* ---- reading ------------------------------------------------------------ */

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf) {
  struct conn_tcp *t = container_of((uv_tcp_t *)handle, struct conn_tcp, tcp);
  (void)suggested;
  uint8_t *dst;
  size_t n = frame_decoder_payload_window(&t->c.dec, &dst);
  t->direct = n >= DIRECT_READ_MIN;
  if (t->direct)
    *buf = uv_buf_init((char *)dst, n > UINT32_MAX ? UINT32_MAX : (unsigned)n);
  else
    *buf = uv_buf_init((char *)t->rbuf, READ_BUF_BYTES);
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf) {
  struct conn_tcp *t = container_of((uv_tcp_t *)stream, struct conn_tcp, tcp);
  struct conn *c = &t->c;
  if (nread < 0) {
    if (nread != UV_EOF)
      log_info("connection lost", "peer=%s error=%s", c->peer, uv_strerror((int)nread));
    else if (c->has_rank)
      log_info("worker disconnected", "peer=%s rank=%" PRIu32, c->peer, c->rank);
    conn_close(c, false);
    return;
  }
  if (t->direct)
    conn_feed_direct(c, (size_t)nread);
  else
    conn_feed(c, (const uint8_t *)buf->base, (size_t)nread);
}

static void tcp_read_stop(struct conn *c) {
  uv_read_stop((uv_stream_t *)&tcp_of(c)->tcp);
}

static void tcp_read_start(struct conn *c) {
  uv_read_start((uv_stream_t *)&tcp_of(c)->tcp, on_alloc, on_read);
}

/* ---- lifetime ----------------------------------------------------------- */

static int tcp_init(struct conn *c) {
  return (tcp_of(c)->rbuf = malloc(READ_BUF_BYTES)) ? 0 : -ENOMEM;
}

static void tcp_deinit(struct conn *c) {
  free(tcp_of(c)->rbuf);
}

static bool tcp_gone(const struct conn *c) {
  return uv_is_closing((const uv_handle_t *)&tcp_of_const(c)->tcp);
}

static void on_close(uv_handle_t *handle) {
  conn_free(&container_of((uv_tcp_t *)handle, struct conn_tcp, tcp)->c);
}

static void on_shutdown(uv_shutdown_t *req, int status) {
  struct conn_tcp *t = container_of(req, struct conn_tcp, shutdown_req);
  (void)status;
  if (!uv_is_closing((uv_handle_t *)&t->tcp)) uv_close((uv_handle_t *)&t->tcp, on_close);
}

static void tcp_close(struct conn *c, bool flush) {
  struct conn_tcp *t = tcp_of(c);
  if (!flush || uv_shutdown(&t->shutdown_req, (uv_stream_t *)&t->tcp, on_shutdown) < 0)
    uv_close((uv_handle_t *)&t->tcp, on_close);
}

static void tcp_describe(const struct conn *c, char *buf, size_t len) {
  (void)c;
  snprintf(buf, len, "tcp");
}

/* ---- the listener ------------------------------------------------------- */

/* "ip:port" of the peer into c->peer ("?" when unknown). */
static void name_peer(struct conn_tcp *t) {
  struct sockaddr_storage ss;
  int len = sizeof(ss);
  if (uv_tcp_getpeername(&t->tcp, (struct sockaddr *)&ss, &len) != 0) return;
  char ip[INET6_ADDRSTRLEN] = "";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    struct sockaddr_in *a = (struct sockaddr_in *)&ss;
    uv_ip4_name(a, ip, sizeof(ip));
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
    uv_ip6_name(a, ip, sizeof(ip));
    port = ntohs(a->sin6_port);
  }
  snprintf(t->c.peer, sizeof(t->c.peer), "%s:%d", ip, port);
}

/* The listener's connection callback: accepts (or refuses above
 * max_connections), tunes the socket and starts reading. */
static void on_accept(uv_stream_t *listener, int status) {
  struct tcp_shard *ts = container_of((uv_tcp_t *)listener, struct tcp_shard, listener);
  struct server *s = ts->s;
  if (status < 0) {
    log_warn("accept failed", "error=%s", uv_strerror(status));
    return;
  }
  struct conn *c = conn_new(s);
  if (!c) return;
  struct conn_tcp *t = tcp_of(c);
  uv_tcp_init(&s->loop, &t->tcp);
  if (uv_accept(listener, (uv_stream_t *)&t->tcp) < 0 || conn_admit(c) < 0) {
    conn_refuse(c);
    return;
  }
  uv_tcp_nodelay(&t->tcp, 1);
  /* a peer that vanished without FIN or RST (power loss, partition) is
   * noticed by keepalive when idle and by TCP_USER_TIMEOUT when data is
   * unacknowledged, instead of holding its memory forever */
  uv_tcp_keepalive(&t->tcp, 1, 30);
  uv_os_fd_t fd;
  if (uv_fileno((uv_handle_t *)&t->tcp, &fd) == 0) {
    net_set_keepalive(fd, 30, 10, 3);
    if (s->opts.tcp_user_timeout_ms) net_set_user_timeout(fd, (int)s->opts.tcp_user_timeout_ms);
  }
  /* Large fixed buffers: a 1 MiB push then moves in one or two wakeups
   * instead of a ping-pong of 64 KiB windows (docs/ARCHITECTURE.md, Pitfalls: never small). */
  int bufsize = SOCKET_BUFFER_BYTES;
  uv_send_buffer_size((uv_handle_t *)&t->tcp, &bufsize);
  bufsize = SOCKET_BUFFER_BYTES;
  uv_recv_buffer_size((uv_handle_t *)&t->tcp, &bufsize);
  name_peer(t);
  tcp_read_start(c);
}

/* Listens on --listen, logging what went wrong. */
static int tcp_listen(struct server *s, char *bound, size_t boundlen) {
  struct tcp_shard *ts = calloc(1, sizeof(*ts));
  if (!ts) return -ENOMEM;
  ts->s = s;
  s->tp_state = ts;
  char why[256];
  struct listener_error e = {.reason = why, .reason_len = sizeof(why)};
  int r =
      listener_open(&s->loop, &ts->listener, s->opts.listen, 512, on_accept, bound, boundlen, &e);
  if (r == 0) {
    ts->listening = true;
    return 0;
  }
  if (e.step == LISTENER_PARSE)
    log_error("bad --listen", "value=\"%s\" error=\"%s\"", s->opts.listen, why);
  else if (e.step == LISTENER_RESOLVE)
    log_error("cannot resolve --listen", "host=%s error=\"%s\"", e.host, why);
  else
    log_error("cannot listen", "addr=%s error=\"%s\"", s->opts.listen, why);
  return r;
}

static void tcp_stop_accepting(struct server *s) {
  struct tcp_shard *ts = s->tp_state;
  if (ts && ts->listening) uv_close((uv_handle_t *)&ts->listener, NULL);
  if (ts) ts->listening = false;
}

/* After the loop closed: the listener's memory. */
static void tcp_free(struct server *s) {
  free(s->tp_state);
  s->tp_state = NULL;
}

const struct conn_transport_ops conn_tcp_ops = {
    .name = "tcp",
    .conn_size = sizeof(struct conn_tcp),
    .listen = tcp_listen,
    .stop_accepting = tcp_stop_accepting,
    .free = tcp_free,
    .init = tcp_init,
    .deinit = tcp_deinit,
    .read_stop = tcp_read_stop,
    .read_start = tcp_read_start,
    .gone = tcp_gone,
    .write = tcp_write,
    .write_pieces = tcp_write_pieces,
    .close = tcp_close,
    .describe = tcp_describe,
};
