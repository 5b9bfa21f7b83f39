/* log: logfmt lines on stderr, one per event.
 *
 *   ts=2026-11-29T16:41:10.123Z level=info proc=ps-server msg="listening" addr=0.0.0.0:7070
 *
 * The process name and the minimum level are set once at start-up by main.c
 * (log_setup); everything else only calls the macros. Writes are a single
 * fprintf of a preformatted line, so lines from several threads never mix.
 * The key=value tail is a printf format the caller writes in logfmt itself;
 * log_quote() helps for values that may hold spaces or quotes. */
#ifndef PS_LOG_H
#define PS_LOG_H

#include <stdarg.h>
#include <stddef.h>

enum log_level { LOG_DEBUG = 0, LOG_INFO = 1, LOG_WARN = 2, LOG_ERROR = 3, LOG_OFF = 4 };

/* Sets the process name written as proc= and the lowest level printed. */
void log_setup(const char *proc, enum log_level min_level);
/* Parses "debug|info|warn|error|off"; returns 0 or -EINVAL. */
int log_level_parse(const char *s, enum log_level *out);
int log_enabled(enum log_level level);
/* The config_check_fn of --log-level (config.h): 0, or -EINVAL with the
 * reason in err. */
int log_level_check(const char *value, char *err, size_t errlen);

/* Writes one line: msg is quoted, kvfmt (may be NULL or "") is appended after a space. */
void log_write(enum log_level level, const char *msg, const char *kvfmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Copies s into buf (size n) as a logfmt value: quoted and escaped when needed. */
const char *log_quote(char *buf, unsigned long n, const char *s);

#define log_debug(msg, ...)                                             \
  do {                                                                  \
    if (log_enabled(LOG_DEBUG)) log_write(LOG_DEBUG, msg, __VA_ARGS__); \
  } while (0)
#define log_info(msg, ...) log_write(LOG_INFO, msg, __VA_ARGS__)
#define log_warn(msg, ...) log_write(LOG_WARN, msg, __VA_ARGS__)
#define log_error(msg, ...) log_write(LOG_ERROR, msg, __VA_ARGS__)

#endif
