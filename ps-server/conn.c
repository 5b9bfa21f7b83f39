/* conn: one client connection of a shard (its state machine and who calls
 * whom: server_impl.h).
 *
 * Memory per connection is fixed at accept (a read buffer, the frame
 * decoder's header buffer sized to the handshake limit, a small decode
 * arena), raised once the connection is READY, plus one scratch buffer that
 * grows to the largest key this client pushes; limits on the preamble are
 * checked before any of it is used. A reply is a struct out_msg that lives
 * until its write callback; a pull reply points into the key's
 * reference-counted parameter buffer, so large values are never copied on
 * the way out. Replies are not written one by one: conn_send tags a reply
 * and appends it to its connection's queue, and once per loop iteration,
 * after the I/O callbacks (a uv_check handle), every connection's queue goes
 * out in one uv_write (sooner once 64 KiB are queued, a full loopback
 * segment, or when a large frame was just read). So the acks of the 64
 * pushes that one read brought in cost one writev, not 64, and replies
 * still leave in the iteration that made them. The bytes queued per
 * connection drive the output watermarks; a swept timer enforces the
 * deadlines and closes doomed connections. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "net.h"
#include "server_impl.h"
#include "shard_http.h"
#include "tensor_math.h"

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf);
static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf);
static int account(struct conn *c, uint64_t bytes, uint64_t held);

static void out_msg_free(struct out_msg *m) {
  vbuf_unref(m->vb);
  free(m);
}

/* A batch's bytes are no longer queued: a client paused for a full output
 * queue is read again once the queue is down to the low watermark. */
static void on_write(uv_write_t *req, int status) {
  struct out_batch *b = container_of(req, struct out_batch, req);
  struct conn *c = b->c;
  (void)status; /* a failed write shows up as a read error on the same socket */
  for (struct out_msg *m = b->head, *next; m; m = next) {
    next = m->next;
    c->out_bytes -= m->held;
    out_msg_free(m);
  }
  vbuf_unref(b->pin);
  free(b);
  conn_read_resume(c);
}

void conn_read_stop(struct conn *c) {
  if (!c->ucx) uv_read_stop((uv_stream_t *)&c->tcp);
}

/* Reading again once the replies are down to the low watermark. */
void conn_read_resume(struct conn *c) {
  if (!c->read_paused || c->out_bytes > c->srv->out_low || c->state == CONN_CLOSING || c->doomed)
    return;
  c->read_paused = false;
  if (c->ucx)
    conn_ucx_pump(c);
  else
    uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

/* Nothing more can be sent on c. */
static bool conn_gone(struct conn *c) {
  return c->ucx ? !c->uep : uv_is_closing((uv_handle_t *)&c->tcp);
}

/* c gets nothing more and the next sweep closes it. Not closed here: the
 * callers of conn_send may be walking the store's waiter lists, which
 * closing edits. */
static void conn_doom(struct conn *c, const char *why) {
  if (c->doomed || c->state == CONN_CLOSING) return;
  log_warn("dropping a connection", "peer=%s reason=\"%s\"", c->peer, why);
  c->doomed = true;
  c->doom_why = why;
  conn_read_stop(c);
}

static void flush_list_remove(struct conn *c) {
  struct server *s = c->srv;
  if (c->flush_prev)
    c->flush_prev->flush_next = c->flush_next;
  else if (s->flush_list == c)
    s->flush_list = c->flush_next;
  if (c->flush_next) c->flush_next->flush_prev = c->flush_prev;
  c->flush_prev = c->flush_next = NULL;
}

/* Drops the replies not yet handed to libuv (a connection closed without
 * flushing them). */
static void outq_drop(struct conn *c) {
  flush_list_remove(c);
  for (struct out_msg *m = c->outq_head, *next; m; m = next) {
    next = m->next;
    c->out_bytes -= m->held;
    out_msg_free(m);
  }
  c->outq_head = c->outq_tail = NULL;
  c->outq_bytes = 0;
}

/* Hands c's queued replies to libuv in one uv_write. */
static void conn_flush(struct conn *c) {
  struct out_msg *head = c->outq_head;
  if (!head) return;
  flush_list_remove(c);
  c->outq_head = c->outq_tail = NULL;
  c->outq_bytes = 0;
  if (c->ucx) {
    conn_ucx_flush(c, head);
    return;
  }
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
  int r = uv_write(&b->req, (uv_stream_t *)&c->tcp, bufs, k, on_write);
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
    c->out_bytes -= m->held;
    out_msg_free(m);
  }
  conn_doom(c, "cannot write replies");
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
  int r = uv_write(&b->req, (uv_stream_t *)&c->tcp, bufs, n, on_write);
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
 * first, so the stream (and the tag counter) keeps their order. On failure
 * the stream holds part of a frame: the connection is doomed. */
static int send_in_pieces(struct conn *c, struct out_msg *m, uint64_t plen) {
  conn_flush(c);
  if (c->doomed || uv_is_closing((uv_handle_t *)&c->tcp)) goto fail;
  const uint8_t *p = (const uint8_t *)m->vb->data;
  if (auth_tx_begin(c->sess) < 0 || auth_tx_update(c->sess, m->hdr, m->hdr_len) < 0) goto fail;
  for (uint64_t off = 0; off < plen; off += SEAL_PIECE_BYTES) {
    uint64_t len = plen - off < SEAL_PIECE_BYTES ? plen - off : SEAL_PIECE_BYTES;
    uv_buf_t bufs[2];
    unsigned n = 0;
    if (off == 0) bufs[n++] = uv_buf_init((char *)m->hdr, m->hdr_len);
    bufs[n++] = uv_buf_init((char *)p + off, (unsigned)len);
    if (auth_tx_update(c->sess, p + off, len) < 0 || write_piece(c, bufs, n, m->vb, NULL) < 0)
      goto fail;
  }
  uv_buf_t tag;
  if (auth_tx_finish(c->sess, m->tag) < 0) goto fail;
  tag = uv_buf_init((char *)m->tag, AUTH_TAG_BYTES);
  if (write_piece(c, &tag, 1, NULL, m) < 0) goto fail;
  return 0;
fail:
  out_msg_free(m);
  conn_doom(c, "cannot write a reply");
  return -EIO;
}

void conn_flush_all(uv_check_t *h) {
  struct server *s = container_of(h, struct server, flush);
  while (s->flush_list) conn_flush(s->flush_list);
}

/* Queues one frame (with its tag once authenticated); vb (may be NULL) is
 * the payload, referenced until sent. A client that lets replies pile up
 * is paused above the high watermark; above the hard limit it gets nothing
 * more and the next sweep closes it (not here: callers may be walking the
 * store's waiter lists, which closing edits). */
int conn_send(struct conn *c, const wire_header *h, struct vbuf *vb) {
  if (conn_gone(c) || c->doomed) return -EPIPE;
  struct server *s = c->srv;
  struct out_msg *m = malloc(sizeof(*m));
  if (!m) return -ENOMEM;
  uint64_t plen = vb ? vb->count * sizeof(float) : 0;
  int n = wire_frame_encode(h, plen, m->hdr, OUT_HDR_BYTES);
  if (n < 0) {
    free(m);
    return n;
  }
  m->next = NULL;
  m->c = c;
  m->hdr_len = (unsigned)n;
  m->vb = vb ? vbuf_ref(vb) : NULL;
  m->bytes = (uint64_t)n + plen + (c->sess ? AUTH_TAG_BYTES : 0);
  /* what this reply holds until written: the message itself (its header
   * buffer is fixed-size) and the payload it pins, whatever its wire size */
  m->held = sizeof(*m) + plen;
  if (c->sess && plen >= SEAL_PIECE_BYTES && !c->ucx) {
    uint64_t bytes = m->bytes, held = m->held;
    if (send_in_pieces(c, m, plen) < 0) return -EIO;
    return account(c, bytes, held);
  }
  if (c->sess) { /* in queue order: the tags' counters follow the stream */
    struct iovec iov[2] = {{m->hdr, (size_t)n}, {vb ? vb->data : NULL, (size_t)plen}};
    if (auth_seal(c->sess, iov, vb ? 2 : 1, m->tag) < 0) {
      out_msg_free(m);
      return -EIO;
    }
  }
  if (c->outq_tail) {
    c->outq_tail->next = m;
  } else {
    c->outq_head = m;
    c->flush_prev = NULL;
    c->flush_next = s->flush_list;
    if (s->flush_list) s->flush_list->flush_prev = c;
    s->flush_list = c;
  }
  c->outq_tail = m;
  c->outq_bytes += m->bytes;
  int r = account(c, m->bytes, m->held);
  /* a full segment's worth goes now: the client starts reading replies
   * while the rest of what it sent is still being handled */
  if (c->outq_bytes >= OUT_FLUSH_BYTES) conn_flush(c);
  return r;
}

/* Counts a reply just queued (bytes on the wire, memory held until written)
 * and applies the output watermarks. */
static int account(struct conn *c, uint64_t bytes, uint64_t held) {
  struct server *s = c->srv;
  s->traffic.bytes_out += bytes;
  c->out_bytes += held;
  if (c->out_bytes > s->opts.out_queue_bytes && c->state != CONN_CLOSING) {
    log_warn("dropping a client whose replies pile up",
             "peer=%s rank=%d queued_bytes=%" PRIu64 " limit=%" PRIu64, c->peer,
             c->has_rank ? (int)c->rank : -1, c->out_bytes, s->opts.out_queue_bytes);
    c->doomed = true;
    conn_read_stop(c);
  } else if (c->out_bytes > s->out_high && !c->read_paused && c->state != CONN_CLOSING) {
    c->read_paused = true;
    conn_read_stop(c);
  }
  return 0;
}

void conn_ack(struct conn *c, const wire_header *req, uint32_t flags) {
  wire_header h = PS__HEADER__INIT;
  h.type = PS__MSG_TYPE__MSG_ACK;
  h.request_id = req->request_id;
  h.key = req->key;
  h.flags = flags;
  conn_send(c, &h, NULL);
}

/* An error frame answering request_id; the connection stays open. */
void conn_error(struct conn *c, uint64_t request_id, Ps__ErrorCode code, const char *msg) {
  wire_header h = PS__HEADER__INIT;
  Ps__Error err = PS__ERROR__INIT;
  h.type = PS__MSG_TYPE__MSG_ERROR;
  h.request_id = request_id;
  err.code = code;
  err.message = (char *)msg;
  h.body_case = PS__HEADER__BODY_ERROR;
  h.error = &err;
  conn_send(c, &h, NULL);
}

void conn_free(struct conn *c) {
  outq_drop(c); /* empty unless it closed without conn_close */
  if (c->ucx) c->srv->ucx_live--;
  hs_deinit(&c->hs);
  auth_session_free(c->sess);
  frame_decoder_deinit(&c->dec);
  wire_arena_deinit(&c->arena);
  free(c->rbuf);
  free(c->scratch);
  free(c);
}

static void on_close(uv_handle_t *handle) {
  conn_free(container_of((uv_tcp_t *)handle, struct conn, tcp));
}

static void on_shutdown(uv_shutdown_t *req, int status) {
  struct conn *c = container_of(req, struct conn, shutdown_req);
  (void)status;
  if (!uv_is_closing((uv_handle_t *)&c->tcp)) uv_close((uv_handle_t *)&c->tcp, on_close);
}

/* Stops reading, lets queued replies drain, then closes. */
void conn_close(struct conn *c, bool flush) {
  if (c->state == CONN_CLOSING) return;
  c->state = CONN_CLOSING;
  server_conn_detach(c);
  conn_read_stop(c);
  if (flush)
    conn_flush(c);
  else
    outq_drop(c);
  if (c->ucx) {
    conn_ucx_close(c, flush);
    return;
  }
  if (!flush || uv_shutdown(&c->shutdown_req, (uv_stream_t *)&c->tcp, on_shutdown) < 0)
    uv_close((uv_handle_t *)&c->tcp, on_close);
}

void conn_fail(struct conn *c, Ps__ErrorCode code, const char *fmt, ...) {
  if (c->state == CONN_CLOSING) return;
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  char q[600];
  log_warn("rejecting client", "peer=%s rank=%d error=%s", c->peer, c->has_rank ? (int)c->rank : -1,
           log_quote(q, sizeof(q), msg));
  c->srv->traffic.rejected_frames++;
  shard_http_count_error(c->srv->opts.http, code);

  wire_header h = PS__HEADER__INIT;
  Ps__Error err = PS__ERROR__INIT;
  h.type = PS__MSG_TYPE__MSG_ERROR;
  h.request_id = c->hdr ? c->hdr->request_id : 0;
  err.code = code;
  err.message = msg;
  h.body_case = PS__HEADER__BODY_ERROR;
  h.error = &err;
  conn_send(c, &h, NULL);
  conn_close(c, true);
}

/* A failed handshake: counted apart from other bad frames. */
void conn_auth_fail(struct conn *c, const char *why) {
  c->srv->traffic.auth_failures++;
  conn_fail(c, PS__ERROR_CODE__ERR_AUTH, "%s", why);
}

/* After the frame that made the connection READY: full frame limits and
 * decode budget (the small pre-authentication ones until now). */
void conn_finish_upgrade(struct conn *c) {
  if (c->state != CONN_READY || c->arena.cap >= WIRE_DEFAULT_BUDGET) return;
  wire_arena_deinit(&c->arena);
  if (wire_arena_init(&c->arena, WIRE_DEFAULT_BUDGET) < 0 ||
      frame_decoder_set_limits(&c->dec, &c->srv->lim) < 0) {
    log_warn("dropping a connection", "peer=%s reason=\"out of memory\"", c->peer);
    conn_close(c, false);
  }
}

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf) {
  struct conn *c = container_of((uv_tcp_t *)handle, struct conn, tcp);
  (void)suggested;
  uint8_t *dst;
  size_t n = frame_decoder_payload_window(&c->dec, &dst);
  c->direct = n >= DIRECT_READ_MIN;
  if (c->direct)
    *buf = uv_buf_init((char *)dst, n > UINT32_MAX ? UINT32_MAX : (unsigned)n);
  else
    *buf = uv_buf_init((char *)c->rbuf, READ_BUF_BYTES);
}

void conn_payload_begin(struct conn *c, bool check_finite) {
  c->mac_done = 0;
  c->nf_done = c->nonfinite = 0;
  c->nf_check = check_finite;
  if (!c->sess) return;
  auth_rx_begin(c->sess);
  auth_rx_update(c->sess, frame_decoder_preamble(&c->dec), FRAME_PREAMBLE_BYTES);
  auth_rx_update(c->sess, frame_decoder_header(&c->dec), frame_decoder_header_len(&c->dec));
}

/* Feeds the payload bytes that arrived since the last call to the tag and
 * counts the non-finite values among them, while they are still in cache
 * from the socket read: no later pass over the payload does either. */
static void payload_progress(struct conn *c) {
  if (!c->hdr || (!c->sess && !c->nf_check)) return;
  uint64_t have = c->dec.state == FD_PAYLOAD ? c->dec.got
                  : c->dec.state == FD_TAG || c->dec.state == FD_DONE
                      ? frame_decoder_payload_len(&c->dec)
                      : 0;
  if (c->sess && have > c->mac_done) {
    auth_rx_update(c->sess, (const uint8_t *)c->scratch + c->mac_done, have - c->mac_done);
    c->mac_done = have;
  }
  uint64_t floats = have / sizeof(float);
  if (c->nf_check && floats > c->nf_done) {
    c->nonfinite += tm_count_nonfinite(c->scratch + c->nf_done, floats - c->nf_done);
    c->nf_done = floats;
  }
}

int conn_payload_finish(struct conn *c) {
  payload_progress(c);
  return c->sess ? auth_rx_finish(c->sess, frame_decoder_tag(&c->dec)) : 0;
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf) {
  struct conn *c = container_of((uv_tcp_t *)stream, struct conn, tcp);
  if (nread < 0) {
    if (nread != UV_EOF)
      log_info("connection lost", "peer=%s error=%s", c->peer, uv_strerror((int)nread));
    else if (c->has_rank)
      log_info("worker disconnected", "peer=%s rank=%" PRIu32, c->peer, c->rank);
    conn_close(c, false);
    return;
  }
  if (c->direct)
    conn_feed_direct(c, (size_t)nread);
  else
    conn_feed(c, (const uint8_t *)buf->base, (size_t)nread);
}

void conn_feed_direct(struct conn *c, size_t n) {
  c->last_rx_ms = uv_now(&c->srv->loop);
  int r = frame_decoder_advance(&c->dec, n);
  payload_progress(c);
  if (r == FRAME_DONE) {
    handlers_dispatch(c);
    /* a large frame took long enough to read that batching its reply
     * with others saves nothing: answer it now */
    conn_flush(c);
  }
}

void conn_feed(struct conn *c, const uint8_t *p, size_t n) {
  c->last_rx_ms = uv_now(&c->srv->loop);
  size_t off = 0;
  while (off < n && c->state != CONN_CLOSING) {
    size_t used = 0;
    int r = frame_decoder_feed(&c->dec, p + off, n - off, &used);
    off += used;
    if (r < 0) {
      if (c->state != CONN_READY && (r == FRAME_EPAYLOAD || r == FRAME_EHEADER) &&
          c->dec.pre.header_len > 0 && c->dec.pre.payload_len <= c->srv->lim.max_payload &&
          c->dec.pre.header_len <= c->srv->lim.max_header) {
        char why[200];
        snprintf(why, sizeof(why),
                 "frame with a %u-byte header and %" PRIu64
                 " payload bytes before the handshake completed: only small HELLO/AUTH frames "
                 "are accepted until then",
                 (unsigned)c->dec.pre.header_len, c->dec.pre.payload_len);
        conn_fail(c, PS__ERROR_CODE__ERR_TOO_LARGE, "%s", why);
        return;
      }
      conn_fail(c,
                r == FRAME_EPAYLOAD || r == FRAME_EHEADER ? PS__ERROR_CODE__ERR_TOO_LARGE
                                                          : PS__ERROR_CODE__ERR_BAD_FRAME,
                "%s", frame_strerror(r));
      return;
    }
    if (r == FRAME_HEADER) r = handlers_on_header(c);
    if (r == FRAME_DONE) handlers_dispatch(c);
  }
  if (c->state != CONN_CLOSING) payload_progress(c);
}

struct conn *conn_new(struct server *s, bool ucx) {
  struct conn *c = calloc(1, sizeof(*c));
  if (!c) return NULL;
  c->srv = s;
  c->ucx = ucx;
  if (ucx) s->ucx_live++;
  c->state = CONN_HELLO;
  hs_init(&c->hs, AUTH_ACCEPTOR, s->opts.auth_token);
  snprintf(c->peer, sizeof(c->peer), "?");
  c->accepted_ms = c->last_rx_ms = uv_now(&s->loop);
  /* until the handshake is over: handshake-sized headers, no payload */
  struct frame_limits hs_lim = {HS_MAX_HEADER, 0};
  if (frame_decoder_init(&c->dec, &hs_lim) < 0 || wire_arena_init(&c->arena, HS_ARENA_BYTES) < 0 ||
      (!ucx && !(c->rbuf = malloc(READ_BUF_BYTES)))) {
    log_warn("dropping a connection", "reason=%s", "out of memory");
    conn_free(c);
    return NULL;
  }
  return c;
}

int conn_admit(struct conn *c) {
  struct server *s = c->srv;
  uint64_t now = uv_now(&s->loop);
  if (s->num_conns >= s->opts.max_connections) {
    s->traffic.refused++;
    shard_http_count_error(s->opts.http, PS__ERROR_CODE__ERR_LIMIT);
    if (now - s->last_refuse_log_ms >= 1000) { /* at most one line a second under a flood */
      log_warn("refusing connections: --max-connections reached",
               "connections=%" PRIu32 " refused_total=%" PRIu64, s->num_conns, s->traffic.refused);
      s->last_refuse_log_ms = now;
    }
    return -1;
  }
  c->next = s->conns;
  if (s->conns) s->conns->prev = c;
  s->conns = c;
  s->num_conns++;
  return 0;
}

void conn_accept(uv_stream_t *listener, int status) {
  struct server *s = container_of((uv_tcp_t *)listener, struct server, listener);
  if (status < 0) {
    log_warn("accept failed", "error=%s", uv_strerror(status));
    return;
  }
  struct conn *c = conn_new(s, false);
  if (!c) return;
  uv_tcp_init(&s->loop, &c->tcp);
  if (uv_accept(listener, (uv_stream_t *)&c->tcp) < 0 || conn_admit(c) < 0) {
    c->state = CONN_CLOSING;
    uv_close((uv_handle_t *)&c->tcp, on_close);
    return;
  }
  uv_tcp_nodelay(&c->tcp, 1);
  /* a peer that vanished without FIN or RST (power loss, partition) is
   * noticed by keepalive when idle and by TCP_USER_TIMEOUT when data is
   * unacknowledged, instead of holding its memory forever */
  uv_tcp_keepalive(&c->tcp, 1, 30);
  uv_os_fd_t fd;
  if (uv_fileno((uv_handle_t *)&c->tcp, &fd) == 0) {
    net_set_keepalive(fd, 30, 10, 3);
    if (s->opts.tcp_user_timeout_ms) net_set_user_timeout(fd, (int)s->opts.tcp_user_timeout_ms);
  }
  /* Large fixed buffers: a 1 MiB push then moves in one or two wakeups
   * instead of a ping-pong of 64 KiB windows (DESIGN.md §9: never small). */
  int bufsize = SOCKET_BUFFER_BYTES;
  uv_send_buffer_size((uv_handle_t *)&c->tcp, &bufsize);
  bufsize = SOCKET_BUFFER_BYTES;
  uv_recv_buffer_size((uv_handle_t *)&c->tcp, &bufsize);
  struct sockaddr_storage ss;
  int len = sizeof(ss);
  if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &len) == 0) {
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
    snprintf(c->peer, sizeof(c->peer), "%s:%d", ip, port);
  }
  uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

/* Whether a request of c waits in the shard (a pull, the barrier). */
static bool conn_waits(const struct conn *c) {
  const struct server *s = c->srv;
  return c->waiting > 0 || (s->barrier && c->has_rank && s->barrier[c->rank].c == c);
}

/* How long a beating worker may be silent: --worker-timeout, but not less
 * than SILENCE_MIN_BEATS of its beats. */
static uint64_t silence_limit(const struct server_opts *o, const struct conn *c) {
  uint64_t beats = (uint64_t)c->beat_ms * SILENCE_MIN_BEATS;
  return o->worker_timeout_ms > beats ? o->worker_timeout_ms : beats;
}

/* Deadlines: handshakes not finished, frames started but not finished (a
 * slowloris), connections idle with nothing waiting, and clients above the
 * output hard limit are closed and their memory freed. */
void conn_sweep(uv_timer_t *t) {
  struct server *s = container_of(t, struct server, sweep);
  const struct server_opts *o = &s->opts;
  uint64_t now = uv_now(&s->loop);
  struct conn *next;
  for (struct conn *c = s->conns; c; c = next) {
    next = c->next;
    const char *why = NULL;
    if (c->doomed) {
      why = c->doom_why ? c->doom_why : "queued replies above --max-output-queue-bytes";
    } else if (c->state != CONN_READY && o->handshake_timeout_ms &&
               now - c->accepted_ms > o->handshake_timeout_ms) {
      why = "handshake not finished within --handshake-timeout";
    } else if (!frame_decoder_idle(&c->dec) && !c->read_paused) {
      if (!c->frame_start_ms)
        c->frame_start_ms = now;
      else if (o->frame_timeout_ms && now - c->frame_start_ms > o->frame_timeout_ms)
        why = "frame not completed within --frame-timeout";
    } else if (c->beat_ms && c->has_rank && c->state == CONN_READY && o->worker_timeout_ms &&
               now - c->last_rx_ms > silence_limit(o, c)) {
      /* stopped, hung or cut off with its socket open: gone as if it had
       * left when it fell silent, so the watchdog acts on it at once; a
       * worker that wakes up reconnects and rejoins */
      uint32_t rank = c->rank;
      uint64_t silent_since = c->last_rx_ms;
      log_warn("worker silent, closing its connection",
               "peer=%s rank=%" PRIu32 " silent_s=%.1f worker_timeout_s=%.1f", c->peer, rank,
               (double)(now - silent_since) / 1000.0, (double)o->worker_timeout_ms / 1000.0);
      s->traffic.silent++;
      conn_close(c, false);
      if (s->rank_conns[rank] == 0) s->rank_left_ms[rank] = silent_since;
      continue;
    } else if (o->idle_timeout_ms && c->state == CONN_READY && !conn_waits(c) &&
               now - c->last_rx_ms > o->idle_timeout_ms) {
      why = "idle for longer than --idle-timeout";
    }
    if (!why) continue;
    log_warn("dropping a connection", "peer=%s rank=%d reason=\"%s\"", c->peer,
             c->has_rank ? (int)c->rank : -1, why);
    s->traffic.dropped++;
    shard_http_count_error(s->opts.http, PS__ERROR_CODE__ERR_LIMIT);
    conn_close(c, false);
  }
}
