/* server_impl: what the shard's two files share (internal to ps-server).
 *
 * server.c owns the shard: its loop and lifecycle, the message handlers and
 * the sync engine glue, checkpoints, missing workers. conn.c owns a client
 * connection: accepting it, reading frames (decoder, pre-authentication
 * limits, tags), writing replies (tags, output-queue watermarks), deadlines
 * and closing. Both see these structs; nothing outside ps-server does. */
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
#include "server.h"
#include "store.h"
#include "wire.h"

#define READ_BUF_BYTES (64u * 1024u)
#define DIRECT_READ_MIN (16u * 1024u)
#define OUT_HDR_BYTES 2048u
#define SOCKET_BUFFER_BYTES (4 * 1024 * 1024)
#define HS_ARENA_BYTES (16u * 1024u) /* decode budget before authentication */
#define SWEEP_MS 250                 /* how often deadlines are checked */

enum conn_state { CONN_HELLO, CONN_AUTH, CONN_READY, CONN_CLOSING };

struct conn {
  uv_tcp_t tcp;
  uv_shutdown_t shutdown_req;
  struct server *srv;
  struct conn *prev, *next;
  enum conn_state state;
  struct frame_decoder dec;
  struct wire_arena arena;
  wire_header *hdr; /* of the frame being read; lives in arena */
  uint8_t *rbuf;
  bool direct; /* the last alloc_cb handed out the payload window */
  float *scratch;
  size_t scratch_bytes;
  bool has_rank;
  uint32_t rank;
  char peer[64];
  struct hs hs;                                     /* the authentication handshake */
  struct auth_session *sess;                        /* after it: every frame carries a tag */
  uint32_t hello_rank, hello_world;                 /* claimed in HELLO, taken once authenticated */
  uint64_t accepted_ms, last_rx_ms, frame_start_ms; /* uv_now; frame_start 0 = between frames */
  uint64_t out_bytes;                               /* memory held by queued replies */
  bool read_paused;                                 /* out_bytes went above the high watermark */
  bool doomed;       /* above the hard limit: sends nothing more, the sweep closes it */
  uint64_t mac_done; /* payload bytes of the current frame already fed to the tag */
  uint32_t waiting;  /* pulls of this connection waiting for a version */
};

struct out_msg {
  uv_write_t req;
  struct conn *c;
  struct vbuf *vb; /* payload reference, or NULL */
  uint64_t bytes;  /* on the wire */
  uint64_t held;   /* memory it keeps until written: counted in conn.out_bytes */
  uint8_t tag[AUTH_TAG_BYTES];
  uint8_t hdr[OUT_HDR_BYTES];
};

struct barrier_slot {
  struct conn *c; /* NULL = this rank has not arrived */
  uint64_t request_id;
};

struct server {
  uv_loop_t loop;
  uv_tcp_t listener;
  uv_signal_t sigint, sigterm;
  uv_timer_t grace;    /* after a SHUTDOWN: how long workers get to hang up */
  uv_timer_t watchdog; /* finds workers away for longer than worker_timeout_ms */
  bool watchdog_on;
  struct server_opts opts;
  struct frame_limits lim;
  struct store store;
  struct conn *conns;
  uint32_t num_conns;
  struct barrier_slot *barrier;
  uint32_t barrier_arrived;
  uint32_t *rank_conns;   /* per rank: open connections that said hello */
  uint64_t *rank_left_ms; /* per rank: when its last connection closed (uv_now) */
  int exit_error;         /* what server_run returns after the loop */
  char fail_msg[400];     /* WORKER_TIMEOUT_FAIL: what every waiting request is told */
  bool stopping;
  struct ckpt_writer *ckw;       /* NULL = no checkpoints (or already finished) */
  struct ckpt_snapshot *pending; /* BSP: the checkpoint being captured key by key */
  bool draining;                 /* SIGTERM: finishing started steps before the final checkpoint */
  uv_timer_t drain_timer;
  bool drain_timer_on;
  struct ckpt_writer *ckw_done;  /* freed after the loop (its async handle closes) */
  uint64_t held_pushes;          /* draining: pushes not taken (the workers resend them) */
  bool restored;                 /* the store came from a checkpoint (start or rollback) */
  uint64_t restored_clock;       /* ...of this clock */
  uv_timer_t sweep;              /* connection deadlines */
  uint64_t out_high, out_low;    /* output watermarks (bytes) */
  struct server_traffic traffic; /* counted by conn.c and the handlers */
  uint64_t last_refuse_log_ms;
};

/* ---- conn.c ---- */

/* libuv connection callback of the listener: accepts (or refuses above
 * max_connections), tunes the socket and starts reading. */
void conn_accept(uv_stream_t *listener, int status);
/* Timer callback (every SWEEP_MS): closes connections past a deadline. */
void conn_sweep(uv_timer_t *t);
/* Queues one frame (tagged once authenticated); vb (may be NULL) is the
 * payload, referenced until written. Returns 0 or a negative errno. */
int conn_send(struct conn *c, const wire_header *h, struct vbuf *vb);
void conn_ack(struct conn *c, const wire_header *req, uint32_t flags);
/* An error frame answering request_id; the connection stays open. */
void conn_error(struct conn *c, uint64_t request_id, Ps__ErrorCode code, const char *msg);
/* Stops reading, lets queued replies drain (flush), then closes. */
void conn_close(struct conn *c, bool flush);
/* Rejects the client: one error frame naming the problem, then close. */
void conn_fail(struct conn *c, Ps__ErrorCode code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* conn_fail for a failed handshake or tag, counted apart. */
void conn_auth_fail(struct conn *c, const char *why);
/* After the frame that made c READY: the full frame limits and budget. */
void conn_finish_upgrade(struct conn *c);
/* Whether a request of c waits in the shard (a pull, the barrier). */
bool conn_waits(const struct conn *c);
/* Authenticated connections: the tag of the frame being read is computed as
 * its bytes arrive (hot in cache, overlapping the sender), from the header
 * on (begin) to the end (finish: 0, or -EBADMSG for a wrong tag). */
void conn_mac_begin(struct conn *c);
int conn_mac_finish(struct conn *c);

/* ---- server.c ---- */

/* A header is complete: validate it and choose where its payload goes.
 * Returns FRAME_DONE, FRAME_NEED_MORE, or -1 after conn_fail. */
int server_on_header(struct conn *c);
/* A whole frame is in: check its tag, run its handler. */
void server_dispatch(struct conn *c);
/* Unlinks c from everything in the shard that may still point at it. */
void server_conn_detach(struct conn *c);

#endif
