/* errbuf: see errbuf.h. */
#include "errbuf.h"

#include <stdarg.h>
#include <stdio.h>

int errbuf_set(int code, char *err, size_t errlen, const char *fmt, ...) {
  if (err && errlen > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
  }
  return code;
}
