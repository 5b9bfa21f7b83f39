/* scrape: what an integration test needs to look at a process's HTTP
 * endpoint the way Prometheus and the kubelet do: find the address the
 * process logged ("http listening" addr=...), GET a path on 127.0.0.1, and
 * read one sample out of Prometheus text. */
#ifndef PS_TEST_SCRAPE_H
#define PS_TEST_SCRAPE_H

#include <stddef.h>

/* Waits up to timeout_ms for log_path to contain the "http listening" line
 * and copies its host:port into addr. Returns 0 or -1. */
int scrape_http_addr(const char *log_path, char *addr, size_t len, int timeout_ms);

/* GET path from addr ("host:port"); the body goes to body (NUL-terminated,
 * cut at len). Returns the status code, or -1 if there was no answer. */
int scrape_get(const char *addr, const char *path, char *body, size_t len);

/* The value of the sample whose name and labels are exactly `series` (for
 * example `ps_server_key_version{key="00"}` or `ps_server_pushes_total`) in
 * Prometheus text; -1 if absent. */
double scrape_value(const char *text, const char *series);

#endif
