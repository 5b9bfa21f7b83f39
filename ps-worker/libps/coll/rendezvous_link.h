/* rendezvous_link: one connection of the rendezvous (rendezvous.c) while
 * its handshake runs: the state it is in and the non-blocking reads of its
 * handshake frames, which never take a byte past the frame (what follows
 * belongs to the ring, the watchdog or the point-to-point path). Internal to
 * libps. */
#ifndef PS_RENDEZVOUS_LINK_H
#define PS_RENDEZVOUS_LINK_H

#include <stddef.h>
#include <stdint.h>

#include "auth.h"
#include "frame.h"
#include "handshake.h"
#include "wire.h"

/* The kinds of connection (Hello's header flags). */
enum { KIND_RING = 1, KIND_CTRL = 2, KIND_P2P = 3 };

/* A connection of the rendezvous until its handshake is over:
 *
 *   we connected (initiator)               we accepted (acceptor)
 *   L_REPLY  HELLO sent; wait for          L_HELLO  wait for HELLO (HELLO_WAIT_MS)
 *            AUTH: check its proof, send            token: send AUTH -> L_PROOF
 *                  ours -> L_ACK                    none:  check the hello, ACK, done
 *            ACK (no tokens): done         L_PROOF  wait for AUTH: check the proof,
 *   L_ACK    wait for ACK + tag: done               then the hello; ACK + tag, done
 *   ERROR or anything else: the            anything wrong: ERROR naming why, close,
 *   rendezvous fails (we were refused)     keep waiting for the genuine peer
 *
 * A finished link hands its socket and session to the group (prev_fd,
 * next_fd, ctrl[], p2p[]). */
enum link_state { L_HELLO, L_PROOF, L_REPLY, L_ACK };

struct link {
  int fd;
  enum link_state st;
  int to;   /* initiator: the rank we connected to */
  int kind; /* initiator: KIND_RING, KIND_CTRL or KIND_P2P */
  struct hs hs;
  struct auth_session *session; /* once the proofs verified */
  uint64_t since_ns, deadline_ns;
  uint64_t proof_since_ns; /* acceptor: when it entered L_PROOF */
  char peer[80];
  size_t got, want, hlen; /* the frame being read: preamble, header[, tag] */
  uint8_t frame[FRAME_PREAMBLE_BYTES + HS_MAX_HEADER + AUTH_TAG_BYTES];
  uint8_t hello[HS_MAX_HEADER]; /* acceptor: the HELLO header, checked once authenticated */
  size_t hello_len;
};

/* A link on the connected socket fd (taken over: link_free closes it), in
 * the handshake role `role` under token t (NULL = none). NULL without memory. */
struct link *link_new(int fd, enum auth_role role, const struct auth_token *t);
/* Closes its socket unless handed over (fd = -1). Accepts NULL. */
void link_free(struct link *l);
/* Resets l's frame buffer for the next frame. */
void link_next_frame(struct link *l);
/* Reads what l's frame still lacks without blocking, never past its end.
 * Returns 1 once it is complete, 0 to wait for more, -EBADMSG (not our
 * protocol or not a handshake frame; why says which), -ECONNRESET at EOF or a
 * socket error. */
int link_read(struct link *l, char *why, size_t whylen);
/* Reads one handshake-sized, header-only frame from fd, blocking until
 * deadline_ns, and decodes its header into *out (in a, with hbuf, of
 * HS_MAX_HEADER bytes, holding the bytes). Returns 0, -EBADMSG (not our
 * protocol; why says more), -ETIMEDOUT or a socket error. */
int link_recv_frame(int fd, struct wire_arena *a, uint8_t *hbuf, uint64_t deadline_ns,
                    wire_header **out, char *why, size_t whylen);

#endif
