/* wire: protobuf-c encode/decode of frame headers (see wire.h). */
#include "wire.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static void *arena_alloc(void *data, size_t size) {
  struct wire_arena *a = data;
  size_t start = (a->used + 15u) & ~(size_t)15u;
  if (start > a->cap || size > a->cap - start) {
    a->exhausted = 1;
    return NULL;
  }
  a->used = start + size;
  return a->base + start;
}

static void arena_free(void *data, void *ptr) {
  (void)data;
  (void)ptr; /* memory goes back wholesale at the next unpack */
}

int wire_arena_init(struct wire_arena *a, size_t budget) {
  memset(a, 0, sizeof(*a));
  a->base = malloc(budget);
  if (!a->base) return -ENOMEM;
  a->cap = budget;
  a->alloc.alloc = arena_alloc;
  a->alloc.free = arena_free;
  a->alloc.allocator_data = a;
  return 0;
}

void wire_arena_deinit(struct wire_arena *a) {
  if (!a) return;
  free(a->base);
  a->base = NULL;
}

int wire_header_unpack(struct wire_arena *a, const uint8_t *buf, size_t len, wire_header **out) {
  a->used = 0;
  a->exhausted = 0;
  Ps__Header *h = ps__header__unpack(&a->alloc, len, buf);
  if (!h) return a->exhausted ? -ENOMEM : -EBADMSG;
  *out = h;
  return 0;
}

int wire_frame_encode(const wire_header *h, uint64_t payload_len, uint8_t *out, size_t cap) {
  size_t hlen = ps__header__get_packed_size(h);
  /* A header must be at least one byte on the wire (header_len 0 is invalid),
   * so every sender sets type, which is never 0. */
  if (hlen == 0 || hlen > FRAME_MAX_HEADER || FRAME_PREAMBLE_BYTES + hlen > cap) return -EMSGSIZE;
  frame_preamble_encode(out, (uint16_t)hlen, payload_len);
  ps__header__pack(h, out + FRAME_PREAMBLE_BYTES);
  return (int)(FRAME_PREAMBLE_BYTES + hlen);
}

const char *wire_type_name(int type) {
  static const char *const names[] = {
      "unknown", "hello", "auth",  "layout",   "init", "push",      "pull",     "pull_reply",
      "barrier", "stats", "error", "shutdown", "ack",  "heartbeat", "rollback", "leave"};
  if (type < 0 || type >= (int)(sizeof(names) / sizeof(names[0]))) return "unknown";
  return names[type];
}

void wire_error_frame(wire_header *h, Ps__Error *e, uint64_t request_id, Ps__ErrorCode code,
                      const char *msg) {
  *h = (wire_header)PS__HEADER__INIT;
  *e = (Ps__Error)PS__ERROR__INIT;
  e->code = code;
  e->message = (char *)msg;
  h->type = PS__MSG_TYPE__MSG_ERROR;
  h->request_id = request_id;
  h->body_case = PS__HEADER__BODY_ERROR;
  h->error = e;
}
