/* conn: one client connection of a shard, whatever carries its bytes (its
 * state machine and who calls whom: server_impl.h).
 *
 * The transports (conn_*.c, conn_transports.c) only move bytes: they hand what
 * arrives to conn_feed / conn_feed_direct and write what conn_flush gives
 * them, through c->tp (struct conn_transport_ops). Everything else is here,
 * once for both: every state transition (READY, doomed, CLOSING), the
 * decoder and its limits, the header checked against the handler table as
 * soon as it is in (handlers_find) and one dispatch per whole frame, tags,
 * the output queue and its watermarks, and the deadlines.
 *
 * Memory per connection is fixed at accept (the transport's read buffer,
 * the frame decoder's header buffer sized to the handshake limit, a small
 * decode arena), raised once the connection is READY, plus one scratch
 * buffer that grows to the largest key this client pushes; limits on the
 * preamble are checked before any of it is used. A reply is a struct
 * out_msg that lives until its transport has sent it (conn_out_done); a
 * pull reply points into the key's reference-counted parameter buffer, so
 * large values are never copied on the way out. Replies are not written one
 * by one: conn_send tags a reply and appends it to its connection's queue,
 * and once per loop iteration, after the I/O callbacks (a uv_check handle),
 * every connection's queue goes to its transport at once (over TCP one
 * uv_write; sooner once 64 KiB are queued, a full loopback segment, or when
 * a large frame was just read). So the acks of the 64 pushes that one read
 * brought in cost one writev, not 64, and replies still leave in the
 * iteration that made them. The bytes queued per connection drive the
 * output watermarks; a swept timer enforces the deadlines and closes doomed
 * connections. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "server_impl.h"
#include "shard_http.h"
#include "tensor_math.h"

static int account(struct conn *c, uint64_t bytes, uint64_t held);

static void out_msg_free(struct out_msg *m) {
  vbuf_unref(m->vb);
  free(m);
}

void conn_out_done(struct conn *c, struct out_msg *m) {
  c->out_bytes -= m->held;
  out_msg_free(m);
}

void conn_read_stop(struct conn *c) {
  c->tp->read_stop(c);
}

/* Reading again once the replies are down to the low watermark. */
void conn_read_resume(struct conn *c) {
  if (!c->read_paused || c->out_bytes > c->srv->out_low || c->state == CONN_CLOSING || c->doomed)
    return;
  c->read_paused = false;
  c->tp->read_start(c);
}

/* Nothing more can be sent on c. */
static bool conn_gone(const struct conn *c) {
  return c->tp->gone(c);
}

/* c gets nothing more and the next sweep closes it. Not closed here: the
 * callers of conn_send may be walking the store's waiter lists, which
 * closing edits. */
void conn_doom(struct conn *c, const char *why, int err) {
  if (c->doomed || c->state == CONN_CLOSING) return;
  if (err)
    log_warn("dropping a connection", "peer=%s reason=\"%s: %s\"", c->peer, why, strerror(-err));
  else
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

/* Drops the replies not yet handed to the transport (a connection closed without
 * flushing them). */
static void outq_drop(struct conn *c) {
  flush_list_remove(c);
  for (struct out_msg *m = c->outq_head, *next; m; m = next) {
    next = m->next;
    conn_out_done(c, m);
  }
  c->outq_head = c->outq_tail = NULL;
  c->outq_bytes = 0;
}

/* Hands c's queued replies to its transport. */
void conn_flush(struct conn *c) {
  struct out_msg *head = c->outq_head;
  if (!head) return;
  flush_list_remove(c);
  c->outq_head = c->outq_tail = NULL;
  c->outq_bytes = 0;
  c->tp->write(c, head);
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
  if (c->sess && plen >= SEAL_PIECE_BYTES && c->tp->write_pieces) {
    uint64_t bytes = m->bytes, held = m->held;
    if (c->tp->write_pieces(c, m, plen) < 0) { /* the stream may hold part of a frame */
      out_msg_free(m);
      conn_doom(c, "cannot write a reply", 0);
      return -EIO;
    }
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
  wire_header h;
  Ps__Error err;
  wire_error_frame(&h, &err, request_id, code, msg);
  conn_send(c, &h, NULL);
}

void conn_free(struct conn *c) {
  outq_drop(c); /* empty unless it closed without conn_close */
  c->tp->deinit(c);
  hs_deinit(&c->hs);
  auth_session_free(c->sess);
  frame_decoder_deinit(&c->dec);
  wire_arena_deinit(&c->arena);
  free(c->scratch);
  free(c);
}

/* Out of s->conns (conn_admit put it there). */
static void unlink_conn(struct conn *c) {
  struct server *s = c->srv;
  if (c->prev)
    c->prev->next = c->next;
  else if (s->conns == c)
    s->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  c->prev = c->next = NULL;
  s->num_conns--;
}

/* Stops reading, lets queued replies drain, then closes. */
void conn_close(struct conn *c, bool flush) {
  if (c->state == CONN_CLOSING) return;
  c->state = CONN_CLOSING;
  unlink_conn(c);
  server_conn_detach(c);
  conn_read_stop(c);
  if (flush)
    conn_flush(c);
  else
    outq_drop(c);
  c->tp->close(c, flush);
}

void conn_refuse(struct conn *c) {
  c->state = CONN_CLOSING;
  c->tp->close(c, false);
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

  conn_error(c, c->hdr ? c->hdr->request_id : 0, code, msg);
  conn_close(c, true);
}

/* A failed handshake: counted apart from other bad frames. */
void conn_auth_fail(struct conn *c, const char *why) {
  c->srv->traffic.auth_failures++;
  conn_fail(c, PS__ERROR_CODE__ERR_AUTH, "%s", why);
}

void conn_challenge(struct conn *c) {
  c->state = CONN_AUTH;
}

void conn_authenticated(struct conn *c) {
  c->sess = hs_take_session(&c->hs);
  frame_decoder_set_tag_len(&c->dec, AUTH_TAG_BYTES);
}

void conn_ready(struct conn *c, uint32_t rank) {
  c->has_rank = true;
  c->rank = rank;
  c->state = CONN_READY;
}

/* After the frame that made the connection READY: full frame limits and
 * decode budget (the small pre-authentication ones until now). */
static void finish_upgrade(struct conn *c) {
  if (c->state != CONN_READY || c->arena.cap >= WIRE_DEFAULT_BUDGET) return;
  wire_arena_deinit(&c->arena);
  if (wire_arena_init(&c->arena, WIRE_DEFAULT_BUDGET) < 0 ||
      frame_decoder_set_limits(&c->dec, &c->srv->lim) < 0) {
    log_warn("dropping a connection", "peer=%s reason=\"out of memory\"", c->peer);
    conn_close(c, false);
  }
}

/* The payload of the frame being read is consumed as its bytes arrive
 * (hot in cache, overlapping the sender): on authenticated connections its
 * tag is computed from the header on, and with check_finite its NaN/Inf are
 * counted (conn.nonfinite), from here to payload_finish. */
static void payload_begin(struct conn *c, bool check_finite) {
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

/* The whole frame is in: 0, or -EBADMSG for a wrong tag. */
static int payload_finish(struct conn *c) {
  payload_progress(c);
  return c->sess ? auth_rx_finish(c->sess, frame_decoder_tag(&c->dec)) : 0;
}

/* A whole frame is in: its tag is checked (authenticated connections),
 * then its handler runs, once; the decoder is ready for the next frame. */
static void on_frame(struct conn *c) {
  const wire_header *h = c->hdr;
  if (payload_finish(c) < 0) {
    char why[200];
    snprintf(why, sizeof(why),
             "%s frame failed authentication (altered, replayed, reordered or not from the "
             "authenticated peer)",
             wire_type_name(h->type));
    c->hdr = NULL; /* its request id is as unauthenticated as the rest: answer none */
    conn_auth_fail(c, why);
    return;
  }
  c->frame_start_ms = 0;
  if (!c->handler->judged || !lost_refuses(c, h)) c->handler->fn(c, h, c->scratch);
  c->hdr = NULL;
  frame_decoder_reset(&c->dec);
  finish_upgrade(c);
}

/* The header of a frame is in: decoded once, checked against the
 * connection's state and its handler's needs (handlers.c's table: the
 * layout, the key, the payload's exact size) before any payload is read,
 * which then goes to the scratch buffer (or nowhere). Returns FRAME_DONE if
 * the frame is complete, FRAME_NEED_MORE, or -1 after conn_fail. */
static int on_header(struct conn *c) {
  struct server *s = c->srv;
  int r = wire_header_unpack(&c->arena, frame_decoder_header(&c->dec),
                             frame_decoder_header_len(&c->dec), &c->hdr);
  if (r < 0) {
    c->hdr = NULL;
    conn_fail(c, r == -ENOMEM ? PS__ERROR_CODE__ERR_TOO_LARGE : PS__ERROR_CODE__ERR_BAD_FRAME,
              r == -ENOMEM ? "header exceeds the decode budget"
                           : "header is not a valid protobuf Header");
    return -1;
  }
  const wire_header *h = c->hdr;
  uint64_t plen = frame_decoder_payload_len(&c->dec);
  const struct handler_entry *e = handlers_find(h->type);
  if (!e) {
    conn_fail(c, PS__ERROR_CODE__ERR_UNKNOWN_TYPE,
              "message type %d (%s) is not accepted by a shard", (int)h->type,
              wire_type_name(h->type));
    return -1;
  }
  if (c->state == CONN_HELLO && h->type != PS__MSG_TYPE__MSG_HELLO) {
    if (s->opts.auth_token)
      conn_auth_fail(c, "data before authentication: only HELLO and AUTH are accepted until then");
    else
      conn_fail(c, PS__ERROR_CODE__ERR_PROTOCOL, "%s before hello", wire_type_name(h->type));
    return -1;
  }
  if (c->state == CONN_AUTH && h->type != PS__MSG_TYPE__MSG_AUTH) {
    char why[160];
    snprintf(why, sizeof(why), "%s before authentication completed", wire_type_name(h->type));
    conn_auth_fail(c, why);
    return -1;
  }
  if (e->needs_layout && !s->store.has_layout) {
    conn_fail(c, PS__ERROR_CODE__ERR_NO_LAYOUT, "%s before any layout was declared",
              wire_type_name(h->type));
    return -1;
  }
  uint64_t want = 0;
  if (e->needs_key) {
    struct store_key *k = store_find(&s->store, h->key);
    if (!k) {
      conn_fail(c, PS__ERROR_CODE__ERR_BAD_KEY, "key %016" PRIx64 " is not held by shard %" PRIu32,
                h->key, s->opts.shard);
      return -1;
    }
    if (e->has_payload) want = k->count * sizeof(float);
  }
  if (plen != want) {
    conn_fail(c, PS__ERROR_CODE__ERR_BAD_SIZE,
              "%s carries %" PRIu64 " payload bytes, expected %" PRIu64, wire_type_name(h->type),
              plen, want);
    return -1;
  }
  if (want > c->scratch_bytes) {
    float *p = realloc(c->scratch, want);
    if (!p) {
      conn_fail(c, PS__ERROR_CODE__ERR_TOO_LARGE, "out of memory for a %" PRIu64 "-byte payload",
                want);
      return -1;
    }
    c->scratch = p;
    c->scratch_bytes = want;
  }
  c->handler = e;
  s->traffic.bytes_in += FRAME_PREAMBLE_BYTES + frame_decoder_header_len(&c->dec) + plen;
  payload_begin(c, s->opts.reject_nonfinite && want > 0);
  return frame_decoder_set_payload(&c->dec, want ? c->scratch : NULL);
}

void conn_feed_direct(struct conn *c, size_t n) {
  c->last_rx_ms = uv_now(&c->srv->loop);
  int r = frame_decoder_advance(&c->dec, n);
  payload_progress(c);
  if (r == FRAME_DONE) {
    on_frame(c);
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
    if (r == FRAME_HEADER) r = on_header(c);
    if (r == FRAME_DONE) on_frame(c);
  }
  if (c->state != CONN_CLOSING) payload_progress(c);
}

struct conn *conn_new(struct server *s) {
  struct conn *c = calloc(1, s->tp->conn_size);
  if (!c) return NULL;
  c->srv = s;
  c->tp = s->tp;
  int tr = c->tp->init(c);
  c->state = CONN_HELLO;
  hs_init(&c->hs, AUTH_ACCEPTOR, s->opts.auth_token);
  snprintf(c->peer, sizeof(c->peer), "?");
  c->accepted_ms = c->last_rx_ms = uv_now(&s->loop);
  /* until the handshake is over: handshake-sized headers, no payload */
  struct frame_limits hs_lim = {HS_MAX_HEADER, 0};
  if (frame_decoder_init(&c->dec, &hs_lim) < 0 || wire_arena_init(&c->arena, HS_ARENA_BYTES) < 0 ||
      tr < 0) {
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

/* Whether a request of c waits in the shard (a pull, the barrier). */
static bool conn_waits(const struct conn *c) {
  const struct server *s = c->srv;
  return c->waiting > 0 || (s->barrier.slot && c->has_rank && s->barrier.slot[c->rank].c == c);
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
      server_rank_silent(s, rank, silent_since);
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
