/* config: one declarative table of options drives parsing of flags, the PS_*
 * environment, a `key = value` config file, and --help.
 *
 * Precedence: flag > environment > file > default. The environment variable of
 * option "max-frame-bytes" is PS_MAX_FRAME_BYTES; the file key is the option
 * name ("max-frame-bytes = 1048576"; '#' starts a comment; blank lines ignored).
 * The file is named with --config PATH (or PS_CONFIG).
 *
 * Each option writes into a field of the caller's config struct, named by its
 * offset. Strings are copied into fixed char arrays of the struct (size in the
 * table), so the struct needs no freeing. Bad input never exits inside this
 * module: config_parse returns an error code and prints one message that names
 * the option and the source (flag, env, file:line) to stderr; main.c decides
 * to exit 2. */
#ifndef PS_CONFIG_H
#define PS_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum config_type {
  CONFIG_STRING, /* char[size] field */
  CONFIG_INT,    /* int64_t field, range [min, max] */
  CONFIG_DOUBLE, /* double field, range [min, max] */
  CONFIG_BOOL,   /* bool field: true/false/1/0/yes/no/on/off; "--flag" alone = true */
  CONFIG_SIZE,   /* uint64_t bytes, suffixes k/K/KiB, M/MiB, G/GiB (1024-based); range [min, max] */
};

/* Extra validation of a string option after parsing; returns 0 or writes a
 * reason (without the option name) into err and returns -EINVAL.
 *
 * An enumerated value (--consistency, --optimizer, --sync-mode, --device,
 * --log-level, ...) is checked by the parser of the module that owns it,
 * exported as such a function next to that parser (opt_check beside
 * opt_parse, ...), so every program that takes the option refuses a bad value
 * with the same text before anything starts, and main.c converts it with
 * the owner's parser, which cannot fail then. */
typedef int (*config_check_fn)(const char *value, char *err, size_t errlen);

/* The index of value among names[0..n-1] (exact, case-sensitive), or -EINVAL
 * with the reason "expected a, b or c" in err (errlen 0: none): the one
 * parser of the enumerated options whose values are plain names. */
int config_choice(const char *value, const char *const *names, size_t n, char *err, size_t errlen);

struct config_option {
  const char *name; /* long flag without dashes: "listen" -> --listen */
  enum config_type type;
  size_t offset;         /* offsetof(struct your_config, field) */
  size_t size;           /* CONFIG_STRING: sizeof the char array */
  const char *def;       /* default value as text (parsed like any input); NULL = empty/0 */
  double min, max;       /* CONFIG_INT, CONFIG_DOUBLE, CONFIG_SIZE; both 0 = unbounded */
  config_check_fn check; /* optional, CONFIG_STRING only */
  const char *help;      /* one line for --help */
};

/* One table entry for field `field` of the caller's config struct cfg_type. */
#define CONFIG_OPTION(cfg_type, name, type, field, def, min, max, check, help)                   \
  {                                                                                              \
    name, type, offsetof(cfg_type, field), sizeof(((cfg_type *)0)->field), def, min, max, check, \
        help                                                                                     \
  }

/* The table helpers every program uses: define CONFIG_STRUCT as the config
 * struct type ("#define CONFIG_STRUCT struct worker_config") before the table.
 * CONFIG_OPT is a plain option; CONFIG_CHOICE a string whose owner's
 * config_check_fn refuses a bad value (an enumerated one, or another format
 * such as an address). */
#define CONFIG_OPT(name, type, field, def, min, max, help) \
  CONFIG_OPTION(CONFIG_STRUCT, name, type, field, def, min, max, NULL, help)
#define CONFIG_CHOICE(name, field, def, check, help) \
  CONFIG_OPTION(CONFIG_STRUCT, name, CONFIG_STRING, field, def, 0, 0, check, help)

struct config_spec {
  const char *program; /* "ps-server" */
  const char *summary; /* one line shown by --help */
  const struct config_option *options;
  size_t num_options;
  const char *help_tail; /* text --help prints after the options (never --help=json); or NULL */
};

/* An entry of a program's table taken into another's (ps-local forwards
 * ps-worker's and ps-server's): the same name, type, bounds, check and help,
 * stored into a field of this program's struct. `set` names the fields of
 * opt that replace the program's: an override such as a launcher's own
 * default, said where it is made, never a copy of the entry. An entry with
 * from == NULL is this program's own and taken whole. */
struct config_forward {
  const struct config_spec *from;
  struct config_option opt; /* name, offset, size; plus the fields named in set */
  unsigned set;             /* CONFIG_SET_* */
};
enum {
  CONFIG_SET_DEF = 1u,   /* opt.def (NULL: none, the zero value) */
  CONFIG_SET_HELP = 2u,  /* opt.help */
  CONFIG_SET_CHECK = 4u, /* opt.check */
  CONFIG_SET_RANGE = 8u, /* opt.min, opt.max */
};
/* A forwarded entry for field `field` of CONFIG_STRUCT, as its program has
 * it (CONFIG_FWD) or with overrides: designated initializers of opt's fields
 * named in set, e.g.
 * CONFIG_FWD_SET(&worker_spec, "batch-size", batch_size, CONFIG_SET_DEF, .def = "256"). */
#define CONFIG_FWD_SET(from_, name_, field_, set_, ...) \
  {                                                     \
    from_,                                              \
        {.name = name_,                                 \
         .offset = offsetof(CONFIG_STRUCT, field_),     \
         .size = sizeof(((CONFIG_STRUCT *)0)->field_),  \
         __VA_ARGS__},                                  \
        set_                                            \
  }
#define CONFIG_FWD(from_, name_, field_)                \
  {                                                     \
    from_,                                              \
        {.name = name_,                                 \
         .offset = offsetof(CONFIG_STRUCT, field_),     \
         .size = sizeof(((CONFIG_STRUCT *)0)->field_)}, \
        0                                               \
  }
/* This program's own entry among forwarded ones: CONFIG_OPT/CONFIG_CHOICE. */
#define CONFIG_OWN(entry) \
  { NULL, entry, 0 }

/* spec's entry called name, or NULL. */
const struct config_option *config_find(const struct config_spec *spec, const char *name);

/* Builds n table entries into out from fwd: each forwarded one is looked up
 * in its program's table and overridden as set says. Returns 0, or -ENOENT
 * after printing which entry is missing or whose field does not fit its
 * type (a programming error: the program's table changed). */
int config_forward(const struct config_forward *fwd, size_t n, struct config_option *out,
                   FILE *err_out);

enum {
  CONFIG_OK = 0,
  CONFIG_HELP = 1,    /* --help (or --help=json) was printed to stdout: exit 0 */
  CONFIG_VERSION = 2, /* --version printed: exit 0 */
};

/* Fills *cfg from defaults, file, environment (envp, NULL = environ) and argv.
 * Returns CONFIG_OK, CONFIG_HELP, CONFIG_VERSION or -EINVAL (message already
 * written to err_out, normally stderr). Positional arguments are refused. */
int config_parse(const struct config_spec *spec, void *cfg, int argc, char **argv, char **envp,
                 FILE *err_out);

/* Writes --help text: usage, summary, then each option with its env name,
 * default and help. */
void config_print_help(const struct config_spec *spec, FILE *out);

/* Writes the table as JSON (`--help=json`): {"program", "summary",
 * "precedence", "options": [{name, type, default, min, max, choices, help,
 * flag, env, file_key}], "env": envknob_print_json's list}. A default is
 * typed (a size in bytes); min and max are null when unbounded; choices
 * appear where the check takes a fixed set of words, read from its refusal
 * "expected a, b or c" (config_choice's text), so they cannot drift from it. */
void config_print_json(const struct config_spec *spec, FILE *out);
/* Writes s as a JSON string literal (quoted, escaped). */
void config_json_string(FILE *out, const char *s);

/* Resolves an index option such as --shard or --rank: a number, or "auto" =
 * the pod index from PS_POD_INDEX (the apps.kubernetes.io/pod-index label
 * through the downward API) or else the StatefulSet hostname "name-N". The
 * result must lie in [0, limit). On error writes one message naming
 * "<program>: option --<option>" to err_out and returns -EINVAL. */
int config_pod_index(const char *value, const char *program, const char *option, int64_t limit,
                     const char *limit_name, FILE *err_out, int64_t *out);

/* The environment knobs outside the option tables (test and tuning switches
 * such as PS_DISABLE_IO_URING or PS_HEARTBEAT_MS) read with the tables'
 * rules: unset or empty gives false / def; a bad value returns -EINVAL and
 * writes "NAME=\"value\": expected ..." into err, naming what is allowed. */
int config_env_bool(const char *name, bool *out, char *err, size_t errlen);
/* Plain decimal digits with an optional '-', within [min, max]. */
int config_env_int(const char *name, int64_t def, int64_t min, int64_t max, int64_t *out, char *err,
                   size_t errlen);

/* Parses "12", "4k", "4KiB", "1M", "2GiB" into bytes; returns 0 or -EINVAL. */
int config_parse_size(const char *s, uint64_t *out);

#endif
