/* ucx_link: ps frames over UCX active messages (--transport ucx).
 *
 * One struct ulink is a UCX context and worker; a struct ulink_ep is one
 * connection on it, made through UCX's TCP sockaddr connection manager
 * (ulink_listen / ulink_connect on the same host:port a TCP shard uses), so
 * the data then moves over whatever UCX picks at run time: RDMA verbs where
 * the hosts have them, shared memory (posix, sysv, cma) between processes
 * of one host, TCP otherwise; UCX_TLS forces a set.
 *
 * A frame keeps its meaning (common/frame.h): it is one active message whose
 * AM header is
 *
 *   u64 seq (little-endian) || preamble || protobuf header || tag (if any)
 *
 * and whose data is the raw payload. A head larger than UCX takes in an AM
 * header (ulink_max_head: about 8 KiB; a layout of many tensors) travels at
 * the start of the data instead, behind a header of the sequence number
 * with its top bit set and the head's length (u32): the receiver takes the
 * data and unwraps it (ulink_rx_from_buffer). Small payloads travel eagerly; large
 * ones by UCX's rendezvous, which the receiver completes straight into the
 * buffer it chooses once it has read the header (ulink_rx_take): a push
 * lands in the shard's scratch buffer, a pull reply in the caller's tensor.
 * The tag is computed by the sender before sending, over preamble, header
 * and payload, so the receiver checks the whole frame, payload included,
 * before using it.
 *
 * Order: seq numbers the frames of one direction of one connection, and
 * frames are delivered in that order whatever lanes UCX used (frames the
 * peer sent out of order wait, up to ULINK_MAX_REORDER of them); the tags'
 * implicit counters depend on it.
 *
 * Threads: everything UCX reports (frames in, sends and receives done,
 * connections made or lost) is queued inside the progress call and handed
 * to the callbacks afterwards, with no lock held, so callbacks may call any
 * ulink function. With `locked`, every function takes the link's mutex and
 * may be called from any thread (libps: callers send, the receiver thread
 * progresses); without, one thread uses the link (the shard's loop). */
#ifndef PS_UCX_LINK_H
#define PS_UCX_LINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define ULINK_SEQ_BYTES 8
#define ULINK_LONG_HEAD (1ull << 63) /* in seq: the head is in the data */
#define ULINK_MAX_REORDER 4096
#define ULINK_RNDV_BYTES (64u * 1024u) /* payloads at least this large go by rendezvous */
/* ulink_arm polls this long (yielding the CPU between polls) before it arms
 * the event fd: PS_UCX_POLL_US overrides, 0 arms at once. */
#define ULINK_POLL_US 200u

struct ulink;
struct ulink_ep;

/* One frame as it arrived, delivered in order. head: the AM header after
 * the sequence number (preamble || header || tag), copied; the payload
 * (len bytes) stays in UCX until ulink_rx_take or ulink_rx_free. */
struct ulink_rx {
  struct ulink_rx *next; /* free for the receiver's own queues */
  struct ulink_ep *ep;
  uint64_t seq;
  uint64_t len;
  bool rndv;          /* the payload is still at the sender (rendezvous) */
  void *data;         /* eager: the bytes, held by UCX; rndv: UCX's descriptor */
  uint8_t *owned;     /* the data is this malloc'd buffer's (ulink_rx_from_buffer) */
  uint32_t long_head; /* > 0: head is empty and the data starts with this many head bytes */
  uint32_t head_len;
  uint8_t head[]; /* head_len bytes */
};

struct ulink_cbs {
  /* A frame came in (rx is the callee's: ulink_rx_take or ulink_rx_free). */
  void (*on_rx)(struct ulink_rx *rx, void *arg);
  /* Server: a client connected (ep is new; peer is "ip:port"). */
  void (*on_conn)(struct ulink_ep *ep, const char *peer, void *arg);
  /* The connection is lost (why: UCX's status text). Delivered once; the
   * ep stays valid until ulink_ep_close. */
  void (*on_error)(struct ulink_ep *ep, const char *why, void *arg);
  void *arg;
};

/* A send or a take finished: status 0, or a negative errno (-ECONNRESET
 * when the connection went, -ECANCELED when it was closed first). */
typedef void (*ulink_done_fn)(void *arg, int status);

/* --transport: "tcp" (0) or "ucx" (1); -EINVAL with the reason in err for
 * anything else, or for ucx in a build without UCX. A config_check_fn. */
int ulink_transport_parse(const char *value, char *err, size_t errlen);
int ulink_transport_check(const char *value, char *err, size_t errlen);

/* Creates a context and worker. Returns 0, or a negative errno with err
 * saying why (-ENOTSUP: built without UCX). */
int ulink_new(bool locked, const struct ulink_cbs *cbs, struct ulink **out, char *err,
              size_t errlen);
/* ulink_new(false, ...) for a shard that will listen on host: UCX's network
 * devices are restricted to lo when host is a loopback address (unless
 * UCX_NET_DEVICES is set), so nothing of it listens on other interfaces. */
int ulink_new_server(const char *host, const struct ulink_cbs *cbs, struct ulink **out, char *err,
                     size_t errlen);
/* Closes every endpoint (force), then the worker and context. NULL is fine. */
void ulink_free(struct ulink *u);

/* The worker's event fd: readable when ulink_progress has work. */
int ulink_efd(struct ulink *u);
/* Progresses until UCX reports no more work, then runs the callbacks of
 * what it reported. Returns how many events it delivered. */
unsigned ulink_progress(struct ulink *u);
/* True when nothing is pending and the event fd is armed: sleeping on it is
 * safe. False: call ulink_progress again first. Polls for work up to
 * ULINK_POLL_US first (false as soon as there is some). */
bool ulink_arm(struct ulink *u);
/* Wakes a thread sleeping on the event fd (any thread). */
void ulink_signal(struct ulink *u);

/* Listens on host:port (port 0: any; *bound gets the port). Returns 0 or a
 * negative errno with err saying why. */
int ulink_listen(struct ulink *u, const char *host, uint16_t port, uint16_t *bound, char *err,
                 size_t errlen);
/* Connections to the listen port refused since the last call because they
 * did not speak UCX's connection protocol (common/ucx_guard.c). */
uint64_t ulink_take_refused(struct ulink *u);
/* Stops listening (connections made stay). */
void ulink_unlisten(struct ulink *u);
/* Starts connecting to host:port; frames may be sent at once (they leave
 * once connected). A refused or unreachable peer shows up as on_error.
 * Returns 0 or a negative errno with err saying why. */
int ulink_connect(struct ulink *u, const char *host, uint16_t port, struct ulink_ep **out,
                  char *err, size_t errlen);
void ulink_ep_set_user(struct ulink_ep *ep, void *user);
void *ulink_ep_user(const struct ulink_ep *ep);
/* The UCX transports the connection's lanes use, e.g. "posix,cma" or
 * "tcp" ("" while not yet connected). */
const char *ulink_ep_transports(struct ulink_ep *ep);
/* Closes ep: sends not yet done finish with -ECANCELED (flush: they are
 * given the chance to finish first), its frames not yet delivered are
 * dropped, and ep is freed once UCX is done with it. */
void ulink_ep_close(struct ulink_ep *ep, bool flush);

/* Sends one frame: head (head_len bytes: preamble || header || tag, kept
 * valid by the caller until done) and payload (len bytes, valid until
 * done). done(arg, status) runs exactly once: before this returns when the
 * send completed at once, else from a later ulink_progress. Returns 0, or a
 * negative errno (done has then not run). */
int ulink_send(struct ulink_ep *ep, const void *head, size_t head_len, const void *payload,
               uint64_t len, ulink_done_fn done, void *arg);
/* Moves rx's payload into dst (rx->len bytes) and frees rx; done runs
 * exactly once (perhaps before this returns). Returns 0 or a negative
 * errno (done has then not run; rx is freed either way). */
int ulink_rx_take(struct ulink *u, struct ulink_rx *rx, void *dst, ulink_done_fn done, void *arg);
/* After taking the data of an rx with long_head into buf (len bytes,
 * malloc'd; ownership passes): the same frame as an eager rx whose head is
 * buf's first head_len bytes. NULL when out of memory or head_len > len (buf
 * is freed). */
struct ulink_rx *ulink_rx_from_buffer(struct ulink_ep *ep, uint8_t *buf, uint64_t len,
                                      uint32_t head_len);
/* Frees rx, dropping a payload not taken. NULL is fine. */
void ulink_rx_free(struct ulink *u, struct ulink_rx *rx);

/* The largest head that travels in the AM header (larger ones go in the
 * data, above). */
size_t ulink_max_head(const struct ulink *u);

/* Counters (thread-safe snapshot). */
struct ulink_stats {
  uint64_t frames_out, frames_in, bytes_out, bytes_in, rndv_in, reordered;
};
void ulink_stats(struct ulink *u, struct ulink_stats *out);

#endif
