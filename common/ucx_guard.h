/* ucx_guard: keeps peers that do not speak UCX's connection protocol from
 * taking a UCX listener down (issue 30). Design and the reasons for it in
 * ucx_guard.c. */
#ifndef PS_UCX_GUARD_H
#define PS_UCX_GUARD_H

#include <stdint.h>
#include <sys/socket.h>

struct uguard;

/* Starts watching the connections accepted on `bound` (the listener's
 * address as UCX bound it; 0.0.0.0 / :: match any local address). Returns 0
 * or a negative errno. */
int uguard_start(const struct sockaddr_storage *bound, struct uguard **out);
/* Stops the thread and frees g. NULL is fine. */
void uguard_stop(struct uguard *g);
/* UCX handed a connection from peer to us (a valid connection request):
 * its socket is left alone from now on. */
void uguard_admit(struct uguard *g, const struct sockaddr_storage *peer);
/* That connection is being closed: left alone a few seconds more (UCX
 * closes its socket after us), then forgotten. */
void uguard_forget(struct uguard *g, const struct sockaddr_storage *peer);
/* Connections refused since the last call (then reset to 0). */
uint64_t uguard_take_refused(struct uguard *g);

#endif
