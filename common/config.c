/* config: table-driven parsing of defaults, a config file, the environment
 * and flags into the caller's struct.
 *
 * The sources are applied in order of increasing precedence: defaults, then
 * the file, then PS_* variables, then flags, each overwriting the fields the
 * previous ones set. Every value that is present is parsed and checked even if
 * a later source overrides it, so a typo in the ConfigMap is reported instead
 * of hiding behind a flag. argv is walked twice with the same tokenizer: the
 * first walk finds --help, --version and --config (the file must be read
 * before flags are applied) and refuses malformed command lines; the second
 * applies the values. Nothing here allocates except the file reader.
 *
 * Every failure prints exactly one line, "<program>: <what> (<source>)", to
 * err_out and returns -EINVAL; nothing here exits. The source is "flag",
 * "env PS_X", "file PATH:LINE" or "default" (a bad default is a programming
 * error but is reported the same way). Unknown PS_* variables are ignored:
 * Kubernetes injects PS_SERVER_PORT and the like for a Service named ps-server. */
#include "config.h"

#include "envknob.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#ifndef PS_VERSION
#define PS_VERSION "0.1.0"
#endif

/* Longest option name; keeps the derived env names and messages bounded. */
enum { NAME_MAX_LEN = 64 };

static const char *const type_names[] = {"string", "int", "float", "bool", "size"};

static const char *type_name(enum config_type t) {
  return (unsigned)t < sizeof(type_names) / sizeof(type_names[0]) ? type_names[t] : "?";
}

static int fail(const struct config_spec *spec, FILE *err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fail(const struct config_spec *spec, FILE *err, const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  /* Values come from users and may hold newlines; keep the one-line promise. */
  for (char *p = msg; *p; p++) {
    if ((unsigned char)*p < ' ') *p = '?';
  }
  fprintf(err, "%s: %s\n", spec->program, msg);
  return -EINVAL;
}

static void env_name(const char *opt, char *buf, size_t n) {
  size_t i = 0;
  i += (size_t)snprintf(buf, n, "PS_");
  for (const char *p = opt; *p && i + 1 < n; p++) {
    buf[i++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
  }
  buf[i] = '\0';
}

static const char *env_lookup(char **envp, const char *name) {
  size_t n = strlen(name);
  if (!envp) envp = environ;
  for (char **e = envp; e && *e; e++) {
    if (strncmp(*e, name, n) == 0 && (*e)[n] == '=') return *e + n + 1;
  }
  return NULL;
}

static const struct config_option *option_find(const struct config_spec *spec, const char *name,
                                               size_t len) {
  for (size_t i = 0; i < spec->num_options; i++) {
    const struct config_option *o = &spec->options[i];
    if (strlen(o->name) == len && strncmp(o->name, name, len) == 0) return o;
  }
  return NULL;
}

static int parse_bool(const char *s, bool *out) {
  static const char *const yes[] = {"true", "1", "yes", "on"};
  static const char *const no[] = {"false", "0", "no", "off"};
  for (size_t i = 0; i < 4; i++) {
    if (strcasecmp(s, yes[i]) == 0) {
      *out = true;
      return 0;
    }
    if (strcasecmp(s, no[i]) == 0) {
      *out = false;
      return 0;
    }
  }
  return -EINVAL;
}

static bool has_range(const struct config_option *o) {
  return !(o->min == 0 && o->max == 0);
}

/* One parser per type. Each parses v for o and stores it into field; every
 * check runs before the store, so a refused value leaves the field as it was.
 * On failure the reason (without the option name or source) goes into why. */
typedef int (*value_parser)(const struct config_option *o, const char *v, void *field, char *why,
                            size_t n);

static int parse_string(const struct config_option *o, const char *v, void *field, char *why,
                        size_t n) {
  size_t len = strlen(v);
  if (len >= o->size) {
    snprintf(why, n, "value is too long (%zu bytes, at most %zu)", len, o->size ? o->size - 1 : 0);
    return -EINVAL;
  }
  if (o->check) {
    char reason[384] = "invalid value"; /* room for a list of valid names (--blas-kernel) */
    if (o->check(v, reason, sizeof(reason)) != 0) {
      snprintf(why, n, "\"%.128s\": %s", v, reason);
      return -EINVAL;
    }
  }
  memcpy(field, v, len + 1);
  return 0;
}

static int parse_int(const struct config_option *o, const char *v, void *field, char *why,
                     size_t n) {
  char *end;
  /* strtoll alone would accept " 5", "+5" and "" and clamp overflow. */
  if (!(isdigit((unsigned char)v[0]) || (v[0] == '-' && isdigit((unsigned char)v[1])))) {
    snprintf(why, n, "\"%.128s\" is not an integer", v);
    return -EINVAL;
  }
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (*end) {
    snprintf(why, n, "\"%.128s\" is not an integer", v);
    return -EINVAL;
  }
  if (errno == ERANGE) {
    snprintf(why, n, "%.128s is out of range", v);
    return -EINVAL;
  }
  if (has_range(o) && ((double)x < o->min || (double)x > o->max)) {
    snprintf(why, n, "%.128s is out of range [%.0f, %.0f]", v, o->min, o->max);
    return -EINVAL;
  }
  int64_t x64 = x;
  memcpy(field, &x64, sizeof(x64));
  return 0;
}

static int parse_double(const struct config_option *o, const char *v, void *field, char *why,
                        size_t n) {
  char *end;
  /* Decimal notation only, as parse_int: strtod alone would take " 1", "+1",
   * hex floats ("0x1p3") and "infinity". */
  if (!(isdigit((unsigned char)v[0]) || v[0] == '.' ||
        (v[0] == '-' && (isdigit((unsigned char)v[1]) || v[1] == '.'))) ||
      v[strspn(v, "0123456789.eE+-")] != '\0') {
    snprintf(why, n, "\"%.128s\" is not a number", v);
    return -EINVAL;
  }
  double x = strtod(v, &end);
  /* inf, nan and overflow (strtod gives HUGE_VAL) are never a sane setting. */
  if (*end || !isfinite(x)) {
    snprintf(why, n, "\"%.128s\" is not a finite number", v);
    return -EINVAL;
  }
  if (has_range(o) && (x < o->min || x > o->max)) {
    snprintf(why, n, "%.128s is out of range [%g, %g]", v, o->min, o->max);
    return -EINVAL;
  }
  memcpy(field, &x, sizeof(x));
  return 0;
}

static int parse_bool_value(const struct config_option *o, const char *v, void *field, char *why,
                            size_t n) {
  bool b;
  if (parse_bool(v, &b) != 0) {
    snprintf(why, n, "\"%.128s\" is not a boolean (true/false, yes/no, on/off, 1/0)", v);
    return -EINVAL;
  }
  memcpy(field, &b, sizeof(b));
  return 0;
}

static int parse_size_value(const struct config_option *o, const char *v, void *field, char *why,
                            size_t n) {
  uint64_t x;
  if (config_parse_size(v, &x) != 0) {
    snprintf(why, n, "\"%.128s\" is not a size (%s)", v,
             v[0] == '-' ? "sizes cannot be negative" : "e.g. 4096, 64k, 4MiB, 2G");
    return -EINVAL;
  }
  if (has_range(o) && ((double)x < o->min || (double)x > o->max)) {
    snprintf(why, n, "%.128s is out of range [%.0f, %.0f] bytes", v, o->min, o->max);
    return -EINVAL;
  }
  memcpy(field, &x, sizeof(x));
  return 0;
}

static const value_parser parsers[] = {
    [CONFIG_STRING] = parse_string,   [CONFIG_INT] = parse_int,
    [CONFIG_DOUBLE] = parse_double,   [CONFIG_BOOL] = parse_bool_value,
    [CONFIG_SIZE] = parse_size_value,
};

/* Parses v and stores it into o's field of cfg, or prints one message. */
static int option_set(const struct config_spec *spec, const struct config_option *o, void *cfg,
                      const char *v, const char *where, FILE *err) {
  char why[512];
  if ((unsigned)o->type >= sizeof(parsers) / sizeof(parsers[0])) {
    return fail(spec, err, "option --%s: unknown type %d (table)", o->name, (int)o->type);
  }
  if (parsers[o->type](o, v, (char *)cfg + o->offset, why, sizeof(why)) != 0) {
    return fail(spec, err, "option --%s: %s (%s)", o->name, why, where);
  }
  return 0;
}

static int apply_defaults(const struct config_spec *spec, void *cfg, FILE *err) {
  for (size_t i = 0; i < spec->num_options; i++) {
    const struct config_option *o = &spec->options[i];
    if (strlen(o->name) > NAME_MAX_LEN) {
      return fail(spec, err, "option --%.64s...: name is too long (table)", o->name);
    }
    if (o->type == CONFIG_STRING && o->size == 0) {
      return fail(spec, err, "option --%s: string field has size 0 (table)", o->name);
    }
    if (o->def) {
      int rc = option_set(spec, o, cfg, o->def, "default", err);
      if (rc) return rc;
      continue;
    }
    /* NULL default means the zero value, which needs no parsing. */
    char *field = (char *)cfg + o->offset;
    switch (o->type) {
      case CONFIG_STRING:
        field[0] = '\0';
        break;
      case CONFIG_INT:
        memset(field, 0, sizeof(int64_t));
        break;
      case CONFIG_DOUBLE:
        memset(field, 0, sizeof(double));
        break;
      case CONFIG_BOOL:
        memset(field, 0, sizeof(bool));
        break;
      case CONFIG_SIZE:
        memset(field, 0, sizeof(uint64_t));
        break;
    }
  }
  return 0;
}

static char *trim(char *s) {
  while (isspace((unsigned char)*s)) s++;
  size_t n = strlen(s);
  while (n > 0 && isspace((unsigned char)s[n - 1])) s[--n] = '\0';
  return s;
}

/* Reads `key = value` lines. '#' starts a comment at the start of a line or
 * after whitespace, so values such as "http://h/#x" survive. A value wrapped in
 * double quotes keeps its inner spaces and '#'. */
static int apply_file(const struct config_spec *spec, void *cfg, const char *path,
                      const char *named_by, FILE *err) {
  char *buf = NULL;
  size_t cap = 0;
  int rc = 0;
  long lineno = 0;
  FILE *f = fopen(path, "r");
  if (!f) {
    rc = fail(spec, err, "cannot read config file %s: %s (%s)", path, strerror(errno), named_by);
    goto out;
  }
  errno = 0;
  ssize_t got;
  while ((got = getline(&buf, &cap, f)) >= 0) {
    char where[PATH_MAX + 32];
    lineno++;
    snprintf(where, sizeof(where), "file %s:%ld", path, lineno);
    /* Every string below ends at the first NUL: the rest of the line would
     * vanish silently ("workers = 1\0 0" reads as 1). */
    if (memchr(buf, '\0', (size_t)got)) {
      rc = fail(spec, err, "line holds a NUL byte (%s)", where);
      goto out;
    }
    bool quoted = false;
    for (char *p = buf; *p; p++) {
      if (*p == '"') quoted = !quoted;
      if (*p == '#' && !quoted && (p == buf || isspace((unsigned char)p[-1]))) {
        *p = '\0';
        break;
      }
    }
    char *line = trim(buf);
    if (!line[0]) continue;
    char *eq = strchr(line, '=');
    if (!eq) {
      rc = fail(spec, err, "expected \"key = value\", got \"%.128s\" (%s)", line, where);
      goto out;
    }
    *eq = '\0';
    char *key = trim(line);
    char *val = trim(eq + 1);
    size_t vlen = strlen(val);
    if (vlen >= 2 && val[0] == '"' && val[vlen - 1] == '"') {
      val[vlen - 1] = '\0';
      val++;
    }
    const struct config_option *o = option_find(spec, key, strlen(key));
    if (!o) {
      rc = fail(spec, err, "unknown option \"%.128s\" (%s)", key, where);
      goto out;
    }
    rc = option_set(spec, o, cfg, val, where, err);
    if (rc) goto out;
    errno = 0;
  }
  if (ferror(f)) {
    rc = fail(spec, err, "cannot read config file %s: %s (%s)", path, strerror(errno ? errno : EIO),
              named_by);
  }
out:
  free(buf);
  if (f) fclose(f);
  return rc;
}

static int apply_env(const struct config_spec *spec, void *cfg, char **envp, FILE *err) {
  for (size_t i = 0; i < spec->num_options; i++) {
    const struct config_option *o = &spec->options[i];
    char name[NAME_MAX_LEN + 8], where[NAME_MAX_LEN + 16];
    env_name(o->name, name, sizeof(name));
    const char *v = env_lookup(envp, name);
    if (!v) continue;
    snprintf(where, sizeof(where), "env %s", name);
    int rc = option_set(spec, o, cfg, v, where, err);
    if (rc) return rc;
  }
  return 0;
}

enum arg_kind { ARG_END, ARG_OPTION, ARG_CONFIG, ARG_HELP, ARG_HELP_JSON, ARG_VERSION };

struct arg_iter {
  int argc;
  char **argv;
  int i;
};

/* Returns the next command-line item. For ARG_OPTION and ARG_CONFIG *opt and
 * *value are set; a bare boolean flag yields "true". A value that starts with
 * "--" is taken as a forgotten value, not as data (use --name=--x for that). A
 * boolean takes the next word only if it reads as a boolean, so
 * "--verbose --x" and "--verbose false" both mean what they say. Returns
 * -EINVAL after printing the message. */
static int arg_next(struct arg_iter *it, const struct config_spec *spec,
                    const struct config_option **opt, const char **value, FILE *err) {
  if (it->i >= it->argc) return ARG_END;
  const char *a = it->argv[it->i++];
  if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) return ARG_HELP;
  if (strcmp(a, "--help=json") == 0) return ARG_HELP_JSON;
  if (strcmp(a, "--version") == 0) return ARG_VERSION;
  if (strcmp(a, "--") == 0) {
    if (it->i >= it->argc) return ARG_END;
    return fail(spec, err, "unexpected argument \"%.128s\" (flag)", it->argv[it->i]);
  }
  if (strncmp(a, "--", 2) != 0 || a[2] == '\0' || a[2] == '=') {
    if (a[0] == '-' && a[1]) return fail(spec, err, "unknown option %.128s (flag)", a);
    return fail(spec, err, "unexpected argument \"%.128s\"; options are --name value (flag)", a);
  }
  const char *name = a + 2;
  const char *eq = strchr(name, '=');
  size_t len = eq ? (size_t)(eq - name) : strlen(name);
  bool is_config = len == 6 && strncmp(name, "config", 6) == 0;
  *opt = is_config ? NULL : option_find(spec, name, len);
  if (!is_config && !*opt) {
    return fail(spec, err, "unknown option --%.*s (flag)", (int)(len > 128 ? 128 : len), name);
  }
  if (eq) {
    *value = eq + 1;
  } else if (*opt && (*opt)->type == CONFIG_BOOL) {
    bool b;
    if (it->i < it->argc && parse_bool(it->argv[it->i], &b) == 0) {
      *value = it->argv[it->i++];
    } else {
      *value = "true";
    }
  } else if (it->i < it->argc && strncmp(it->argv[it->i], "--", 2) != 0) {
    *value = it->argv[it->i++];
  } else {
    return fail(spec, err, "option --%.*s: missing value (flag)", (int)len, name);
  }
  return is_config ? ARG_CONFIG : ARG_OPTION;
}

/* --help and --version act when the first walk reaches them, so
 * "--bogus --help" reports --bogus (as getopt would) while "--lr x --help"
 * prints the help: values are not parsed until the second walk. */
int config_parse(const struct config_spec *spec, void *cfg, int argc, char **argv, char **envp,
                 FILE *err_out) {
  FILE *err = err_out ? err_out : stderr;
  const struct config_option *opt;
  const char *value = NULL, *config_path = NULL, *config_src = NULL;
  struct arg_iter it = {argc, argv, 1};
  int kind, rc;

  /* First walk: structure, --help/--version, and where the file is. */
  while ((kind = arg_next(&it, spec, &opt, &value, err)) != ARG_END) {
    if (kind < 0) return kind;
    if (kind == ARG_HELP || kind == ARG_HELP_JSON) {
      (kind == ARG_HELP ? config_print_help : config_print_json)(spec, stdout);
      return CONFIG_HELP;
    }
    if (kind == ARG_VERSION) {
      printf("%s %s\n", spec->program, PS_VERSION);
      return CONFIG_VERSION;
    }
    if (kind == ARG_CONFIG) {
      config_path = value;
      config_src = "flag --config";
    }
  }
  if (!config_path && (config_path = env_lookup(envp, "PS_CONFIG"))) config_src = "env PS_CONFIG";
  if (config_path && !config_path[0]) {
    return fail(spec, err, "option --config: empty path (%s)", config_src);
  }

  rc = apply_defaults(spec, cfg, err);
  if (!rc && config_path) rc = apply_file(spec, cfg, config_path, config_src, err);
  if (!rc) rc = apply_env(spec, cfg, envp, err);
  if (rc) return rc;

  /* Second walk: flags win over everything. Structure was checked above. */
  it.i = 1;
  while ((kind = arg_next(&it, spec, &opt, &value, err)) != ARG_END) {
    if (kind < 0) return kind;
    if (kind != ARG_OPTION) continue;
    rc = option_set(spec, opt, cfg, value, "flag", err);
    if (rc) return rc;
  }
  return CONFIG_OK;
}

void config_print_help(const struct config_spec *spec, FILE *out) {
  int width = (int)strlen("--config <path>");
  for (size_t i = 0; i < spec->num_options; i++) {
    const struct config_option *o = &spec->options[i];
    int w = (int)(strlen(o->name) + strlen(type_name(o->type)) + 5);
    if (w > width) width = w;
  }
  fprintf(out, "Usage: %s [--option value | --option=value]...\n", spec->program);
  if (spec->summary) fprintf(out, "%s\n", spec->summary);
  fprintf(out,
          "\nEach option also reads PS_<NAME> from the environment and `name = value` from\n"
          "the --config file; a flag beats the environment, which beats the file.\n\nOptions:\n");
  for (size_t i = 0; i < spec->num_options; i++) {
    const struct config_option *o = &spec->options[i];
    char flag[NAME_MAX_LEN + 32], env[NAME_MAX_LEN + 8];
    snprintf(flag, sizeof(flag), "--%s <%s>", o->name, type_name(o->type));
    env_name(o->name, env, sizeof(env));
    /* A NULL default is the zero value; show it as such. */
    const char *def = o->def && o->def[0]        ? o->def
                      : o->type == CONFIG_STRING ? "none"
                      : o->type == CONFIG_BOOL   ? "false"
                                                 : "0";
    fprintf(out, "  %-*s  %s  [env %s, default %s", width, flag, o->help ? o->help : "", env, def);
    if (has_range(o) && o->type != CONFIG_STRING && o->type != CONFIG_BOOL) {
      fprintf(out, o->type == CONFIG_DOUBLE ? ", range %g..%g" : ", range %.0f..%.0f", o->min,
              o->max);
    }
    fprintf(out, "]\n");
  }
  fprintf(out, "  %-*s  %s  [env PS_CONFIG]\n", width, "--config <path>",
          "read options from a `key = value` file");
  fprintf(out, "  %-*s  %s\n", width, "-h, --help", "print this help and exit");
  fprintf(out, "  %-*s  %s\n", width, "--help=json", "print the options as JSON and exit");
  fprintf(out, "  %-*s  %s\n", width, "--version", "print the version and exit");
  if (spec->help_tail) fputs(spec->help_tail, out);
}

const struct config_option *config_find(const struct config_spec *spec, const char *name) {
  return option_find(spec, name, strlen(name));
}

int config_forward(const struct config_forward *fwd, size_t n, struct config_option *out,
                   FILE *err_out) {
  FILE *err = err_out ? err_out : stderr;
  static const size_t field_size[] = {[CONFIG_INT] = sizeof(int64_t),
                                      [CONFIG_DOUBLE] = sizeof(double),
                                      [CONFIG_BOOL] = sizeof(bool),
                                      [CONFIG_SIZE] = sizeof(uint64_t)};
  for (size_t i = 0; i < n; i++) {
    const struct config_forward *f = &fwd[i];
    if (!f->from) {
      out[i] = f->opt;
      continue;
    }
    const struct config_option *o = option_find(f->from, f->opt.name, strlen(f->opt.name));
    if (!o || (o->type != CONFIG_STRING && field_size[o->type] != f->opt.size)) {
      fprintf(err, "%s: option --%s: %s (table)\n", f->from->program, f->opt.name,
              o ? "forwarded into a field of another type" : "no such option to forward");
      return -ENOENT;
    }
    out[i] = *o;
    out[i].offset = f->opt.offset;
    out[i].size = f->opt.size;
    if (f->set & CONFIG_SET_DEF) out[i].def = f->opt.def;
    if (f->set & CONFIG_SET_HELP) out[i].help = f->opt.help;
    if (f->set & CONFIG_SET_CHECK) out[i].check = f->opt.check;
    if (f->set & CONFIG_SET_RANGE) {
      out[i].min = f->opt.min;
      out[i].max = f->opt.max;
    }
  }
  return 0;
}

void config_json_string(FILE *out, const char *s) {
  fputc('"', out);
  for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
    if (*p == '"' || *p == '\\')
      fprintf(out, "\\%c", *p);
    else if (*p < ' ')
      fprintf(out, "\\u%04x", *p);
    else
      fputc(*p, out);
  }
  fputc('"', out);
}

/* The words of a check's refusal "expected a, b or c", as a JSON array, when
 * every one is a plain word (a format such as ssp:K or host:port is not a
 * fixed set). No check, or another message: nothing is written. */
static void print_choices(const struct config_option *o, FILE *out) {
  char why[384] = "", words[384];
  if (!o->check || o->check("?", why, sizeof(why)) == 0) return;
  if (strncmp(why, "expected ", 9) != 0) return;
  snprintf(words, sizeof(words), "%s", why + 9);
  size_t n = 0;
  char *list[32];
  for (char *save = NULL, *t = strtok_r(words, ", ", &save); t && n < 32;
       t = strtok_r(NULL, ", ", &save)) {
    if (strcmp(t, "or") == 0) continue;
    if (t[strspn(t, "abcdefghijklmnopqrstuvwxyz0123456789-_")] != '\0') return;
    list[n++] = t;
  }
  if (n < 2) return;
  fputs(", \"choices\": [", out);
  for (size_t i = 0; i < n; i++) {
    if (i) fputs(", ", out);
    config_json_string(out, list[i]);
  }
  fputc(']', out);
}

/* o's default as a typed JSON value: parsed as any input would be. */
static void print_default(const struct config_option *o, FILE *out) {
  union {
    int64_t i;
    uint64_t u;
    double d;
    bool b;
  } v;
  char why[512];
  memset(&v, 0, sizeof(v));
  if (o->type == CONFIG_STRING || !o->def) {
    if (o->type == CONFIG_STRING)
      config_json_string(out, o->def);
    else
      fputs(o->type == CONFIG_BOOL ? "false" : "0", out);
    return;
  }
  if (parsers[o->type](o, o->def, &v, why, sizeof(why)) != 0) {
    fputs("null", out); /* a bad default: config_parse reports it */
    return;
  }
  if (o->type == CONFIG_INT) fprintf(out, "%lld", (long long)v.i);
  if (o->type == CONFIG_SIZE) fprintf(out, "%llu", (unsigned long long)v.u);
  if (o->type == CONFIG_DOUBLE) fprintf(out, "%.17g", v.d);
  if (o->type == CONFIG_BOOL) fputs(v.b ? "true" : "false", out);
}

void config_print_json(const struct config_spec *spec, FILE *out) {
  fputs("{\"program\": ", out);
  config_json_string(out, spec->program);
  fputs(", \"summary\": ", out);
  config_json_string(out, spec->summary);
  fputs(",\n \"precedence\": [\"flag\", \"env\", \"file\", \"default\"],\n \"options\": [", out);
  for (size_t i = 0; i < spec->num_options; i++) {
    const struct config_option *o = &spec->options[i];
    char env[NAME_MAX_LEN + 8];
    env_name(o->name, env, sizeof(env));
    fprintf(out, "%s\n  {\"name\": ", i ? "," : "");
    config_json_string(out, o->name);
    fprintf(out, ", \"type\": \"%s\", \"default\": ", type_name(o->type));
    print_default(o, out);
    bool ranged = has_range(o) && o->type != CONFIG_STRING && o->type != CONFIG_BOOL;
    if (!ranged)
      fputs(", \"min\": null, \"max\": null", out);
    else if (o->type == CONFIG_DOUBLE)
      fprintf(out, ", \"min\": %.17g, \"max\": %.17g", o->min, o->max);
    else
      fprintf(out, ", \"min\": %.0f, \"max\": %.0f", o->min, o->max);
    print_choices(o, out);
    fprintf(out, ", \"flag\": \"--%s\", \"env\": \"%s\", \"file_key\": ", o->name, env);
    config_json_string(out, o->name);
    fputs(", \"help\": ", out);
    config_json_string(out, o->help);
    fputc('}', out);
  }
  fputs("\n ],\n \"env\": ", out);
  envknob_print_json(out);
  fputs("}\n", out);
}

int config_parse_size(const char *s, uint64_t *out) {
  static const struct {
    const char *suffix;
    uint64_t mult;
  } units[] = {
      {"", 1},
      {"b", 1},
      {"k", 1ull << 10},
      {"kb", 1ull << 10},
      {"kib", 1ull << 10},
      {"m", 1ull << 20},
      {"mb", 1ull << 20},
      {"mib", 1ull << 20},
      {"g", 1ull << 30},
      {"gb", 1ull << 30},
      {"gib", 1ull << 30},
  };
  uint64_t v = 0;
  const char *p = s;
  if (!s || !isdigit((unsigned char)*p)) return -EINVAL; /* also refuses "", "-1", " 1" */
  for (; isdigit((unsigned char)*p); p++) {
    uint64_t d = (uint64_t)(*p - '0');
    if (v > (UINT64_MAX - d) / 10) return -EINVAL;
    v = v * 10 + d;
  }
  for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
    if (strcasecmp(p, units[i].suffix) != 0) continue;
    if (v > UINT64_MAX / units[i].mult) return -EINVAL;
    *out = v * units[i].mult;
    return 0;
  }
  return -EINVAL;
}

/* Plain decimal digits, no sign, space or suffix, below 2^63. */
static int parse_index(const char *s, int64_t *out) {
  int64_t v = 0;
  if (!s || !isdigit((unsigned char)*s)) return -EINVAL;
  for (; isdigit((unsigned char)*s); s++) {
    int d = *s - '0';
    if (v > (INT64_MAX - d) / 10) return -EINVAL;
    v = v * 10 + d;
  }
  if (*s) return -EINVAL;
  *out = v;
  return 0;
}

int config_pod_index(const char *value, const char *program, const char *option, int64_t limit,
                     const char *limit_name, FILE *err_out, int64_t *out) {
  FILE *err = err_out ? err_out : stderr;
  char host[256] = "";
  const char *src = value;
  if (strcmp(value, "auto") == 0) {
    src = getenv("PS_POD_INDEX");
    if (!src || !*src) {
      if (gethostname(host, sizeof(host) - 1) != 0) return -EINVAL;
      char *dash = strrchr(host, '-');
      if (!dash) {
        fprintf(err,
                "%s: option --%s: auto, but hostname \"%s\" has no -N suffix and PS_POD_INDEX "
                "is unset\n",
                program, option, host);
        return -EINVAL;
      }
      src = dash + 1;
    }
  }
  /* strtoll would take " 0", "+0" and "0x" prefixes of nothing, and clamp. */
  int64_t v;
  if (parse_index(src, &v) != 0) {
    fprintf(err,
            "%s: option --%s: \"%.128s\" is not a whole number (digits only) in [0, %lld) (%s)\n",
            program, option, src, (long long)limit, limit_name);
    return -EINVAL;
  }
  if (v >= limit) {
    fprintf(err, "%s: option --%s: \"%.128s\" is not in [0, %lld) (%s)\n", program, option, src,
            (long long)limit, limit_name);
    return -EINVAL;
  }
  *out = v;
  return 0;
}

int config_env_bool(const char *name, bool *out, char *err, size_t errlen) {
  const char *v = getenv(name);
  *out = false;
  if (!v || !v[0]) return 0;
  if (parse_bool(v, out) == 0) return 0;
  snprintf(err, errlen, "%s=\"%.64s\": expected true/false, yes/no, on/off or 1/0", name, v);
  return -EINVAL;
}

int config_env_int(const char *name, int64_t def, int64_t min, int64_t max, int64_t *out, char *err,
                   size_t errlen) {
  const char *v = getenv(name);
  *out = def;
  if (!v || !v[0]) return 0;
  int64_t x = 0;
  bool neg = v[0] == '-';
  if (parse_index(v + neg, &x) == 0 && (neg ? -x : x) >= min && (neg ? -x : x) <= max) {
    *out = neg ? -x : x;
    return 0;
  }
  snprintf(err, errlen, "%s=\"%.64s\": expected a whole number from %lld to %lld", name, v,
           (long long)min, (long long)max);
  return -EINVAL;
}

int config_choice(const char *value, const char *const *names, size_t n, char *err, size_t errlen) {
  for (size_t i = 0; value && i < n; i++)
    if (strcmp(value, names[i]) == 0) return (int)i;
  size_t len = 0;
  if (errlen) len += (size_t)snprintf(err, errlen, "expected ");
  for (size_t i = 0; i < n && len < errlen; i++)
    len += (size_t)snprintf(err + len, errlen - len, "%s%s", names[i],
                            i + 1 == n   ? ""
                            : i + 2 == n ? " or "
                                         : ", ");
  return -EINVAL;
}
