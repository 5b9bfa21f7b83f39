/* listener: opening a listening socket on a libuv loop (see listener.h).
 *
 * The resolution is synchronous (uv_getaddrinfo without a callback): a
 * server resolves its own address once, before its loop runs, and wants the
 * failure reported there. Its result is freed before returning whatever
 * happens; the first address it yields is the one bound, as AI_PASSIVE with
 * AF_UNSPEC orders them. */
#include "listener.h"

#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>

#include "net.h"

/* Sets the failed step and its reason. */
static int fail(struct listener_error *err, enum listener_step step, int code) {
  err->step = step;
  if (err->reason && err->reason_len)
    snprintf(err->reason, err->reason_len, "%s", uv_strerror(code));
  return code;
}

/* "ip:port" or "[ip6]:port" of what tcp is bound to. */
static void format_bound(uv_tcp_t *tcp, char *bound, size_t boundlen) {
  struct sockaddr_storage ss;
  int len = sizeof(ss);
  char ip[INET6_ADDRSTRLEN] = "";
  memset(&ss, 0, sizeof(ss));
  uv_tcp_getsockname(tcp, (struct sockaddr *)&ss, &len);
  if (ss.ss_family == AF_INET6) {
    uv_ip6_name((struct sockaddr_in6 *)&ss, ip, sizeof(ip));
    snprintf(bound, boundlen, "[%s]:%d", ip, ntohs(((struct sockaddr_in6 *)&ss)->sin6_port));
  } else {
    uv_ip4_name((struct sockaddr_in *)&ss, ip, sizeof(ip));
    snprintf(bound, boundlen, "%s:%d", ip, ntohs(((struct sockaddr_in *)&ss)->sin_port));
  }
}

int listener_open(uv_loop_t *loop, uv_tcp_t *tcp, const char *addr, int backlog,
                  uv_connection_cb on_connection, char *bound, size_t boundlen,
                  struct listener_error *err) {
  struct net_addr a;
  err->host[0] = 0;
  int r = net_parse_addr(addr, &a, 1, err->reason, err->reason_len);
  if (r < 0) {
    err->step = LISTENER_PARSE;
    return r;
  }
  snprintf(err->host, sizeof(err->host), "%s", a.host);
  char port[8];
  snprintf(port, sizeof(port), "%u", a.port);
  struct addrinfo hints = {
      .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
  uv_getaddrinfo_t gai;
  r = uv_getaddrinfo(loop, &gai, NULL, a.host, port, &hints);
  if (r < 0) return fail(err, LISTENER_RESOLVE, r);
  r = uv_tcp_init(loop, tcp);
  if (r == 0) r = uv_tcp_bind(tcp, gai.addrinfo->ai_addr, 0);
  uv_freeaddrinfo(gai.addrinfo);
  if (r == 0) r = uv_listen((uv_stream_t *)tcp, backlog, on_connection);
  if (r < 0) return fail(err, LISTENER_LISTEN, r);
  format_bound(tcp, bound, boundlen);
  return 0;
}

static void close_any(uv_handle_t *h, void *arg) {
  (void)arg;
  if (!uv_is_closing(h)) uv_close(h, NULL);
}

void listener_close_loop(uv_loop_t *loop) {
  uv_walk(loop, close_any, NULL);
  uv_run(loop, UV_RUN_DEFAULT);
  uv_loop_close(loop);
}
