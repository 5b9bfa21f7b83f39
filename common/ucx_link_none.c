/* ucx_link without UCX (meson -Ducx=disabled, or libucx-dev missing): every
 * entry point says the transport is not built in (ucx_link.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "config.h"
#include "ucx_env.h"
#include "ucx_link.h"

static const char *const transports[] = {"tcp", "ucx"};

int ulink_transport_parse(const char *value, char *err, size_t errlen) {
  int r = config_choice(value, transports, 2, err, errlen);
  if (r == 1) {
    snprintf(err, errlen, "ucx: this build has no UCX transport (libucx-dev was missing)");
    return -EINVAL;
  }
  return r;
}

int ulink_transport_check(const char *value, char *err, size_t errlen) {
  int r = ulink_transport_parse(value, err, errlen);
  return r < 0 ? r : 0;
}

int ulink_new(bool locked, const struct ulink_cbs *cbs, struct ulink **out, char *err,
              size_t errlen) {
  (void)locked;
  (void)cbs;
  *out = NULL;
  snprintf(err, errlen, "this build has no UCX transport (rebuild with libucx-dev installed)");
  return -ENOTSUP;
}
int ulink_new_server(const char *host, const struct ulink_cbs *cbs, struct ulink **out, char *err,
                     size_t errlen) {
  (void)host;
  return ulink_new(false, cbs, out, err, errlen);
}
uint64_t ulink_take_refused(struct ulink *u) {
  return (void)u, 0;
}
void ulink_free(struct ulink *u) {
  (void)u;
}
int ulink_efd(struct ulink *u) {
  return (void)u, -1;
}
unsigned ulink_progress(struct ulink *u) {
  return (void)u, 0;
}
bool ulink_arm(struct ulink *u) {
  return (void)u, true;
}
void ulink_signal(struct ulink *u) {
  (void)u;
}
int ulink_listen(struct ulink *u, const char *host, uint16_t port, uint16_t *bound, char *err,
                 size_t errlen) {
  (void)u, (void)host, (void)port, (void)bound;
  snprintf(err, errlen, "this build has no UCX transport");
  return -ENOTSUP;
}
void ulink_unlisten(struct ulink *u) {
  (void)u;
}
int ulink_connect(struct ulink *u, const char *host, uint16_t port, struct ulink_ep **out,
                  char *err, size_t errlen) {
  (void)u, (void)host, (void)port;
  *out = NULL;
  snprintf(err, errlen, "this build has no UCX transport");
  return -ENOTSUP;
}
void ulink_ep_set_user(struct ulink_ep *ep, void *user) {
  (void)ep, (void)user;
}
void *ulink_ep_user(const struct ulink_ep *ep) {
  return (void)ep, NULL;
}
const char *ulink_ep_transports(struct ulink_ep *ep) {
  return (void)ep, "";
}
void ulink_ep_close(struct ulink_ep *ep, bool flush) {
  (void)ep, (void)flush;
}
int ulink_send(struct ulink_ep *ep, const void *head, size_t head_len, const void *payload,
               uint64_t len, ulink_done_fn done, void *arg) {
  (void)ep, (void)head, (void)head_len, (void)payload, (void)len, (void)done, (void)arg;
  return -ENOTSUP;
}
int ulink_rx_take(struct ulink *u, struct ulink_rx *rx, void *dst, ulink_done_fn done, void *arg) {
  (void)u, (void)rx, (void)dst, (void)done, (void)arg;
  return -ENOTSUP;
}
void ulink_rx_free(struct ulink *u, struct ulink_rx *rx) {
  (void)u, (void)rx;
}
struct ulink_rx *ulink_rx_from_buffer(struct ulink_ep *ep, uint8_t *buf, uint64_t len,
                                      uint32_t head_len) {
  (void)ep, (void)len, (void)head_len;
  free(buf); /* ownership passes, as with UCX */
  return NULL;
}
size_t ulink_max_head(const struct ulink *u) {
  return (void)u, 0;
}
void ulink_stats(struct ulink *u, struct ulink_stats *out) {
  (void)u;
  *out = (struct ulink_stats){0};
}
int ucx_env_check(char *err, size_t errlen) {
  (void)err, (void)errlen;
  return 0; /* --transport ucx is refused as an option already */
}
