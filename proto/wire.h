/* wire: the one choke point where protobuf-c headers are encoded and decoded
 * (CRIU's pb_write_one/pb_read_one). Nothing else calls protobuf-c directly.
 *
 * Decoding runs under a bump arena with a fixed byte budget: protobuf-c's
 * unpack can allocate 20-40x its input for hostile input, and an arena turns
 * that into a clean -ENOMEM instead of memory growth. The decoded Header
 * lives in the arena until the next unpack into it; nothing needs freeing.
 * The arena's memory is allocated once, at init. */
#ifndef PS_WIRE_H
#define PS_WIRE_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

#include "frame.h"
#include "ps.pb-c.h"

typedef Ps__Header wire_header;

/* Header.flags of an ACK of a PUSH: the push was a resend, not applied. */
#define WIRE_ACK_DUPLICATE 1u
/* Header.flags of a PUSH: Header.version is the version of the parameters
 * the gradient was computed on (the shard's staleness; ps-server/store.h). */
#define WIRE_PUSH_BASE 2u
/* Header.flags of a LAYOUT: the sender's job had started (its keys were
 * initialised, it pushed or pulled); Header.step is its clock. A shard that
 * holds nothing of the job then knows it lost it (ps-server/handlers.c). */
#define WIRE_LAYOUT_STARTED 4u

struct wire_arena {
  ProtobufCAllocator alloc;
  uint8_t *base;
  size_t cap, used;
  int exhausted;
};

/* Default decode budget of one header (bytes of arena). */
#define WIRE_DEFAULT_BUDGET (256u * 1024u)

int wire_arena_init(struct wire_arena *a, size_t budget);
void wire_arena_deinit(struct wire_arena *a);

/* Decodes one Header from buf. Returns 0, -EBADMSG (not a valid Header) or
 * -ENOMEM (the decode budget was exceeded). */
int wire_header_unpack(struct wire_arena *a, const uint8_t *buf, size_t len, wire_header **out);

/* Encodes preamble + header into out (capacity cap). Returns the byte count,
 * or -EMSGSIZE if the header is larger than FRAME_MAX_HEADER or cap. */
int wire_frame_encode(const wire_header *h, uint64_t payload_len, uint8_t *out, size_t cap);

/* Makes h an ERROR frame answering request_id: e (which h points to) gets
 * code and msg (not copied: msg must outlive the encoding of h). Every
 * ERROR header, the shard's and the workers', is built here. */
void wire_error_frame(wire_header *h, Ps__Error *e, uint64_t request_id, Ps__ErrorCode code,
                      const char *msg);

/* Human-readable name of a message type ("push", "pull", ...). */
const char *wire_type_name(int type);

#endif
