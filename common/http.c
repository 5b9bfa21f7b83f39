/* http: the HTTP thread (see http.h).
 *
 * A connection moves READING -> RESPONDING -> closed:
 *
 *   READING  --head complete--> handler runs, response queued --> RESPONDING
 *      |  --head too big / malformed / timeout--> error response --> RESPONDING
 *   RESPONDING: the write completes, the write side is shut down, and what
 *      the client still sends is read and dropped until it hangs up or a
 *      short linger timer fires (closing with unread bytes would reset the
 *      connection and could destroy the response before the client read it).
 *
 * Each connection owns two handles (the socket and its timer); its memory is
 * freed in the close callback of the second. The response (head and body in
 * one malloc'd buffer built with open_memstream) lives until its write
 * callback. */
#include "http.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include "container_of.h"
#include "listener.h"

#define LINGER_MS 1000

enum http_conn_state { HTTP_CONN_READING, HTTP_CONN_RESPONDING, HTTP_CONN_CLOSING };

struct http_conn {
  uv_tcp_t tcp;
  uv_timer_t timer;
  uv_write_t wr;
  uv_shutdown_t sd;
  struct http_server *h;
  struct http_conn *prev, *next;
  enum http_conn_state state;
  int open_handles;
  char *resp;
  size_t len;
  char req[HTTP_MAX_REQUEST];
};

struct http_server {
  uv_loop_t loop;
  uv_tcp_t listener;
  uv_async_t stop;
  pthread_t thread;
  bool thread_started;
  struct http_route *routes;
  size_t num_routes;
  struct http_conn *conns;
  size_t num_conns;
  int timeout_ms;
  char addr[300];
};

static const char *reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 503:
      return "Service Unavailable";
  }
  return "Unknown";
}

/* ---- closing -------------------------------------------------------------- */

static void on_handle_closed(uv_handle_t *handle) {
  struct http_conn *c = handle->data;
  if (--c->open_handles > 0) return;
  free(c->resp);
  free(c);
}

static void http_conn_close(struct http_conn *c) {
  if (c->state == HTTP_CONN_CLOSING) return;
  c->state = HTTP_CONN_CLOSING;
  struct http_server *h = c->h;
  if (c->prev)
    c->prev->next = c->next;
  else if (h->conns == c)
    h->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  h->num_conns--;
  uv_close((uv_handle_t *)&c->tcp, on_handle_closed);
  uv_close((uv_handle_t *)&c->timer, on_handle_closed);
}

static void on_shutdown(uv_shutdown_t *req, int status) {
  struct http_conn *c = container_of(req, struct http_conn, sd);
  if (status < 0) http_conn_close(c);
}

static void on_write(uv_write_t *req, int status) {
  struct http_conn *c = container_of(req, struct http_conn, wr);
  free(c->resp);
  c->resp = NULL;
  if (c->state != HTTP_CONN_RESPONDING) return;
  if (status < 0 || uv_shutdown(&c->sd, (uv_stream_t *)&c->tcp, on_shutdown) < 0)
    http_conn_close(c);
}

static void on_request_timeout(uv_timer_t *t);

/* ---- responding ----------------------------------------------------------- */

/* Queues status + body (body_len bytes, may be NULL) and enters RESPONDING. */
static void respond(struct http_conn *c, int status, const char *content_type, const char *extra,
                    const char *body, size_t body_len, bool head_only) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  if (!f) {
    http_conn_close(c);
    return;
  }
  fprintf(f,
          "HTTP/1.0 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
          "Cache-Control: no-store\r\nConnection: close\r\n%s\r\n",
          status, reason(status), content_type, body_len, extra ? extra : "");
  if (body_len && !head_only) fwrite(body, 1, body_len, f);
  if (fclose(f) != 0) {
    free(buf);
    http_conn_close(c);
    return;
  }
  c->state = HTTP_CONN_RESPONDING;
  c->resp = buf;
  uv_timer_start(&c->timer, on_request_timeout, LINGER_MS + (uint64_t)c->h->timeout_ms, 0);
  uv_buf_t b = uv_buf_init(buf, (unsigned)len);
  if (uv_write(&c->wr, (uv_stream_t *)&c->tcp, &b, 1, on_write) < 0) http_conn_close(c);
}

static void respond_text(struct http_conn *c, int status, const char *extra, const char *text) {
  respond(c, status, "text/plain; charset=utf-8", extra, text, strlen(text), false);
}

/* Runs the route's handler into a memory stream. */
static void respond_route(struct http_conn *c, const struct http_route *r, bool head_only) {
  char *body = NULL;
  size_t len = 0;
  const char *ctype = "text/plain; charset=utf-8";
  FILE *f = open_memstream(&body, &len);
  if (!f) {
    respond_text(c, 500, NULL, "out of memory\n");
    return;
  }
  int status = r->fn(r->arg, f, &ctype);
  if (fclose(f) != 0 || status < 100 || status > 599) {
    free(body);
    respond_text(c, 500, NULL, "handler failed\n");
    return;
  }
  respond(c, status, ctype, NULL, body, len, head_only);
  free(body);
}

/* The head is complete (req[0..len) holds at least the request line). */
static void handle_request(struct http_conn *c) {
  char *line_end = memchr(c->req, '\n', c->len);
  if (!line_end) {
    respond_text(c, 400, NULL, "bad request line\n");
    return;
  }
  *line_end = 0;
  if (line_end > c->req && line_end[-1] == '\r') line_end[-1] = 0;
  /* METHOD SP target SP HTTP/1.x, single spaces, no empty field */
  char *method = c->req;
  char *sp1 = strchr(method, ' ');
  char *target = sp1 ? sp1 + 1 : NULL;
  char *sp2 = target ? strchr(target, ' ') : NULL;
  char *version = sp2 ? sp2 + 1 : NULL;
  if (!sp2 || sp1 == method || sp2 == target || strchr(version, ' ') ||
      strncmp(version, "HTTP/1.", 7) != 0 || strlen(version) != 8 || target[0] != '/') {
    respond_text(c, 400, NULL, "bad request line\n");
    return;
  }
  *sp1 = *sp2 = 0;
  bool head = strcmp(method, "HEAD") == 0;
  if (!head && strcmp(method, "GET") != 0) {
    respond_text(c, 405, "Allow: GET, HEAD\r\n", "only GET and HEAD\n");
    return;
  }
  target[strcspn(target, "?#")] = 0;
  for (size_t i = 0; i < c->h->num_routes; i++) {
    if (strcmp(c->h->routes[i].path, target) == 0) {
      respond_route(c, &c->h->routes[i], head);
      return;
    }
  }
  respond_text(c, 404, NULL, "not found\n");
}

/* ---- reading -------------------------------------------------------------- */

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *buf) {
  struct http_conn *c = handle->data;
  (void)suggested;
  if (c->state == HTTP_CONN_READING)
    *buf = uv_buf_init(c->req + c->len, (unsigned)(sizeof(c->req) - c->len));
  else /* RESPONDING: drain into the request buffer, which is no longer needed */
    *buf = uv_buf_init(c->req, sizeof(c->req));
}

static bool head_complete(const char *p, size_t n) {
  for (size_t i = 0; i + 1 < n; i++) {
    if (p[i] != '\n') continue;
    if (p[i + 1] == '\n') return true;
    if (i + 2 < n && p[i + 1] == '\r' && p[i + 2] == '\n') return true;
  }
  return false;
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf) {
  struct http_conn *c = stream->data;
  (void)buf;
  if (c->state == HTTP_CONN_CLOSING) return;
  if (nread < 0) {
    /* EOF while reading the head: the client gave up; no one to answer */
    http_conn_close(c);
    return;
  }
  if (c->state != HTTP_CONN_READING || nread == 0) return;
  size_t old = c->len;
  c->len += (size_t)nread;
  /* look from 3 bytes before the new data: the blank line may straddle reads */
  size_t from = old > 3 ? old - 3 : 0;
  if (head_complete(c->req + from, c->len - from)) {
    handle_request(c);
  } else if (c->len == sizeof(c->req)) {
    respond_text(c, 431, NULL, "request head too large\n");
  }
}

static void on_request_timeout(uv_timer_t *t) {
  struct http_conn *c = t->data;
  if (c->state == HTTP_CONN_READING)
    respond_text(c, 408, NULL, "request timeout\n");
  else
    http_conn_close(c);
}

/* Whether the kernel holds bytes c has not read yet: a probe accepted in the
 * same burst as a flood has sent its request, but libuv reads it only on the
 * next loop iteration. */
static bool has_unread(struct http_conn *c) {
  uv_os_fd_t fd;
  char b;
  return uv_fileno((uv_handle_t *)&c->tcp, &fd) == 0 &&
         recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
}

/* The connection to close when a new one c arrives at the cap, as nginx
 * reuses its idle keep-alive connections first: the oldest that is still
 * READING and has sent nothing at all, else the oldest still READING (a
 * slow or stalled head), else the oldest whose response was written and
 * that only lingers. A client that sends its request at once (a kubelet
 * probe, a scraper) is therefore never the one pushed out by a flood of
 * idle connections. NULL when every other connection is being answered: c
 * is then closed instead. The list runs from the newest to the oldest, so
 * the last match is the oldest. */
static struct http_conn *pick_victim(struct http_server *h, struct http_conn *c) {
  struct http_conn *idle = NULL, *reading = NULL, *lingering = NULL;
  for (struct http_conn *p = h->conns; p; p = p->next) {
    if (p == c) continue;
    if (p->state == HTTP_CONN_READING) {
      reading = p;
      if (p->len == 0 && !has_unread(p)) idle = p;
    } else if (p->state == HTTP_CONN_RESPONDING && !p->resp) {
      lingering = p;
    }
  }
  return idle ? idle : reading ? reading : lingering;
}

static void on_connection(uv_stream_t *listener, int status) {
  struct http_server *h = container_of((uv_tcp_t *)listener, struct http_server, listener);
  if (status < 0) return;
  struct http_conn *c = malloc(sizeof(*c));
  if (!c) return;
  memset(c, 0, offsetof(struct http_conn, req));
  c->h = h;
  c->state = HTTP_CONN_READING;
  uv_tcp_init(&h->loop, &c->tcp);
  uv_timer_init(&h->loop, &c->timer);
  c->tcp.data = c->timer.data = c;
  c->open_handles = 2;
  c->next = h->conns;
  if (h->conns) h->conns->prev = c;
  h->conns = c;
  h->num_conns++;
  if (uv_accept(listener, (uv_stream_t *)&c->tcp) < 0) {
    http_conn_close(c);
    return;
  }
  if (h->num_conns > HTTP_MAX_CONNS) {
    struct http_conn *victim = pick_victim(h, c);
    http_conn_close(victim ? victim : c);
    if (!victim) return;
  }
  uv_timer_start(&c->timer, on_request_timeout, (uint64_t)h->timeout_ms, 0);
  if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) < 0) http_conn_close(c);
}

/* ---- thread, start, stop -------------------------------------------------- */

static void on_stop(uv_async_t *a) {
  struct http_server *h = a->data;
  uv_close((uv_handle_t *)&h->listener, NULL);
  while (h->conns) http_conn_close(h->conns);
  uv_close((uv_handle_t *)&h->stop, NULL);
}

static void *http_main(void *arg) {
  struct http_server *h = arg;
  uv_run(&h->loop, UV_RUN_DEFAULT);
  return NULL;
}

/* Binds h->listener, with http.c's wording of what went wrong. */
static int bind_listener(struct http_server *h, const char *listen, char *err, size_t errlen) {
  char why[512];
  struct listener_error e = {.reason = why, .reason_len = sizeof(why)};
  int r = listener_open(&h->loop, &h->listener, listen, 128, on_connection, h->addr,
                        sizeof(h->addr), &e);
  if (r == 0) return 0;
  if (e.step == LISTENER_PARSE)
    snprintf(err, errlen, "%s", why);
  else if (e.step == LISTENER_RESOLVE)
    snprintf(err, errlen, "cannot resolve \"%s\": %s", e.host, why);
  else
    snprintf(err, errlen, "cannot listen on %s: %s", listen, why);
  return r;
}

static void server_free(struct http_server *h, bool loop_ok) {
  if (loop_ok) listener_close_loop(&h->loop);
  free(h->routes);
  free(h);
}

int http_start(const struct http_opts *o, struct http_server **out, char *err, size_t errlen) {
  *out = NULL;
  if (!o || !o->listen || !o->listen[0]) {
    snprintf(err, errlen, "no address to listen on");
    return -EINVAL;
  }
  struct http_server *h = calloc(1, sizeof(*h));
  if (!h) return -ENOMEM;
  h->routes = calloc(o->num_routes ? o->num_routes : 1, sizeof(*h->routes));
  if (!h->routes || uv_loop_init(&h->loop) < 0) {
    snprintf(err, errlen, "out of memory");
    free(h->routes);
    free(h);
    return -ENOMEM;
  }
  memcpy(h->routes, o->routes, o->num_routes * sizeof(*h->routes));
  h->num_routes = o->num_routes;
  h->timeout_ms = o->request_timeout_ms > 0 ? o->request_timeout_ms : HTTP_REQUEST_TIMEOUT_MS;
  uv_async_init(&h->loop, &h->stop, on_stop);
  h->stop.data = h;
  int r = bind_listener(h, o->listen, err, errlen);
  if (r < 0) {
    server_free(h, true);
    return r;
  }
  /* The new thread inherits this mask: it takes no signals. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  r = -pthread_create(&h->thread, NULL, http_main, h);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (r < 0) {
    snprintf(err, errlen, "cannot start the HTTP thread: %s", strerror(-r));
    server_free(h, true);
    return r;
  }
  h->thread_started = true;
  *out = h;
  return 0;
}

const char *http_address(const struct http_server *h) {
  return h ? h->addr : "";
}

void http_stop(struct http_server *h) {
  if (!h) return;
  uv_async_send(&h->stop);
  pthread_join(h->thread, NULL);
  server_free(h, true);
}

/* ---- waiting for the end ---------------------------------------------------- */

static int wait_pipe[2] = {-1, -1};

static void on_stop_signal(int sig) {
  int saved = errno;
  unsigned char b = (unsigned char)sig;
  ssize_t n = write(wait_pipe[1], &b, 1);
  (void)n;
  errno = saved;
}

int http_wait_signal(void) {
  if (pipe2(wait_pipe, O_CLOEXEC) < 0) {
    pause(); /* no pipe: the default action of the signal ends the process */
    return SIGTERM;
  }
  struct sigaction sa, old_term, old_int;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, &old_term);
  sigaction(SIGINT, &sa, &old_int);
  sigset_t set, old_mask;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_UNBLOCK, &set, &old_mask);
  unsigned char b = 0;
  while (read(wait_pipe[0], &b, 1) != 1) {
    if (errno != EINTR) break;
  }
  sigaction(SIGTERM, &old_term, NULL);
  sigaction(SIGINT, &old_int, NULL);
  pthread_sigmask(SIG_SETMASK, &old_mask, NULL);
  close(wait_pipe[0]);
  close(wait_pipe[1]);
  wait_pipe[0] = wait_pipe[1] = -1;
  return b ? b : SIGTERM;
}
