/* wire_send: encode, seal and write one frame (see wire_send.h). The tag is
 * computed over the same iovecs that are then written, so what is sealed is
 * exactly what goes out. */
#include "wire_send.h"

#include <sys/uio.h>

#include "net.h"

int64_t wire_send_frame(int fd, const wire_header *h, const void *payload, uint64_t plen,
                        struct auth_session *s, uint8_t *hdr_buf, size_t hdr_cap) {
  int n = wire_frame_encode(h, plen, hdr_buf, hdr_cap);
  if (n < 0) return n;
  uint8_t tag[AUTH_TAG_BYTES];
  struct iovec iov[3] = {{hdr_buf, (size_t)n}, {(void *)payload, (size_t)plen}, {tag, 0}};
  int cnt = plen ? 2 : 1;
  if (s) {
    int r = auth_seal(s, iov, cnt, tag);
    if (r < 0) return r;
    iov[cnt++] = (struct iovec){tag, AUTH_TAG_BYTES};
  }
  int r = net_writev_all(fd, iov, cnt);
  if (r < 0) return r;
  return (int64_t)n + (int64_t)plen + (s ? AUTH_TAG_BYTES : 0);
}
