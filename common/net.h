/* net: the only place that knows socket details (addresses, options,
 * resolve-and-connect with capped exponential backoff). Used by the blocking
 * client side (libps, tools); the server's listening socket is libuv's.
 *
 * Addresses are "host:port", "[v6]:port" or ":port" (= 0.0.0.0). Port 0 is
 * allowed only where listening. */
#ifndef PS_NET_H
#define PS_NET_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h> /* struct iovec */

struct net_addr {
  char host[256];
  uint16_t port;
};

/* Parses "host:port" into addr; returns 0 or -EINVAL (message in err). */
int net_parse_addr(const char *s, struct net_addr *addr, int allow_port0, char *err, size_t errlen);

/* Option-table checks (config_check_fn) of an address to listen on:
 * "host:port" as net_parse_addr takes it, port 0 allowed; the _or_empty
 * variant also takes "" (= off, or the default). The reason in err leaves
 * out the value, which config.c prints itself. */
int net_listen_addr_check(const char *value, char *err, size_t errlen);
int net_listen_addr_or_empty_check(const char *value, char *err, size_t errlen);

/* Splits a comma-separated list "h:p,h:p" into at most max addresses; returns
 * the count (>= 1) or -EINVAL with a message naming the bad element. */
int net_parse_addr_list(const char *s, struct net_addr *addrs, int max, char *err, size_t errlen);

/* Expands a template containing "{i}" once, e.g. "ps-server-{i}.ps-server:7070". */
int net_expand_template(const char *tmpl, int i, char *out, size_t outlen);

struct net_backoff {
  int initial_ms;  /* first wait (default 50) */
  int max_ms;      /* cap of one wait (default 2000) */
  int deadline_ms; /* give up after this long in total; 0 = try once; -1 = forever */
};

/* Resolves and connects (blocking TCP, TCP_NODELAY on, kernel-sized buffers),
 * retrying with exponential backoff with jitter (DNS that does not resolve yet
 * and refused connections both retry). Returns the fd or a negative errno;
 * err gets the last reason. */
int net_connect(const struct net_addr *addr, const struct net_backoff *bo, char *err,
                size_t errlen);

/* Full-length blocking I/O helpers that retry EINTR and short counts.
 * Return 0, or a negative errno (-EPIPE / -ECONNRESET; read: 0 bytes at EOF = -ECONNRESET). */
int net_write_all(int fd, const void *buf, size_t len);
int net_writev_all(int fd, struct iovec *iov, int iovcnt); /* may modify iov */
int net_read_all(int fd, void *buf, size_t len);

/* Sets TCP_NODELAY (and SO_KEEPALIVE). */
int net_tune_socket(int fd);

/* Binds and listens on addr (port 0 = any free port) with SO_REUSEADDR and
 * close-on-exec. Returns the fd or a negative errno; err says what failed. */
int net_listen(const struct net_addr *addr, int backlog, char *err, size_t errlen);
/* The local port a socket is bound to, or a negative errno. */
int net_bound_port(int fd);
/* Accepts one connection (close-on-exec, blocking, tuned like net_connect's)
 * and writes the peer as "ip:port" into peer. Returns the fd or a negative errno. */
int net_accept(int listen_fd, char *peer, size_t peerlen);
/* O_NONBLOCK on (on != 0) or off. */
int net_set_nonblocking(int fd, int on);
/* TCP_USER_TIMEOUT: unacknowledged data for this long breaks the connection
 * (a peer that vanished without a FIN or RST is noticed in bounded time). */
int net_set_user_timeout(int fd, int ms);

/* TCP keepalive: probes after idle_s seconds of silence, every intvl_s,
 * and the connection breaks after count unanswered probes. */
int net_set_keepalive(int fd, int idle_s, int intvl_s, int count);

#endif
