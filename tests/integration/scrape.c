/* scrape: a blocking HTTP/1.x GET over one TCP connection (the server
 * answers and closes) and a line scan of the Prometheus text format. */
#include "scrape.h"

#include <arpa/inet.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"

int scrape_http_addr(const char *log_path, char *addr, size_t len, int timeout_ms) {
  for (int waited = 0; waited <= timeout_ms; waited += 10) {
    FILE *f = fopen(log_path, "r");
    char line[4096];
    while (f && fgets(line, sizeof(line), f)) {
      const char *p = strstr(line, "msg=\"http listening\"");
      const char *a = p ? strstr(p, "addr=") : NULL;
      if (!a) continue;
      a += 5;
      size_t n = strcspn(a, " \n");
      snprintf(addr, len, "%.*s", (int)n, a);
      fclose(f);
      return 0;
    }
    if (f) fclose(f);
    clock_sleep_ms(10);
  }
  return -1;
}

int scrape_get(const char *addr, const char *path, char *body, size_t len) {
  char host[64];
  const char *colon = strrchr(addr, ':');
  if (!colon || (size_t)(colon - addr) >= sizeof(host)) return -1;
  snprintf(host, sizeof(host), "%.*s", (int)(colon - addr), addr);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
  if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) return -1;
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
    close(fd);
    return -1;
  }
  char req[512];
  int n = snprintf(req, sizeof(req), "GET %s HTTP/1.1\r\nHost: %s\r\n\r\n", path, addr);
  if (send(fd, req, (size_t)n, MSG_NOSIGNAL) != n) {
    close(fd);
    return -1;
  }
  size_t cap = 1 << 20, got = 0;
  char *buf = malloc(cap);
  while (buf && got + 1 < cap) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 5000) <= 0) break;
    ssize_t r = recv(fd, buf + got, cap - 1 - got, 0);
    if (r <= 0) break;
    got += (size_t)r;
  }
  close(fd);
  if (!buf) return -1;
  buf[got] = 0;
  int status = -1;
  const char *sep = strstr(buf, "\r\n\r\n");
  if (sscanf(buf, "HTTP/1.%*d %d", &status) != 1 || !sep) status = -1;
  if (body && len) snprintf(body, len, "%s", sep ? sep + 4 : "");
  free(buf);
  return status;
}

double scrape_value(const char *text, const char *series) {
  size_t n = strlen(series);
  for (const char *p = text; p && *p;) {
    if (strncmp(p, series, n) == 0 && p[n] == ' ') return strtod(p + n + 1, NULL);
    p = strchr(p, '\n');
    if (p) p++;
  }
  return -1;
}
