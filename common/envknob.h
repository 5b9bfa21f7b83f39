/* envknob: every environment-only knob (a PS_* variable with no flag:
 * test and tuning switches) in one table, read with config.c's rules and
 * messages, so each one has one name, default, range and help, and
 * `--help=json` lists them under "env" (config_print_json).
 *
 * A knob's value is read where it is used (libps, the checkpoint I/O, the
 * UCX link), not parsed by main.c, because a library reads it too; what is
 * fixed here is how it is read. Unset or empty means the default. A bad value
 * returns -EINVAL with "NAME=\"value\": expected ..." in err. */
#ifndef PS_ENVKNOB_H
#define PS_ENVKNOB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum envknob_type { ENVKNOB_INT, ENVKNOB_BOOL, ENVKNOB_STRING, ENVKNOB_U64 };

struct envknob {
  const char *name; /* "PS_HEARTBEAT_MS" */
  enum envknob_type type;
  const char *def;            /* ENVKNOB_STRING, ENVKNOB_BOOL: as text; NULL = empty / false */
  double num_def, min, max;   /* ENVKNOB_INT, ENVKNOB_U64 */
  const char *const *choices; /* ENVKNOB_STRING: NULL-terminated, or NULL = any */
  const char *help;
};

/* The table and its length. */
extern const struct envknob envknob_table[];
extern const size_t envknob_count;

/* The knob called name, or NULL. */
const struct envknob *envknob_find(const char *name);

/* Reads an ENVKNOB_INT knob: its default when unset or empty, else a whole
 * number within the table's [min, max] (config_env_int's rules). */
int envknob_int(const char *name, int64_t *out, char *err, size_t errlen);
/* Reads an ENVKNOB_U64 knob: its default when unset or empty, else decimal
 * digits only (no sign, space or overflow) within [0, max]; the message
 * says "not a whole number from 0 to MAX (digits only)". */
int envknob_u64(const char *name, uint64_t *out, char *err, size_t errlen);
/* Reads an ENVKNOB_BOOL knob (config_env_bool's rules; default false). */
int envknob_bool(const char *name, bool *out, char *err, size_t errlen);
/* Reads an ENVKNOB_STRING knob: its default when unset or empty; a knob with
 * choices refuses anything else with "expected a or b". */
int envknob_str(const char *name, const char **out, char *err, size_t errlen);

/* Writes the table as a JSON array (config_print_json's "env"). */
void envknob_print_json(FILE *out);

#endif
