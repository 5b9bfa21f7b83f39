/* rendezvous_link: see rendezvous_link.h. */
#include "rendezvous_link.h"

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"

/* Reads exactly len bytes before deadline_ns; -ETIMEDOUT, -ECONNRESET at EOF. */
static int read_deadline(int fd, void *buf, size_t len, uint64_t deadline_ns) {
  char *p = buf;
  while (len > 0) {
    uint64_t now = clock_now_ns();
    if (now >= deadline_ns) return -ETIMEDOUT;
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    uint64_t left_ms = (deadline_ns - now + 999999u) / 1000000u;
    int pr = poll(&pfd, 1, left_ms > INT32_MAX ? -1 : (int)left_ms);
    if (pr < 0 && errno != EINTR) return -errno;
    if (pr <= 0) continue;
    ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
    if (n == 0) return -ECONNRESET;
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return -errno;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

int link_recv_frame(int fd, struct wire_arena *a, uint8_t *hbuf, uint64_t deadline_ns,
                    wire_header **out, char *why, size_t whylen) {
  uint8_t pre[FRAME_PREAMBLE_BYTES];
  int r = read_deadline(fd, pre, sizeof(pre), deadline_ns);
  if (r < 0) return r;
  struct frame_limits lim = {.max_header = HS_MAX_HEADER, .max_payload = 0};
  struct frame_preamble p;
  r = frame_preamble_decode(pre, &lim, &p);
  if (r < 0) {
    snprintf(why, whylen, "%s", frame_strerror(r));
    return -EBADMSG;
  }
  r = read_deadline(fd, hbuf, p.header_len, deadline_ns);
  if (r < 0) return r;
  if (wire_header_unpack(a, hbuf, p.header_len, out) < 0) {
    snprintf(why, whylen, "undecodable header");
    return -EBADMSG;
  }
  return 0;
}

struct link *link_new(int fd, enum auth_role role, const struct auth_token *t) {
  struct link *l = calloc(1, sizeof(*l));
  if (!l) return NULL;
  l->fd = fd;
  l->want = FRAME_PREAMBLE_BYTES;
  l->since_ns = clock_now_ns();
  hs_init(&l->hs, role, t);
  return l;
}

void link_free(struct link *l) {
  if (!l) return;
  if (l->fd >= 0) close(l->fd);
  hs_deinit(&l->hs);
  auth_session_free(l->session);
  free(l);
}

void link_next_frame(struct link *l) {
  l->got = 0;
  l->want = FRAME_PREAMBLE_BYTES;
}

int link_read(struct link *l, char *why, size_t whylen) {
  for (;;) {
    if (l->got == l->want) {
      if (l->want != FRAME_PREAMBLE_BYTES) return 1;
      struct frame_limits lim = {.max_header = HS_MAX_HEADER, .max_payload = 0};
      struct frame_preamble p;
      int r = frame_preamble_decode(l->frame, &lim, &p);
      if (r < 0) {
        snprintf(why, whylen, "%s", frame_strerror(r));
        return -EBADMSG;
      }
      l->hlen = p.header_len;
      l->want += p.header_len;
      continue;
    }
    ssize_t n = recv(l->fd, l->frame + l->got, l->want - l->got, MSG_DONTWAIT);
    if (n == 0) return -ECONNRESET;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -errno;
    l->got += (size_t)n;
  }
}
