/* log: logfmt lines on stderr.
 *
 * Each call builds the whole line (timestamp, level, proc, quoted msg, the
 * caller's key=value tail and the newline) in one buffer and hands it to stdio
 * in a single fwrite. stdio locks the stream for the duration of that call and
 * stderr is unbuffered, so a line reaches the fd in one write and lines from
 * different threads never interleave. The buffer starts on the stack; only a
 * line longer than that goes to the heap, and if even that fails the line is
 * cut rather than lost.
 *
 * State: the process name and the minimum level. log_setup is meant to run
 * once in main before any thread starts; the level is atomic anyway so a
 * signal handler or admin endpoint may change it later. */
#include "log.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

static char log_proc[64] = "ps";
static atomic_int log_min_level = LOG_INFO;

static const char *const level_names[] = {"debug", "info", "warn", "error"};

void log_setup(const char *proc, enum log_level min_level) {
  if (proc && proc[0]) snprintf(log_proc, sizeof(log_proc), "%s", proc);
  atomic_store(&log_min_level, (int)min_level);
}

int log_level_parse(const char *s, enum log_level *out) {
  static const struct {
    const char *name;
    enum log_level level;
  } names[] = {
      {"debug", LOG_DEBUG},  {"info", LOG_INFO},   {"warn", LOG_WARN},
      {"warning", LOG_WARN}, {"error", LOG_ERROR}, {"off", LOG_OFF},
  };
  if (!s) return -EINVAL;
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
    if (strcasecmp(s, names[i].name) == 0) {
      *out = names[i].level;
      return 0;
    }
  }
  return -EINVAL;
}

int log_enabled(enum log_level level) {
  return (int)level >= atomic_load(&log_min_level) && level < LOG_OFF;
}

static int needs_quotes(const char *s) {
  if (!s[0]) return 1; /* key= reads as a missing value; key="" is explicit */
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p <= ' ' || *p == '=' || *p == '"' || *p == 0x7f) return 1;
  }
  return 0;
}

/* Writes s as a quoted, escaped logfmt value into dst (room for n bytes with
 * the NUL, n >= 3). An escape that does not fit is dropped whole, so a cut
 * value still ends with a closing quote and no dangling backslash. */
static size_t quote_into(char *dst, size_t n, const char *s) {
  size_t len = 0;
  dst[len++] = '"';
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    char esc[5];
    size_t k;
    switch (*p) {
      case '"':
        k = (size_t)snprintf(esc, sizeof(esc), "\\\"");
        break;
      case '\\':
        k = (size_t)snprintf(esc, sizeof(esc), "\\\\");
        break;
      case '\n':
        k = (size_t)snprintf(esc, sizeof(esc), "\\n");
        break;
      case '\r':
        k = (size_t)snprintf(esc, sizeof(esc), "\\r");
        break;
      case '\t':
        k = (size_t)snprintf(esc, sizeof(esc), "\\t");
        break;
      default:
        if (*p < ' ' || *p == 0x7f) {
          k = (size_t)snprintf(esc, sizeof(esc), "\\x%02x", *p);
        } else {
          esc[0] = (char)*p;
          k = 1;
        }
    }
    if (len + k + 2 > n) break; /* keep room for the closing quote and NUL */
    memcpy(dst + len, esc, k);
    len += k;
  }
  dst[len++] = '"';
  dst[len] = '\0';
  return len;
}

const char *log_quote(char *buf, unsigned long n, const char *s) {
  if (!buf || n == 0) return "";
  if (!s) s = "";
  if (!needs_quotes(s)) {
    snprintf(buf, n, "%s", s);
  } else if (n >= 3) {
    quote_into(buf, n, s);
  } else {
    buf[0] = '\0'; /* no room for even "" */
  }
  return buf;
}

/* A growable line buffer that starts on the stack. */
struct line {
  char *p;
  size_t len, cap;
  char small[1024];
};

/* Makes room for extra more bytes plus the NUL; returns 0 or -ENOMEM. */
static int line_reserve(struct line *l, size_t extra) {
  if (l->len + extra + 1 <= l->cap) return 0;
  size_t cap = l->cap * 2;
  while (cap < l->len + extra + 1) cap *= 2;
  char *p = l->p == l->small ? malloc(cap) : realloc(l->p, cap);
  if (!p) return -ENOMEM;
  if (l->p == l->small) memcpy(p, l->small, l->len + 1);
  l->p = p;
  l->cap = cap;
  return 0;
}

static void line_vappend(struct line *l, const char *fmt, va_list ap) {
  va_list ap2;
  va_copy(ap2, ap);
  int n = vsnprintf(l->p + l->len, l->cap - l->len, fmt, ap);
  if (n < 0) goto out;
  if ((size_t)n >= l->cap - l->len) {
    if (line_reserve(l, (size_t)n) == 0) {
      vsnprintf(l->p + l->len, l->cap - l->len, fmt, ap2);
    } else {
      n = (int)(l->cap - l->len - 1); /* out of memory: keep what fitted */
    }
  }
  l->len += (size_t)n;
out:
  va_end(ap2);
}

static void line_append(struct line *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void line_append(struct line *l, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  line_vappend(l, fmt, ap);
  va_end(ap);
}

void log_write(enum log_level level, const char *msg, const char *kvfmt, ...) {
  if (!log_enabled(level)) return;
  struct line l = {.len = 0, .cap = sizeof(l.small)};
  l.p = l.small;
  l.small[0] = '\0';

  struct timespec ts;
  struct tm tm;
  clock_gettime(CLOCK_REALTIME, &ts);
  gmtime_r(&ts.tv_sec, &tm);
  line_append(&l,
              "ts=%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ level=%s proc=%s msg=", tm.tm_year + 1900,
              tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
              level_names[level], log_proc);

  /* msg is always quoted (the header promises msg="..."); the worst case
   * escape is 4 bytes per input byte, plus the two quotes. */
  if (!msg) msg = "";
  size_t want = 4 * strlen(msg) + 2;
  if (line_reserve(&l, want) != 0) want = l.cap - l.len - 1;
  if (want >= 2) l.len += quote_into(l.p + l.len, want + 1, msg);

  if (kvfmt && kvfmt[0]) {
    line_append(&l, " ");
    va_list ap;
    va_start(ap, kvfmt);
    line_vappend(&l, kvfmt, ap);
    va_end(ap);
  }
  if (line_reserve(&l, 1) != 0) l.len = l.cap - 2; /* cut the line, keep the newline */
  l.p[l.len++] = '\n';
  l.p[l.len] = '\0';

  fwrite(l.p, 1, l.len, stderr);
  if (l.p != l.small) free(l.p);
}

int log_level_check(const char *value, char *err, size_t errlen) {
  enum log_level l;
  if (log_level_parse(value, &l) == 0) return 0;
  snprintf(err, errlen, "expected debug, info, warn, error or off");
  return -EINVAL;
}
