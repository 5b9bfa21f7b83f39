/* errbuf: the message of a failure, written into a buffer the caller gave.
 *
 * The modules that explain their errors in text (net, the IDX loader, the
 * model spec parser) take (char *err, size_t errlen) and may be given none:
 * errbuf_set writes only when there is room, never past errlen, always
 * NUL-terminated, and returns the caller's error code, so a failure reads
 * `return errbuf_set(-EINVAL, err, errlen, "...", ...);`. */
#ifndef PS_ERRBUF_H
#define PS_ERRBUF_H

#include <stddef.h>

/* printf into err (if err is not NULL and errlen > 0); returns code. */
int errbuf_set(int code, char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
