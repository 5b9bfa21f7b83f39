/* net: address parsing, resolve-and-connect with backoff, and blocking
 * full-length I/O.
 *
 * net_connect is written for Kubernetes start-up, where a peer's DNS name may
 * not resolve for many seconds and its port may refuse until it listens: every
 * failure (resolve or connect) is retried with a wait that starts at
 * initial_ms, doubles up to max_ms and gets up to 25% random jitter so a
 * restarted fleet does not reconnect in lockstep. Each round resolves again,
 * because a restarted pod comes back with a new IP. The connect itself is
 * non-blocking under poll so one attempt never outlives the deadline (or
 * ATTEMPT_MAX_MS), instead of waiting out the kernel's two-minute SYN timeout
 * on a dead address. A name that never resolves ends in -EHOSTUNREACH (or
 * -ENOMEM / the system errno), a refused port in -ECONNREFUSED.
 *
 * Socket buffers are left to the kernel on purpose: setting SO_SNDBUF or
 * SO_RCVBUF turns off autotuning, and a buffer shrunk to a small first message
 * stalls every later large transfer on delayed ACKs (Gloo's bug).
 *
 * The write helpers use send/sendmsg with MSG_NOSIGNAL, so a peer that went
 * away yields -EPIPE to the caller rather than killing the process with
 * SIGPIPE; on a non-socket fd (a pipe in a test) they fall back to
 * write/writev. */
#include "clock.h"
#include "errbuf.h"
#include "net.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* Bounds on how long one connect waits for the handshake; the floor keeps
 * the last try before the deadline from being a zero-length poll. */
enum { ATTEMPT_MAX_MS = 10000, ATTEMPT_MIN_MS = 100 };

/* Parses a decimal port: digits only, so "+80", " 80" and "80x" are refused. */
static int parse_port(const char *s, int allow_port0, uint16_t *out, char *why, size_t n) {
  size_t len = strlen(s);
  unsigned long v = 0;
  if (len == 0) return errbuf_set(-EINVAL, why, n, "missing port after ':'");
  for (size_t i = 0; i < len; i++) {
    if (!isdigit((unsigned char)s[i])) {
      return errbuf_set(-EINVAL, why, n, "port \"%.32s\" is not a number", s);
    }
    if (v <= 65535) v = v * 10 + (unsigned long)(s[i] - '0');
  }
  if (v > 65535 || (v == 0 && !allow_port0)) {
    return errbuf_set(-EINVAL, why, n, "port %.32s is out of range %d..65535", s,
                      allow_port0 ? 0 : 1);
  }
  *out = (uint16_t)v;
  return 0;
}

int net_parse_addr(const char *s, struct net_addr *addr, int allow_port0, char *err,
                   size_t errlen) {
  struct net_addr a;
  const char *host, *port;
  size_t hostlen;
  char why[128];

  if (!s || !s[0]) return errbuf_set(-EINVAL, err, errlen, "empty address (want host:port)");
  if (s[0] == '[') {
    const char *close = strchr(s, ']');
    if (!close) return errbuf_set(-EINVAL, err, errlen, "address \"%.300s\": missing ']'", s);
    host = s + 1;
    hostlen = (size_t)(close - host);
    if (hostlen == 0) return errbuf_set(-EINVAL, err, errlen, "address \"%.300s\": empty []", s);
    if (close[1] != ':') {
      return errbuf_set(-EINVAL, err, errlen, "address \"%.300s\": expected ':port' after ']'", s);
    }
    port = close + 2;
  } else {
    const char *colon = strrchr(s, ':');
    if (!colon) return errbuf_set(-EINVAL, err, errlen, "address \"%.300s\": missing ':port'", s);
    host = s;
    hostlen = (size_t)(colon - s);
    if (memchr(host, ':', hostlen)) {
      return errbuf_set(-EINVAL, err, errlen,
                        "address \"%.300s\": an IPv6 address needs brackets, e.g. [::1]:7070", s);
    }
    port = colon + 1;
  }
  if (hostlen >= sizeof(a.host)) {
    return errbuf_set(-EINVAL, err, errlen, "address \"%.64s...\": host is longer than %zu bytes",
                      s, sizeof(a.host) - 1);
  }
  for (size_t i = 0; i < hostlen; i++) {
    unsigned char c = (unsigned char)host[i];
    if (c <= ' ' || c == 0x7f || c == '[' || c == ']' || c == ',') {
      return errbuf_set(-EINVAL, err, errlen, "address \"%.300s\": bad character in host", s);
    }
  }
  if (parse_port(port, allow_port0, &a.port, why, sizeof(why)) != 0) {
    return errbuf_set(-EINVAL, err, errlen, "address \"%.300s\": %s", s, why);
  }
  if (hostlen == 0) {
    snprintf(a.host, sizeof(a.host), "0.0.0.0");
  } else {
    memcpy(a.host, host, hostlen);
    a.host[hostlen] = '\0';
  }
  *addr = a;
  return 0;
}

/* Elements are numbered from 0, like the {i} of the templates. Spaces around
 * an element are ignored, so "a:1, b:2" is accepted. */
int net_listen_addr_check(const char *value, char *err, size_t errlen) {
  struct net_addr a;
  char why[512];
  int r = net_parse_addr(value, &a, 1, why, sizeof(why));
  if (r == 0) return 0;
  /* net_parse_addr says 'address "V": reason'; the caller names V already. */
  const char *reason = why;
  if (strncmp(why, "address \"", 9) == 0 && strstr(why, "\": ")) reason = strstr(why, "\": ") + 3;
  snprintf(err, errlen, "%s", reason);
  return r;
}

int net_listen_addr_or_empty_check(const char *value, char *err, size_t errlen) {
  return value[0] ? net_listen_addr_check(value, err, errlen) : 0;
}

int net_parse_addr_list(const char *s, struct net_addr *addrs, int max, char *err, size_t errlen) {
  int count = 0;
  const char *p = s;
  if (max <= 0) return errbuf_set(-EINVAL, err, errlen, "address list: no room for any address");
  if (!s) return errbuf_set(-EINVAL, err, errlen, "empty address list");
  while (isspace((unsigned char)*p)) p++;
  if (!*p) return errbuf_set(-EINVAL, err, errlen, "empty address list");
  for (int idx = 0;; idx++) {
    const char *comma = strchr(p, ',');
    size_t len = comma ? (size_t)(comma - p) : strlen(p);
    char elem[sizeof(addrs->host) + 16], why[512];
    while (len > 0 && isspace((unsigned char)p[0])) {
      p++;
      len--;
    }
    while (len > 0 && isspace((unsigned char)p[len - 1])) len--;
    if (len == 0) {
      return errbuf_set(-EINVAL, err, errlen, "address list \"%.200s\": element %d is empty", s,
                        idx);
    }
    if (idx >= max) {
      return errbuf_set(-EINVAL, err, errlen, "address list \"%.200s\": more than %d addresses", s,
                        max);
    }
    if (len >= sizeof(elem)) {
      return errbuf_set(-EINVAL, err, errlen, "address list: element %d (\"%.64s...\") is too long",
                        idx, p);
    }
    memcpy(elem, p, len);
    elem[len] = '\0';
    if (net_parse_addr(elem, &addrs[idx], 0, why, sizeof(why)) != 0) {
      return errbuf_set(-EINVAL, err, errlen, "address list element %d: %s", idx, why);
    }
    count++;
    if (!comma) break;
    p = comma + 1;
  }
  return count;
}

int net_expand_template(const char *tmpl, int i, char *out, size_t outlen) {
  const char *at = tmpl ? strstr(tmpl, "{i}") : NULL;
  if (!at || !out || strstr(at + 3, "{i}")) return -EINVAL;
  int n = snprintf(out, outlen, "%.*s%d%s", (int)(at - tmpl), tmpl, i, at + 3);
  if (n < 0 || (size_t)n >= outlen) {
    if (outlen > 0) out[0] = '\0'; /* never hand back a cut host name */
    return -EINVAL;
  }
  return 0;
}

int net_tune_socket(int fd) {
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) return -errno;
  if (setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one)) != 0) return -errno;
#ifdef TCP_KEEPIDLE
  /* The default two hours of idle before the first probe would leave a
   * blocked read on a vanished peer (node gone, no RST) hanging for hours;
   * these find it in about two minutes. Best effort: the defaults still work. */
  int idle = 60, intvl = 10, cnt = 6;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
#endif
  return 0;
}

int net_listen(const struct net_addr *addr, int backlog, char *err, size_t errlen) {
  struct addrinfo hints = {
      .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
  struct addrinfo *res = NULL;
  char port[8];
  snprintf(port, sizeof(port), "%u", (unsigned)addr->port);
  int g = getaddrinfo(addr->host, port, &hints, &res);
  if (g != 0)
    return errbuf_set(-EADDRNOTAVAIL, err, errlen, "listen %s:%s: %s", addr->host, port,
                      gai_strerror(g));
  int rc = -EADDRNOTAVAIL;
  for (const struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      rc = -errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)); /* restart within TIME_WAIT */
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, backlog) == 0) {
      freeaddrinfo(res);
      return fd;
    }
    rc = -errno;
    close(fd);
  }
  freeaddrinfo(res);
  return errbuf_set(rc, err, errlen, "listen %s:%s: %s", addr->host, port, strerror(-rc));
}

int net_bound_port(int fd) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof(ss);
  if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0) return -errno;
  if (ss.ss_family == AF_INET) return ntohs(((struct sockaddr_in *)&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
  return -EAFNOSUPPORT;
}

int net_accept(int listen_fd, char *peer, size_t peerlen) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof(ss);
  int fd;
  do fd = accept4(listen_fd, (struct sockaddr *)&ss, &len, SOCK_CLOEXEC);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) return -errno;
  if (peer && peerlen) {
    char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
    getnameinfo((struct sockaddr *)&ss, len, host, sizeof(host), serv, sizeof(serv),
                NI_NUMERICHOST | NI_NUMERICSERV);
    snprintf(peer, peerlen, strchr(host, ':') ? "[%s]:%s" : "%s:%s", host, serv);
  }
  int rc = net_tune_socket(fd);
  if (rc) {
    close(fd);
    return rc;
  }
  return fd;
}

int net_set_nonblocking(int fd, int on) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0) return -errno;
  flags = on ? flags | O_NONBLOCK : flags & ~O_NONBLOCK;
  return fcntl(fd, F_SETFL, flags) < 0 ? -errno : 0;
}

int net_set_user_timeout(int fd, int ms) {
#ifdef TCP_USER_TIMEOUT
  unsigned v = ms > 0 ? (unsigned)ms : 0;
  if (setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &v, sizeof(v)) != 0) return -errno;
#endif
  return 0;
}

int net_set_keepalive(int fd, int idle_s, int intvl_s, int count) {
  int on = 1;
  if (setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof(on)) != 0) return -errno;
  if (setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s)) != 0) return -errno;
  if (setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl_s, sizeof(intvl_s)) != 0) return -errno;
  if (setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count)) != 0) return -errno;
  return 0;
}

/* Connects one resolved address, waiting at most timeout_ms for the
 * handshake. Returns a blocking, tuned fd or a negative errno. */
static int connect_one(const struct addrinfo *ai, int timeout_ms) {
  int rc;
  int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
  if (fd < 0) return -errno;
  if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    /* EINTR on connect also means "still in progress" (POSIX). */
    if (errno != EINPROGRESS && errno != EINTR) {
      rc = -errno;
      goto fail;
    }
    uint64_t end = clock_now_ns() + (uint64_t)timeout_ms * 1000000u;
    for (;;) {
      struct pollfd pfd = {.fd = fd, .events = POLLOUT};
      uint64_t now = clock_now_ns();
      int wait = now >= end ? 0 : (int)((end - now + 999999u) / 1000000u);
      int n = poll(&pfd, 1, wait);
      if (n > 0) break;
      if (n == 0) {
        rc = -ETIMEDOUT;
        goto fail;
      }
      if (errno != EINTR) {
        rc = -errno;
        goto fail;
      }
    }
    int soerr = 0;
    socklen_t sl = sizeof(soerr);
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0) soerr = errno;
    if (soerr != 0) {
      rc = -soerr;
      goto fail;
    }
  }
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) < 0) {
    rc = -errno;
    goto fail;
  }
  rc = net_tune_socket(fd);
  if (rc) goto fail;
  return fd;
fail:
  close(fd);
  return rc;
}

/* One round: resolve, then try each address in the order the resolver gave. */
static int connect_round(const struct net_addr *addr, int timeout_ms, char *err, size_t errlen) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
  struct addrinfo *res = NULL;
  char port[8];
  snprintf(port, sizeof(port), "%u", (unsigned)addr->port);
  hints.ai_flags = AI_NUMERICSERV;
  int g = getaddrinfo(addr->host, port, &hints, &res);
  if (g != 0) {
    int code = g == EAI_SYSTEM   ? (errno ? -errno : -EIO)
               : g == EAI_MEMORY ? -ENOMEM
                                 : -EHOSTUNREACH;
    return errbuf_set(code, err, errlen, "resolve %s: %s", addr->host,
                      g == EAI_SYSTEM ? strerror(-code) : gai_strerror(g));
  }
  int rc = -EHOSTUNREACH;
  for (const struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    rc = connect_one(ai, timeout_ms);
    if (rc >= 0) break;
    char ip[NI_MAXHOST] = "?";
    getnameinfo(ai->ai_addr, ai->ai_addrlen, ip, sizeof(ip), NULL, 0, NI_NUMERICHOST);
    errbuf_set(rc, err, errlen, "connect %s:%s (%s): %s", addr->host, port, ip, strerror(-rc));
  }
  freeaddrinfo(res);
  return rc;
}

int net_connect(const struct net_addr *addr, const struct net_backoff *bo, char *err,
                size_t errlen) {
  struct net_backoff b = bo ? *bo : (struct net_backoff){50, 2000, 0};
  if (b.initial_ms <= 0) b.initial_ms = 50;
  if (b.max_ms <= 0) b.max_ms = 2000;
  if (b.max_ms < b.initial_ms) b.max_ms = b.initial_ms;

  uint64_t start = clock_now_ns();
  uint64_t rng = start ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&start;
  int64_t delay = b.initial_ms, elapsed = 0;
  int attempts = 0, rc;
  for (;;) {
    int timeout = ATTEMPT_MAX_MS;
    if (b.deadline_ms > 0) {
      int64_t left = b.deadline_ms - elapsed;
      if (left < timeout) timeout = left < ATTEMPT_MIN_MS ? ATTEMPT_MIN_MS : (int)left;
    }
    attempts++;
    rc = connect_round(addr, timeout, err, errlen);
    if (rc >= 0) return rc;
    elapsed = (int64_t)((clock_now_ns() - start) / 1000000u);
    if (b.deadline_ms == 0 || (b.deadline_ms > 0 && elapsed >= b.deadline_ms)) break;

    /* xorshift64: jitter only needs to differ between processes, not be good. */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    int64_t wait = delay + (int64_t)(rng % (uint64_t)(delay / 4 + 1));
    if (b.deadline_ms > 0 && wait > b.deadline_ms - elapsed) wait = b.deadline_ms - elapsed;
    clock_sleep_ms(wait);
    elapsed = (int64_t)((clock_now_ns() - start) / 1000000u);
    delay = delay * 2 > b.max_ms ? b.max_ms : delay * 2;
  }
  if (err && errlen > 0 && attempts > 1) {
    size_t len = strnlen(err, errlen);
    snprintf(err + len, errlen - len, " (gave up after %d attempts in %lld ms)", attempts,
             (long long)elapsed);
  }
  return rc;
}

int net_write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
    if (n < 0 && errno == ENOTSOCK) n = write(fd, p, len);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

int net_writev_all(int fd, struct iovec *iov, int iovcnt) {
  while (iovcnt > 0) {
    if (iov->iov_len == 0) {
      iov++;
      iovcnt--;
      continue;
    }
    /* The kernel refuses more than IOV_MAX entries at once (EMSGSIZE). */
    struct msghdr msg = {.msg_iov = iov,
                         .msg_iovlen = (size_t)(iovcnt < IOV_MAX ? iovcnt : IOV_MAX)};
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0 && errno == ENOTSOCK) n = writev(fd, iov, (int)msg.msg_iovlen);
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    size_t left = (size_t)n;
    while (iovcnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      iov++;
      iovcnt--;
    }
    if (left > 0) {
      iov->iov_base = (char *)iov->iov_base + left;
      iov->iov_len -= left;
    }
  }
  return 0;
}

int net_read_all(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len > 0) {
    ssize_t n = read(fd, p, len);
    if (n == 0) return -ECONNRESET; /* EOF mid-message: the peer is gone */
    if (n < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}
