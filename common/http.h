/* http: a tiny HTTP/1.0 GET responder for /metrics, /healthz and /readyz.
 *
 * It runs on its own thread with its own libuv loop (one loop per thread), so
 * a scrape or a probe never waits for the process's data path and the data
 * path never waits for a slow scraper. Other threads talk to it only through
 * uv_async_send (http_stop); route handlers run on the HTTP thread and must
 * read shared state through atomics or hand the question to its owner.
 *
 * One request per connection (HTTP/1.0, "Connection: close"): the request
 * head must arrive whole within the request timeout (default
 * HTTP_REQUEST_TIMEOUT_MS) and fit in
 * HTTP_MAX_REQUEST bytes (else 408 / 431); a malformed request line gets 400,
 * a method other than GET or HEAD 405, an unknown path 404. Bodies sent by
 * clients are never read. At most HTTP_MAX_CONNS connections are open at
 * once, so a flood cannot exhaust memory or descriptors; a connection
 * beyond the cap pushes out the oldest one that has sent nothing (else the
 * oldest still reading its head, else one lingering after its answer), as
 * nginx drops idle keep-alive connections first, so a flood of idle
 * connections cannot starve the probes (/healthz, /readyz). Only when every
 * other connection is being answered is the new one closed at once. The thread blocks every signal,
 * so signals go to the threads that handle them. */
#ifndef PS_HTTP_H
#define PS_HTTP_H

#include <stddef.h>
#include <stdio.h>

#define HTTP_MAX_REQUEST 8192
#define HTTP_REQUEST_TIMEOUT_MS 5000
#define HTTP_MAX_CONNS 64

/* Writes the body to out, may set *content_type (default text/plain), and
 * returns the status code (200, 503, ...). Runs on the HTTP thread. */
typedef int (*http_handler_fn)(void *arg, FILE *out, const char **content_type);

struct http_route {
  const char *path; /* exact match, query string ignored: "/metrics" */
  http_handler_fn fn;
  void *arg;
};

struct http_opts {
  const char *listen;              /* "host:port"; port 0 picks a free one */
  const struct http_route *routes; /* copied */
  size_t num_routes;
  int request_timeout_ms; /* 0 = HTTP_REQUEST_TIMEOUT_MS */
};

struct http_server;

/* Binds on the caller's thread (so a bad address or a port in use is reported
 * here, in err), then serves on a new thread. Returns 0 or a negative errno. */
int http_start(const struct http_opts *o, struct http_server **out, char *err, size_t errlen);
/* The bound address as "host:port". */
const char *http_address(const struct http_server *h);
/* Stops serving, closes every connection and joins the thread. Accepts NULL. */
void http_stop(struct http_server *h);

/* Blocks the calling thread until SIGTERM or SIGINT arrives and returns it;
 * the HTTP thread keeps serving meanwhile. For a process whose work is done
 * but that must not exit (a StatefulSet restarts a container that exits,
 * even with 0). The signals are caught by a handler that writes to a pipe,
 * so it works whichever thread the kernel picks; the previous handlers are
 * restored before it returns. */
int http_wait_signal(void);

#endif
