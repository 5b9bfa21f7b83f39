/* server_impl: what the shard's modules share (internal to ps-server).
 *
 * Who owns what (struct server below says who writes which fields):
 *  - server.c: the shard's lifecycle. server_run, the loop and its handles
 *    (signals, timers), picking the transport, stopping and draining,
 *    missing workers (liveness, the watchdog), the checkpoint glue (loading,
 *    periodic capture, the final checkpoint) and the metrics snapshot.
 *  - conn.c: one client connection, whatever its transport (struct conn,
 *    struct out_msg): every state transition, reading frames (decoder,
 *    pre-authentication limits, the header checked against the handler
 *    table, tags, one dispatch per frame), writing replies (tags, output
 *    queue, watermarks), deadlines and closing.
 *  - the transport files (conn_*.c, listed in conn_transports.c, the
 *    registry that maps a --transport name to its table): each a struct
 *    conn_transport_ops (listening, reading, writing, closing), with their
 *    own connection and listener structs. No other file names one.
 *  - handlers.c: the messages. The table of handlers and one handler per
 *    message type (hello, auth, layout, init, push, pull, barrier, stats,
 *    shutdown), with the barrier and waiting pulls they answer.
 *  - rollback.c: the job rollback (ERR_ROLLBACK refusals, MSG_ROLLBACK,
 *    reloading a checkpoint) and replacing the store.
 *  - leave.c: MSG_LEAVE's handler, and the steps that can never complete
 *    because a rank finished or waits in the barrier (ERR_UNEVEN_STEPS).
 *  - lost.c: the job's state is lost (ERR_STATE_LOST), superseded processes.
 *
 * Who calls whom (each function is declared below, or in rollback.h, under
 * the file that defines it):
 *
 *   transport  -> conn.c      a connection is new/admitted/refused, bytes
 *                             arrived (conn_feed, conn_feed_direct), a reply
 *                             is out (conn_out_done), it failed (conn_doom,
 *                             conn_fail, conn_close)
 *   conn.c     -> transport   through c->tp only
 *   conn.c     -> handlers.c  the table's entry of a header (handlers_find),
 *                             then its handler, once the frame is whole
 *   conn.c     -> server.c    a connection closes (server_conn_detach), a
 *                             silent worker (server_rank_silent)
 *   handlers.c -> conn.c      replies and refusals (conn_send, conn_ack,
 *                             conn_error, conn_fail, conn_auth_fail)
 *   handlers.c -> server.c    SHUTDOWN stops the shard (server_stop), a push
 *                             while draining (server_drain_check), INIT
 *                             checkpoints the initial values, liveness
 *   handlers.c -> rollback.c  a push or pull refused (rollback_refuses*)
 *   rollback.c -> server.c    checkpoints quiesced and re-hooked around a
 *                             reload (server_checkpoint_quiesce/_hook)
 *   server.c   -> transport   through s->tp only (listen, stop accepting)
 *   server.c   -> conn.c      the sweep timer's and check handle's
 *                             callbacks, conn_close when stopping,
 *                             conn_error when a job fails
 *   server.c   -> handlers.c  the store's serve callback for waiting pulls
 *                             (handlers_serve_waiter), the barrier after a
 *                             rank is declared gone (handlers_barrier_*)
 *   handlers.c -> leave.c     the LEAVE handler (leave_handle), a push or
 *                             pull checked (leave_refuses_push/_pull), a rank
 *                             in the barrier (leave_check), hello and
 *                             rollback (leave_reset)
 *   leave.c    -> conn.c      refusals (conn_error), server_drain_check
 *
 * All of them see these structs; nothing outside ps-server does (main.c
 * knows only server.h).
 *
 * A connection is a small state machine (enum conn_state):
 *
 *   HELLO --hello (no token)----------------> READY --(bad frame | error | EOF)--> CLOSING
 *     |  --hello+nonce / AUTH sent--> AUTH --proof ok / ACK+tag--^
 *     |                                 +--wrong proof / other frame--> CLOSING
 *     +--bad frame / anything but hello / handshake deadline--> CLOSING
 *
 * Before READY the decoder takes only handshake-sized headers and no payload;
 * with a token (auth_token) every frame after the handshake carries a tag
 * (common/auth.h) checked before its handler runs. In CLOSING the connection
 * reads nothing more; an error frame naming the problem is written first when
 * the stream is still in sync, then the transport closes it and frees its
 * memory (conn_free) once done. One misbehaving client never affects the
 * others. */
#ifndef PS_SERVER_IMPL_H
#define PS_SERVER_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "auth.h"
#include "container_of.h"
#include "frame.h"
#include "handshake.h"
#include "rollback.h"
#include "server.h"
#include "store.h"
#include "wire.h"

#define READ_BUF_BYTES (64u * 1024u)
#define DIRECT_READ_MIN (16u * 1024u)
#define OUT_HDR_BYTES 2048u
#define OUT_FLUSH_BYTES (64u * 1024u)   /* queued replies written before the loop's check */
#define SEAL_PIECE_BYTES (128u * 1024u) /* authenticated payloads go out in pieces this large */
#define SOCKET_BUFFER_BYTES (4 * 1024 * 1024)
#define HS_ARENA_BYTES (16u * 1024u) /* decode budget before authentication */
#define SWEEP_MS 250                 /* how often deadlines are checked */
/* A beating worker silent for --worker-timeout, and for at least this many
 * of its beats, has stopped. */
#define SILENCE_MIN_BEATS 4

enum conn_state { CONN_HELLO, CONN_AUTH, CONN_READY, CONN_CLOSING };

struct conn_transport_ops;
struct handler_entry;

/* One connection. Its transport's own fields follow it in memory (each
 * transport's connection struct begins with it). conn.c writes every field here
 * and makes every state transition (the handshake's through conn_challenge,
 * conn_authenticated, conn_ready), except what the modules that answer a
 * worker note of it: what its HELLO said (hello_rank, hello_world, beat_ms:
 * handlers.c), its process (incarnation: lost.c) and its pulls waiting in
 * the store (waiting: whoever queues or answers one). */
struct conn {
  const struct conn_transport_ops *tp; /* how its bytes travel */
  struct server *srv;
  struct conn *prev, *next;
  enum conn_state state;
  struct frame_decoder dec;
  struct wire_arena arena;
  wire_header *hdr;                    /* of the frame being read; lives in arena */
  const struct handler_entry *handler; /* ...and its entry in handlers.c's table */
  float *scratch;
  size_t scratch_bytes;
  bool has_rank;
  uint32_t beat_ms; /* Hello.heartbeat_ms: its silence means it stopped (conn_sweep) */
  uint32_t rank;
  char peer[64];
  struct hs hs;                                     /* the authentication handshake */
  struct auth_session *sess;                        /* after it: every frame carries a tag */
  uint32_t hello_rank, hello_world;                 /* claimed in HELLO, taken once authenticated */
  uint64_t accepted_ms, last_rx_ms, frame_start_ms; /* uv_now; frame_start 0 = between frames */
  uint64_t out_bytes;                               /* memory held by queued replies */
  bool read_paused;                                 /* out_bytes went above the high watermark */
  bool doomed;          /* above the hard limit: sends nothing more, the sweep closes it */
  const char *doom_why; /* NULL: the hard limit; else why a write failed (a literal) */
  uint64_t mac_done;    /* payload bytes of the current frame already fed to the tag */
  bool nf_check;        /* count the current payload's NaN/Inf (--reject-nonfinite) */
  uint64_t nf_done;     /* its floats counted so far */
  uint64_t nonfinite;   /* NaN/Inf among them */
  uint32_t waiting;     /* pulls of this connection waiting for a version */
  uint64_t incarnation; /* its LAYOUT's: which process of its rank (0 = not given) */
  /* Replies queued in this loop iteration, not yet handed to libuv: the
   * server's check handle writes them in one uv_write (conn_flush). */
  struct out_msg *outq_head, *outq_tail;
  uint64_t outq_bytes;                  /* their wire bytes */
  struct conn *flush_prev, *flush_next; /* in server.flush_list while outq_head */
};

/* What a transport does for the shard and for each of its connections
 * (Redis's ConnectionType): each transport file defines one, and
 * server.c takes the one conn_transports.c has under --transport's name.
 * Nothing else knows which it is.
 * Operations marked optional may be NULL. */
struct conn_transport_ops {
  const char *name; /* its --transport value (the metric's label) */
  size_t conn_size; /* of its connection struct, which begins with struct conn */
  /* Before anything starts (optional): whether this build can use it (a
   * config_check_fn on its name, --transport's check) and its
   * environment-only settings (0, or -EINVAL with err naming the variable). */
  int (*check_build)(const char *name, char *err, size_t errlen);
  int (*check_env)(char *err, size_t errlen);
  /* The shard: listen on opts.listen (bound gets "host:port"; its state goes
   * in server.tp_state; 0 or a negative errno, logged), stop accepting
   * (once), refresh the traffic counters it keeps (optional), after the
   * loop release what it still holds (optional), and once the loop is
   * closed free its state. */
  int (*listen)(struct server *s, char *bound, size_t boundlen);
  void (*stop_accepting)(struct server *s);
  void (*count)(struct server *s);
  void (*release)(struct server *s);
  void (*free)(struct server *s);
  /* A connection: its own fields set up (conn_new; 0 or -ENOMEM) and torn
   * down (conn_free, even after a failed init); reading stopped and
   * resumed; whether nothing more can be sent; its queued replies written
   * (each handed back with conn_out_done once sent); a large sealed payload
   * tagged and written in pieces (optional; takes m only on success);
   * closed after (flush) or without its queued replies, its memory freed
   * with conn_free once the transport is done with it; and its transport
   * named for the log (its name, then what it reports of the connection). */
  int (*init)(struct conn *c);
  void (*deinit)(struct conn *c);
  void (*read_stop)(struct conn *c);
  void (*read_start)(struct conn *c);
  bool (*gone)(const struct conn *c);
  void (*write)(struct conn *c, struct out_msg *head);
  int (*write_pieces)(struct conn *c, struct out_msg *m, uint64_t plen);
  void (*close)(struct conn *c, bool flush);
  void (*describe)(const struct conn *c, char *buf, size_t len);
};

/* What a message type needs before its handler runs (handlers.c's table,
 * checked by conn.c as soon as the header is in). */
struct handler_entry {
  void (*fn)(struct conn *c, const wire_header *h, const void *payload);
  bool needs_layout; /* data messages */
  bool has_payload;  /* payload = the key's values */
  bool needs_key;
  bool judged; /* refused once the job is lost or the rank's process superseded (lost.c) */
};

struct out_msg {
  struct out_msg *next; /* in the connection's queue, then in its batch */
  struct conn *c;
  struct vbuf *vb;  /* payload reference, or NULL */
  uint64_t bytes;   /* on the wire */
  uint64_t held;    /* memory it keeps until written: counted in conn.out_bytes */
  unsigned hdr_len; /* preamble + header bytes in hdr */
  uint8_t tag[AUTH_TAG_BYTES];
  uint8_t hdr[OUT_HDR_BYTES + AUTH_TAG_BYTES]; /* room for the tag after the header */
};

/* Per rank, what lost.c knows of its process. */
struct rank_run {
  uint64_t incarnation; /* of its newest process (0 = none seen) */
  uint64_t first_step;  /* the lowest step that process pushed here (0 = unknown: any) */
  bool stale;           /* --optimizer sum: its process belongs to a run the job restarted from */
  bool told;            /* the job is lost and it was told so */
};

struct barrier_slot {
  struct conn *c; /* NULL = this rank has not arrived */
  uint64_t request_id;
};

/* Who waits in the barrier (handlers.c's; others take a request out with
 * handlers_barrier_take). */
struct barrier {
  struct barrier_slot *slot; /* per rank; NULL before a layout */
  uint32_t arrived;
};

/* The shard. Each group of fields is written only by the module named
 * above it (others read); server.c allocates the per-rank arrays and frees
 * everything after the loop. */
struct server {
  /* server.c: lifecycle, liveness, draining, checkpoint glue */
  uv_loop_t loop;
  const struct conn_transport_ops *tp; /* picked once (bind_listener); NULL until then */
  uv_signal_t sigint, sigterm;
  uv_timer_t grace;    /* after a SHUTDOWN: how long workers get to hang up */
  uv_timer_t watchdog; /* finds workers away for longer than worker_timeout_ms */
  bool watchdog_on;
  uv_timer_t first_timer; /* --first-worker-timeout: fires once if no layout came */
  bool first_timer_on;
  struct server_opts opts;
  struct frame_limits lim;
  struct store store;     /* replaced whole only by rollback.c (rollback_replace_store) */
  uint32_t *rank_conns;   /* per rank: open connections that said hello */
  uint64_t *rank_left_ms; /* per rank: when its last connection closed (uv_now) */
  int exit_error;         /* what server_run returns after the loop (server_fail) */
  int stop_signal;        /* the signal that stops us, until worker 0 ends the training */
  char fail_msg[400];     /* WORKER_TIMEOUT_FAIL: what every waiting request is told */
  bool timeout_auto;      /* on_worker_timeout was resolved from auto (fail_msg says so) */
  bool stopping;
  struct ckpt_writer *ckw;       /* NULL = no checkpoints (or already finished) */
  struct ckpt_snapshot *pending; /* BSP: the checkpoint being captured key by key */
  bool draining;                 /* SIGTERM: finishing started steps before the final checkpoint */
  uv_timer_t drain_timer;
  bool drain_timer_on;
  struct ckpt_writer *ckw_done; /* freed after the loop (its async handle closes) */
  bool ckpt_failed;             /* checkpoint_max_failures reached: the job stops, no final one */
  bool *lost_ever;              /* per rank: the shard went on without it (Stats.lost_ranks) */
  uv_timer_t sweep;             /* connection deadlines (conn_sweep) */
  uv_check_t flush;             /* after each poll: writes what connections queued */

  /* the transport file: its listener */
  void *tp_state;

  /* conn.c: the connections */
  struct conn *conns;
  uint32_t num_conns;
  struct conn *flush_list;    /* connections with queued replies */
  uint64_t out_high, out_low; /* output watermarks (bytes; set by server.c at start) */
  uint64_t last_refuse_log_ms;

  /* handlers.c: the barrier and what the handlers keep */
  struct barrier barrier;
  uint64_t held_pushes; /* draining: pushes not taken (the workers resend them) */
  bool *lost_said;      /* per rank: "updates lost since the checkpoint" logged */

  /* rollback.c: restored from a checkpoint, the job rollback */
  struct rollback rb;

  /* leave.c: per rank, the first step refused for its sake, or NULL */
  char **uneven;

  /* lost.c: the job's state is gone (lost_msg says how); every request is
   * refused with it until each live rank was told, then the shard stops */
  struct rank_run *ranks;
  bool lost;
  char lost_msg[700];
  uv_timer_t lost_timer; /* stops the shard if some rank is never told */
  bool lost_timer_on;

  /* counters: each is incremented by the one module that counts its event
   * (conn.c, the transports, handlers.c, server.c); server.c publishes them */
  struct server_traffic traffic;
};

/* ---- conn.c ---- */

/* Timer callback (every SWEEP_MS): closes connections past a deadline. */
void conn_sweep(uv_timer_t *t);
/* Check callback (once per loop iteration, after I/O): writes each
 * connection's queued replies, one uv_write per connection. */
void conn_flush_all(uv_check_t *h);
/* Queues one frame (tagged once authenticated); vb (may be NULL) is the
 * payload, referenced until written. Returns 0 or a negative errno. */
int conn_send(struct conn *c, const wire_header *h, struct vbuf *vb);
void conn_ack(struct conn *c, const wire_header *req, uint32_t flags);
/* An error frame answering request_id; the connection stays open. */
void conn_error(struct conn *c, uint64_t request_id, Ps__ErrorCode code, const char *msg);
/* Stops reading, lets queued replies drain (flush), then closes. */
void conn_close(struct conn *c, bool flush);
/* Frees c once nothing refers to it any more (its transport is done with
 * it: the handle's close callback, its last operation's completion). */
void conn_free(struct conn *c);
/* A new connection of s on s->tp with the handshake's limits, not yet in
 * s->conns; NULL when out of memory (logged). */
struct conn *conn_new(struct server *s);
/* Adds c to s->conns, or returns -1 above --max-connections (counted and
 * logged): the transport then refuses it (conn_refuse). */
int conn_admit(struct conn *c);
/* Closes a connection that was never admitted. */
void conn_refuse(struct conn *c);
/* c gets nothing more (why: a literal, err: 0 or the negative errno that
 * made it so, both logged) and the next sweep closes it. */
void conn_doom(struct conn *c, const char *why, int err);
/* A reply the transport has sent (or dropped): its memory is released. */
void conn_out_done(struct conn *c, struct out_msg *m);
/* Hands c's queued replies to its transport now. */
void conn_flush(struct conn *c);
/* Reading pauses (output watermark, doomed) and resumes. */
void conn_read_stop(struct conn *c);
void conn_read_resume(struct conn *c);
/* Feeds n bytes of the connection's stream to the decoder, running the
 * handlers on each header and frame (what a TCP read does). */
void conn_feed(struct conn *c, const uint8_t *p, size_t n);
/* After n bytes were written into the decoder's payload window. */
void conn_feed_direct(struct conn *c, size_t n);
/* Rejects the client: one error frame naming the problem, then close. */
void conn_fail(struct conn *c, Ps__ErrorCode code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* conn_fail for a failed handshake or tag, counted apart. */
void conn_auth_fail(struct conn *c, const char *why);
/* The handshake's transitions (handlers.c's HELLO and AUTH): HELLO -> AUTH
 * once the worker is challenged; the proof checked, every later frame both
 * ways carries a tag (authenticated); HELLO or AUTH -> READY as rank (the
 * full limits take effect once this frame is done). */
void conn_challenge(struct conn *c);
void conn_authenticated(struct conn *c);
void conn_ready(struct conn *c, uint32_t rank);

/* ---- handlers.c ---- */

/* The table's entry for a message type, or NULL for a type a shard does
 * not accept. */
const struct handler_entry *handlers_find(int type);
/* store_serve_fn: a waiting pull's version has arrived; its reply is sent
 * and w freed. arg is unused. */
void handlers_serve_waiter(struct store_key *k, struct store_waiter *w, void *arg);
/* Acks the barrier if every live rank has arrived (gone ranks are not
 * waited for). */
void handlers_barrier_complete(struct server *s);
/* The barrier exists once a layout is known (or a checkpoint loaded):
 * open allocates it (once; 0 or -ENOMEM), free releases it. */
int handlers_barrier_open(struct server *s);
void handlers_barrier_free(struct server *s);
/* Takes rank's barrier request out (the caller answers it): its connection
 * and request id, or NULL when rank does not wait in the barrier. */
struct conn *handlers_barrier_take(struct server *s, uint32_t rank, uint64_t *request_id);
/* c is closing: it no longer waits in the barrier. */
void handlers_barrier_drop(struct conn *c);

/* ---- leave.c ---- */

/* MSG_LEAVE (flags: enum store_left): the rank pushes no further step. */
void leave_handle(struct conn *c, const wire_header *h, const void *payload);
/* Before a push of k is taken: refuses (error frame, true) a push beyond
 * the clock of a rank that left, and a BSP push starting a step that needs
 * a finished rank or one in the barrier (which fails everything else that
 * waits on that too). */
bool leave_refuses_push(struct conn *c, const wire_header *h, struct store_key *k);
/* Before a pull of k waits: refuses (true) one that waits for such a rank. */
bool leave_refuses_pull(struct conn *c, const wire_header *h, struct store_key *k);
/* rank finished or entered the barrier: fails what now waits on it. */
void leave_check(struct server *s, uint32_t rank);
/* rank takes part in the steps again: its hello, or its rollback (which
 * also forgets the steps refused for its sake: they are replayed). */
void leave_reset(struct server *s, uint32_t rank, bool rollback);

/* ---- lost.c ---- */

/* The job's state is lost: every waiting request and every later one fails
 * with ERR_STATE_LOST and this message; the shard stops once each live
 * rank was told (server_run returns -ESTALE). Once. */
void lost_enter(struct server *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* rank was told why its requests fail (server_fail_waiting). */
void lost_told(struct server *s, uint32_t rank);
/* Closes the lost state's timer (stopping). */
void lost_close(struct server *s);
/* Before a request of a rank is handled: refuses it (error frame, true) when
 * the job is lost, or its process was superseded or belongs to a run the
 * job started over from. */
bool lost_refuses(struct conn *c, const wire_header *h);
/* A push the rank's clock would drop as a duplicate but that its process
 * never sent here: the job is lost (true). */
bool lost_false_duplicate(struct conn *c, const wire_header *h, const struct store_key *k);
/* Before a LAYOUT is taken: a shard that holds nothing of a job the worker
 * says had started lost it (refused, true); with --optimizer sum a fresh
 * process on a shard that holds a run starts the job over. */
bool lost_on_layout(struct conn *c, const wire_header *h);
/* MSG_ABORT: a worker relays another shard's ERR_STATE_LOST. */
void lost_handle_abort(struct conn *c, const wire_header *h, const void *payload);

/* ---- server.c ---- */

/* Unlinks c from everything in the shard that may still point at it
 * (waiting pulls, the barrier, its rank's count); conn.c took it off the
 * connection list. */
void server_conn_detach(struct conn *c);
/* Worker liveness (server.c's rank_conns, rank_left_ms): rank's connection
 * said hello; rank fell silent at `since` (uv_now), counted as gone from
 * then if it has no other connection; every rank without a connection is
 * missed from now (the layout is registered). */
void server_rank_joined(struct server *s, uint32_t rank);
void server_rank_silent(struct server *s, uint32_t rank, uint64_t since);
void server_ranks_missed_from_now(struct server *s);
/* Every waiting pull and every rank in the barrier fails with code and
 * msg (each such rank counts as told, ranks[].told); a job that stops,
 * or one that starts over, says why to everyone who waits. */
void server_fail_waiting(struct server *s, Ps__ErrorCode code, const char *msg);
/* Stops accepting and closes the loop's handles, once. Graceful (a
 * SHUTDOWN from worker 0): the workers get a few seconds to hang up
 * first; otherwise every connection is closed now, after its queued
 * replies. With checkpoints, a final one is written first. */
void server_stop(struct server *s, const char *why, bool graceful);
/* server_stop (not graceful) for a job that cannot go on: server_run
 * returns err (a negative errno). Does nothing once stopping. */
void server_fail(struct server *s, int err, const char *why);
/* Draining (SIGTERM with checkpoints): stops the shard once every started
 * step has finished. Does nothing when not draining. */
void server_drain_check(struct server *s);
/* With checkpoints: once every key holds its initial values, writes them as
 * clock 0 (a shard killed before its first periodic checkpoint rolls the job
 * back to step 0 instead of waiting for values it lost). */
void server_checkpoint_initial(struct server *s);
/* The store's update hook takes periodic checkpoints (again: after the
 * store was replaced, rollback_replace_store). */
void server_checkpoints_hook(struct server *s);
/* Before the store is replaced: waits for the checkpoint being written and
 * drops the one being captured. Returns -ENOENT without checkpoints (then
 * does nothing), else 0. */
int server_checkpoint_quiesce(struct server *s);

#endif
