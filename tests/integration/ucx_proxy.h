/* ucx_proxy: a proxy between libps and a shard on --transport ucx, at the
 * level of frames (tests of what the network does to a connection, like the
 * TCP proxies of test_reconnect and test_auth). It accepts one worker
 * connection at a time on a free port of 127.0.0.1, opens its own to the
 * shard, and forwards every active message both ways, payload included, in
 * order; a hook sees each frame first and may alter it or cut both
 * connections. It runs on a thread of its own until the test exits. */
#ifndef PS_TEST_UCX_PROXY_H
#define PS_TEST_UCX_PROXY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum ucx_proxy_verdict { UCX_PROXY_FORWARD, UCX_PROXY_CUT };

/* A frame from the worker (up) or the shard: head (preamble || header ||
 * tag) and payload, both writable. Runs on the proxy's thread. */
typedef enum ucx_proxy_verdict (*ucx_proxy_hook)(bool up, uint8_t *head, uint32_t head_len,
                                                 uint8_t *payload, uint64_t len, void *arg);

/* Starts the proxy to target ("host:port"); its address goes to addr. */
void ucx_proxy_start(const char *target, ucx_proxy_hook hook, void *arg, char *addr,
                     size_t addrlen);
/* Worker connections accepted so far. */
int ucx_proxy_accepted(void);

#endif
