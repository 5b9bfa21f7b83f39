/* listener: a listening TCP socket on a libuv loop, and the end of that loop.
 *
 * The two libuv servers of the tree (the shard's loop in ps-server/server.c,
 * the HTTP thread in common/http.c) open their listening socket the same
 * way: an address "host:port" as net.h parses it (port 0 picks a free one),
 * resolved with uv_getaddrinfo as a passive address, bound and listened on
 * with the caller's backlog and connection callback. What was bound is
 * reported as "host:port" ("[v6]:port" for IPv6) for logs and port files.
 * The handle stays the caller's: it lives inside the caller's struct, its
 * connection callback recovers that struct with container_of, and the
 * caller closes it.
 *
 * Errors are not worded here. Each caller has its own messages (the shard
 * logs logfmt lines naming its flag, http.c writes a sentence into its
 * caller's buffer), so a failure reports the step that failed, the host
 * and a reason text, and the caller formats them.
 *
 * Both servers also end their loop the same way, closing whatever handle is
 * still open and running the loop until every close callback has run:
 * listener_close_loop. Neither function keeps state; the module is named
 * for its main job, the libuv counterpart of net.h's blocking net_listen. */
#ifndef PS_LISTENER_H
#define PS_LISTENER_H

#include <stddef.h>
#include <uv.h>

/* The step listener_open failed at. */
enum listener_step {
  LISTENER_PARSE,   /* the address is not "host:port" (net_parse_addr) */
  LISTENER_RESOLVE, /* uv_getaddrinfo failed */
  LISTENER_LISTEN,  /* uv_tcp_init, uv_tcp_bind or uv_listen failed */
};

/* What a failed listener_open reports; the caller points reason at its own
 * buffer, so each caller keeps the length its messages always had. */
struct listener_error {
  enum listener_step step;
  char host[256]; /* the host part of the address ("" if it did not parse) */
  char *reason;   /* in: caller's buffer; out: net_parse_addr's message, else uv_strerror */
  size_t reason_len;
};

/* Parses addr, resolves it, initialises tcp on loop, binds it and listens
 * with backlog and on_connection. On success writes the bound address into
 * bound ("host:port", "[v6]:port") and returns 0. On failure returns the
 * negative errno (net_parse_addr's -EINVAL or libuv's UV_E* code) and fills
 * err. tcp is initialised on loop once the address resolved, whatever the
 * result after that: the caller closes it (uv_close, or
 * listener_close_loop). */
int listener_open(uv_loop_t *loop, uv_tcp_t *tcp, const char *addr, int backlog,
                  uv_connection_cb on_connection, char *bound, size_t boundlen,
                  struct listener_error *err);

/* Closes every handle still open on loop (with a NULL close callback: only
 * for handles whose memory outlives the loop), runs the loop until their
 * close callbacks have run, then closes the loop. */
void listener_close_loop(uv_loop_t *loop);

#endif
