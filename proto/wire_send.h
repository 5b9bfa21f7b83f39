/* wire_send: the one blocking frame writer. Every sender that encodes a
 * header, optionally tags the frame and writes it on a blocking socket
 * (libps's shard connections, the ring's rendezvous and control frames,
 * ps-hostile's well-formed handshake frames) goes through wire_send_frame,
 * so the frame is laid out, sealed and written the same way everywhere.
 *
 * The encoded preamble and header are written into a buffer the caller
 * provides and stay there afterwards: a caller that needs the bytes it sent
 * (a handshake hashes its HELLO as sent) reads them back instead of encoding
 * twice, and a connection that sends often reuses one buffer. The payload is
 * never copied: header, payload and tag go out with gathered writes. Frames
 * that must be malformed on purpose (ps-hostile's mutations) are not this
 * module's business; their senders write raw bytes with net.h. */
#ifndef PS_WIRE_SEND_H
#define PS_WIRE_SEND_H

#include <stddef.h>
#include <stdint.h>

#include "auth.h"
#include "wire.h"

/* Encodes h for a payload of plen bytes into hdr_buf (hdr_cap bytes), seals
 * preamble || header || payload under s when s is set (its send counter
 * advances), and writes preamble + header, the payload (when plen > 0) and
 * the tag on fd. Returns the bytes written (preamble, header, payload and
 * tag), or a negative errno: -EMSGSIZE if the header does not fit hdr_cap
 * or FRAME_MAX_HEADER, -EIO if sealing failed (nothing written in either
 * case, except that a payload of 128 KiB or more on a sealed connection is
 * tagged and written in pieces, so part of it may be out), or the socket's
 * error, after which part of the frame may be out
 * and the stream is unusable. On a non-blocking socket a full send buffer
 * ends it with -EAGAIN the same way. Thread safety: one writer per fd and
 * per session at a time (callers hold their send lock). */
int64_t wire_send_frame(int fd, const wire_header *h, const void *payload, uint64_t plen,
                        struct auth_session *s, uint8_t *hdr_buf, size_t hdr_cap);

#endif
