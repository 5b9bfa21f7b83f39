/* envknob: the table of environment-only knobs and their readers (see
 * envknob.h). The numbers and bool rules are config.c's (config_env_int,
 * config_env_bool), so a knob reads like an option from the environment.
 * PS_UCX_RNDV_BYTES and PS_UCX_POLL_US are unsigned 64-bit (envknob_u64,
 * digits only; read by the UCX link). */
#include "envknob.h"

#include <errno.h>
#include <stdbool.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "ucx_link.h"

/* PS_UCX_RNDV_BYTES's largest value (UINT64_MAX), which a double cannot
 * hold exactly: printed as such by envknob_print_json. */
#define UCX_MAX_U64 18446744073709551615.0

static const char *const transport_choices[] = {"tcp", "ucx", NULL};

const struct envknob envknob_table[] = {
    {"PS_HEARTBEAT_MS", ENVKNOB_INT, NULL, 500, 0, 60000, NULL,
     "libps: milliseconds between a client's heartbeats to each shard (0 = none)"},
    {"PS_TRANSPORT", ENVKNOB_STRING, "tcp", 0, 0, 0, transport_choices,
     "libps: push/pull transport when ps_client_opts.transport is NULL (tcp or ucx)"},
    {"PS_DISABLE_IO_URING", ENVKNOB_BOOL, "false", 0, 0, 0, NULL,
     "checkpoints: write with plain syscalls even where io_uring works"},
    {"PS_UCX_RNDV_BYTES", ENVKNOB_U64, NULL, ULINK_RNDV_BYTES, 0, UCX_MAX_U64, NULL,
     "--transport ucx: payloads at least this large go by rendezvous (digits only)"},
    {"PS_UCX_POLL_US", ENVKNOB_U64, NULL, ULINK_POLL_US, 0, 1000000, NULL,
     "--transport ucx: microseconds a wait polls (yielding the CPU) before it arms the event fd; 0 "
     "= at once (digits only)"},
};
const size_t envknob_count = sizeof(envknob_table) / sizeof(envknob_table[0]);

const struct envknob *envknob_find(const char *name) {
  for (size_t i = 0; i < envknob_count; i++)
    if (strcmp(envknob_table[i].name, name) == 0) return &envknob_table[i];
  return NULL;
}

/* The knob name of the wanted type; a miss is a programming error, said so. */
static const struct envknob *knob(const char *name, enum envknob_type type, char *err,
                                  size_t errlen) {
  const struct envknob *k = envknob_find(name);
  if (!k || k->type != type) snprintf(err, errlen, "%s: not a known knob of this type", name);
  return k && k->type == type ? k : NULL;
}

int envknob_int(const char *name, int64_t *out, char *err, size_t errlen) {
  const struct envknob *k = knob(name, ENVKNOB_INT, err, errlen);
  if (!k) return -EINVAL;
  return config_env_int(name, (int64_t)k->num_def, (int64_t)k->min, (int64_t)k->max, out, err,
                        errlen);
}

int envknob_u64(const char *name, uint64_t *out, char *err, size_t errlen) {
  const struct envknob *k = knob(name, ENVKNOB_U64, err, errlen);
  if (!k) return -EINVAL;
  uint64_t max = k->max == UCX_MAX_U64 ? UINT64_MAX : (uint64_t)k->max;
  const char *v = getenv(name);
  *out = (uint64_t)k->num_def;
  if (!v || !*v) return 0;
  bool digits = true;
  for (const char *p = v; *p; p++)
    if (*p < '0' || *p > '9') digits = false;
  char *end = NULL;
  errno = 0;
  unsigned long long x = digits ? strtoull(v, &end, 10) : 0;
  if (!digits || errno || *end || x > max) {
    snprintf(err, errlen, "%s=\"%s\": not a whole number from 0 to %llu (digits only)", name, v,
             (unsigned long long)max);
    return -EINVAL;
  }
  *out = x;
  return 0;
}

int envknob_bool(const char *name, bool *out, char *err, size_t errlen) {
  if (!knob(name, ENVKNOB_BOOL, err, errlen)) return -EINVAL;
  return config_env_bool(name, out, err, errlen);
}

int envknob_str(const char *name, const char **out, char *err, size_t errlen) {
  const struct envknob *k = knob(name, ENVKNOB_STRING, err, errlen);
  if (!k) return -EINVAL;
  const char *v = getenv(name);
  *out = v && v[0] ? v : k->def;
  if (!k->choices) return 0;
  size_t n = 0;
  while (k->choices[n]) n++;
  char why[128];
  if (config_choice(*out, k->choices, n, why, sizeof(why)) >= 0) return 0;
  snprintf(err, errlen, "%s=\"%.64s\": %s", name, *out, why);
  return -EINVAL;
}

static const char *const type_names[] = {"int", "bool", "string", "uint"};

void envknob_print_json(FILE *out) {
  fputc('[', out);
  for (size_t i = 0; i < envknob_count; i++) {
    const struct envknob *k = &envknob_table[i];
    fprintf(out, "%s\n  {\"name\": ", i ? "," : "");
    config_json_string(out, k->name);
    fprintf(out, ", \"type\": \"%s\", \"default\": ", type_names[k->type]);
    bool num = k->type == ENVKNOB_INT || k->type == ENVKNOB_U64;
    if (k->type == ENVKNOB_STRING)
      config_json_string(out, k->def ? k->def : "");
    else if (k->type == ENVKNOB_BOOL)
      fputs(k->def && strcmp(k->def, "true") == 0 ? "true" : "false", out);
    else
      fprintf(out, "%.0f", k->num_def);
    if (num) fprintf(out, ", \"min\": %.0f, \"max\": ", k->min);
    if (num && k->max == UCX_MAX_U64)
      fprintf(out, "%" PRIu64, UINT64_MAX);
    else if (num)
      fprintf(out, "%.0f", k->max);
    if (k->choices) {
      fputs(", \"choices\": [", out);
      for (size_t c = 0; k->choices[c]; c++) {
        if (c) fputs(", ", out);
        config_json_string(out, k->choices[c]);
      }
      fputc(']', out);
    }
    fputs(", \"source\": \"env\", \"help\": ", out);
    config_json_string(out, k->help);
    fputc('}', out);
  }
  fputs("\n]", out);
}
