/* test_config: drives config_parse with a sample table covering every option
 * type, a temporary config file and a private envp array (the process
 * environment is never read or changed). Checks precedence, each refusal and
 * its one-line message (captured with open_memstream), --help, --version and
 * config_parse_size. Exit 0 = pass, 1 = fail. */
#include "config.h"

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "envknob.h"

struct tcfg {
  char name[16];
  int64_t workers;
  double lr;
  bool verbose;
  uint64_t buf;
  char listen[64];
};

static int check_listen(const char *v, char *err, size_t errlen) {
  if (!strchr(v, ':')) {
    snprintf(err, errlen, "expected host:port");
    return -EINVAL;
  }
  return 0;
}

static const struct config_option options[] = {
    {"name", CONFIG_STRING, offsetof(struct tcfg, name), sizeof(((struct tcfg *)0)->name), "job", 0,
     0, NULL, "job name"},
    {"workers", CONFIG_INT, offsetof(struct tcfg, workers), 0, "4", 1, 64, NULL,
     "number of workers"},
    {"lr", CONFIG_DOUBLE, offsetof(struct tcfg, lr), 0, "0.1", 0, 10, NULL, "learning rate"},
    {"verbose", CONFIG_BOOL, offsetof(struct tcfg, verbose), 0, "false", 0, 0, NULL, "log more"},
    {"buf-size", CONFIG_SIZE, offsetof(struct tcfg, buf), 0, "64k", 1024, 1ull << 40, NULL,
     "buffer size"},
    {"listen", CONFIG_STRING, offsetof(struct tcfg, listen), sizeof(((struct tcfg *)0)->listen),
     ":7070", 0, 0, check_listen, "listen address"},
};

static const struct config_spec spec = {"ps-test", "A test program.", options,
                                        sizeof(options) / sizeof(options[0]), NULL};

static char *empty_env[] = {NULL};

/* Runs config_parse on a NULL-terminated argv (argv[0] added) and returns its
 * result; *msg gets what it wrote to err_out (caller frees). */
static int parse(struct tcfg *c, char **envp, char **msg, const char *const *args) {
  char *argv[32] = {"ps-test"};
  int argc = 1;
  for (; args && args[argc - 1]; argc++) argv[argc] = (char *)args[argc - 1];
  size_t len = 0;
  *msg = NULL;
  FILE *err = open_memstream(msg, &len);
  memset(c, 0x5a, sizeof(*c)); /* garbage, so a missed default shows */
  int rc = config_parse(&spec, c, argc, argv, envp, err);
  fclose(err);
  return rc;
}

static int count_lines(const char *s) {
  int n = 0;
  for (; *s; s++) n += *s == '\n';
  return n;
}

/* Expects -EINVAL and exactly one line containing every given fragment. */
static void expect_error(int line, char **envp, const char *const *args, const char *frag1,
                         const char *frag2) {
  struct tcfg c;
  char *msg;
  int rc = parse(&c, envp, &msg, args);
  if (rc != -EINVAL || count_lines(msg) != 1 || !strstr(msg, frag1) ||
      (frag2 && !strstr(msg, frag2)) || strncmp(msg, "ps-test: ", 9) != 0) {
    fprintf(stderr, "line %d: expected one error with \"%s\" and \"%s\", got rc=%d msg=%s\n", line,
            frag1, frag2 ? frag2 : "", rc, msg);
    failures++;
  }
  free(msg);
}
#define EXPECT_ERROR(envp, f1, f2, ...) \
  expect_error(__LINE__, envp, (const char *const[]){__VA_ARGS__, NULL}, f1, f2)

static char *write_file(const char *text) {
  const char *dir = getenv("TMPDIR");
  char *path = malloc(4096);
  snprintf(path, 4096, "%s/test_config_XXXXXX", dir && dir[0] ? dir : "/tmp");
  int fd = mkstemp(path);
  if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) {
    perror("mkstemp/write");
    exit(1);
  }
  close(fd);
  return path;
}

static void test_defaults_and_forms(void) {
  struct tcfg c;
  char *msg;
  CHECK(parse(&c, empty_env, &msg, NULL) == CONFIG_OK);
  CHECK(strcmp(msg, "") == 0);
  free(msg);
  CHECK(strcmp(c.name, "job") == 0);
  CHECK(c.workers == 4);
  CHECK(c.lr == 0.1);
  CHECK(c.verbose == false);
  CHECK(c.buf == 65536);
  CHECK(strcmp(c.listen, ":7070") == 0);

  CHECK(parse(&c, empty_env, &msg,
              (const char *const[]){"--name", "alpha", "--workers=7", "--lr", "1e-3", "--verbose",
                                    "--buf-size=2M", "--listen", "h:1", NULL}) == CONFIG_OK);
  free(msg);
  CHECK(strcmp(c.name, "alpha") == 0);
  CHECK(c.workers == 7);
  CHECK(c.lr == 1e-3);
  CHECK(c.verbose == true);
  CHECK(c.buf == 2u << 20);
  CHECK(strcmp(c.listen, "h:1") == 0);

  /* The longest string that fits its field (15 chars + NUL) is accepted. */
  CHECK(parse(&c, empty_env, &msg, (const char *const[]){"--name", "0123456789abcde", NULL}) ==
        CONFIG_OK);
  free(msg);
  CHECK(strcmp(c.name, "0123456789abcde") == 0);

  /* A bool takes the next word only when it is a boolean. */
  CHECK(parse(&c, empty_env, &msg, (const char *const[]){"--verbose", "--workers", "3", NULL}) ==
        CONFIG_OK);
  free(msg);
  CHECK(c.verbose == true && c.workers == 3);
  CHECK(parse(&c, empty_env, &msg, (const char *const[]){"--verbose", "off", NULL}) == CONFIG_OK);
  free(msg);
  CHECK(c.verbose == false);
  CHECK(parse(&c, empty_env, &msg, (const char *const[]){"--verbose=YES", NULL}) == CONFIG_OK);
  free(msg);
  CHECK(c.verbose == true);
  /* Last flag wins; negative ints are values, not options. */
  CHECK(parse(&c, empty_env, &msg, (const char *const[]){"--workers", "2", "--workers=5", NULL}) ==
        CONFIG_OK);
  free(msg);
  CHECK(c.workers == 5);
}

static void test_precedence(void) {
  char *path = write_file(
      "# sample file\n"
      "\n"
      "  workers = 10   # trailing comment\n"
      "lr=0.5\n"
      "name = \"from #file\"  # quotes keep the '#'\n"
      "buf-size = 1MiB\n"
      "verbose = on\n");
  char env_workers[] = "PS_WORKERS=20", env_lr[] = "PS_LR=0.25", env_other[] = "PS_UNRELATED=x";
  char *envp[] = {env_other, env_workers, env_lr, NULL};
  struct tcfg c;
  char *msg;

  CHECK(parse(&c, envp, &msg, (const char *const[]){"--config", path, "--workers", "30", NULL}) ==
        CONFIG_OK);
  CHECK(strcmp(msg, "") == 0);
  free(msg);
  CHECK(c.workers == 30);                   /* flag */
  CHECK(c.lr == 0.25);                      /* env over file */
  CHECK(strcmp(c.name, "from #file") == 0); /* file over default */
  CHECK(c.buf == 1u << 20);                 /* file */
  CHECK(c.verbose == true);                 /* file */
  CHECK(strcmp(c.listen, ":7070") == 0);    /* default */

  /* Without the flag the env wins; the file can also come from PS_CONFIG. */
  char env_config[4200];
  snprintf(env_config, sizeof(env_config), "PS_CONFIG=%s", path);
  char *envp2[] = {env_workers, env_config, NULL};
  CHECK(parse(&c, envp2, &msg, NULL) == CONFIG_OK);
  free(msg);
  CHECK(c.workers == 20);
  CHECK(c.lr == 0.5);
  CHECK(strcmp(c.name, "from #file") == 0);

  unlink(path);
  free(path);
}

static void test_errors(void) {
  char bad_env[] = "PS_WORKERS=abc", bad_size_env[] = "PS_BUF_SIZE=12x";
  char *envp_bad[] = {bad_env, NULL};
  char *envp_bad_size[] = {bad_size_env, NULL};

  EXPECT_ERROR(empty_env, "option --workers: \"abc\" is not an integer (flag)", NULL, "--workers",
               "abc");
  EXPECT_ERROR(empty_env, "--workers", "(flag)", "--workers=12x");
  EXPECT_ERROR(empty_env, "--workers", "out of range", "--workers", "100");
  EXPECT_ERROR(empty_env, "--workers", "out of range", "--workers", "0");
  EXPECT_ERROR(empty_env, "--workers", "out of range", "--workers", "99999999999999999999");
  EXPECT_ERROR(empty_env, "--workers", "missing value", "--workers");
  EXPECT_ERROR(empty_env, "--workers", "missing value", "--workers", "--verbose");
  EXPECT_ERROR(empty_env, "--workers", "integer", "--workers=");
  EXPECT_ERROR(empty_env, "--lr", "(flag)", "--lr", "0.1x");
  EXPECT_ERROR(empty_env, "--lr", "out of range", "--lr", "11");
  EXPECT_ERROR(empty_env, "--lr", "(flag)", "--lr", "nan");
  /* Issue 30: every numeric option refuses a leading space, a sign, trailing
   * garbage, other notations and overflow, from every source. */
  EXPECT_ERROR(empty_env, "--workers", "not an integer", "--workers", " 5");
  EXPECT_ERROR(empty_env, "--workers", "not an integer", "--workers", "+5");
  EXPECT_ERROR(empty_env, "--workers", "not an integer", "--workers", "5 ");
  EXPECT_ERROR(empty_env, "--workers", "not an integer", "--workers", "0x5");
  EXPECT_ERROR(empty_env, "--workers", "not an integer", "--workers", "-");
  EXPECT_ERROR(empty_env, "--lr", "not a number", "--lr", " 0.5");
  EXPECT_ERROR(empty_env, "--lr", "not a number", "--lr", "+0.5");
  EXPECT_ERROR(empty_env, "--lr", "not a", "--lr", "0.5 ");
  EXPECT_ERROR(empty_env, "--lr", "not a number", "--lr", "0x1p1");
  EXPECT_ERROR(empty_env, "--lr", "not a number", "--lr", "infinity");
  EXPECT_ERROR(empty_env, "--lr", "(flag)", "--lr", "1e999");
  EXPECT_ERROR(empty_env, "--buf-size", "not a size", "--buf-size", " 4k");
  EXPECT_ERROR(empty_env, "--buf-size", "not a size", "--buf-size", "+4k");
  EXPECT_ERROR(empty_env, "--verbose", "maybe", "--verbose=maybe");
  EXPECT_ERROR(empty_env, "--buf-size", "negative", "--buf-size", "-1");
  EXPECT_ERROR(empty_env, "--buf-size", "12x", "--buf-size", "12x");
  EXPECT_ERROR(empty_env, "--buf-size", "out of range", "--buf-size", "512");
  EXPECT_ERROR(empty_env, "--name", "too long", "--name", "this-name-is-far-too-long");
  EXPECT_ERROR(empty_env, "--name", "16 bytes, at most 15", "--name", "0123456789abcdef");
  EXPECT_ERROR(empty_env, "--listen", "expected host:port", "--listen", "nocolon");
  EXPECT_ERROR(empty_env, "--bogus", "(flag)", "--bogus", "1");
  EXPECT_ERROR(empty_env, "--bogus", "(flag)", "--bogus=1");
  EXPECT_ERROR(empty_env, "-x", "unknown option", "-x");
  EXPECT_ERROR(empty_env, "extra", "unexpected argument", "extra");
  EXPECT_ERROR(empty_env, "extra", "unexpected argument", "--workers", "3", "extra");
  EXPECT_ERROR(empty_env, "extra", "unexpected argument", "--", "extra");
  /* A bad value is refused even when a flag would override it. */
  EXPECT_ERROR(envp_bad, "option --workers: \"abc\" is not an integer (env PS_WORKERS)", NULL,
               "--workers", "3");
  EXPECT_ERROR(envp_bad_size, "--buf-size", "(env PS_BUF_SIZE)", "--verbose");

  char *f_bad = write_file("name = x\n# comment\nworkers = abc\n");
  char *f_unknown = write_file("name = x\nbogus = 1\n");
  char *f_noeq = write_file("\n\n\n\njustakey\n");
  char where[4200];
  char *f_long = write_file("name = abcdefghijklmnopqrstuvwxyz\n");
  /* A NUL byte inside a line would end it silently: "workers = 1\0 0". */
  char *f_nul = write_file("name = x\n");
  FILE *fn = fopen(f_nul, "a");
  fwrite("workers = 1\0 0\n", 1, 16, fn);
  fclose(fn);
  snprintf(where, sizeof(where), "(file %s:2)", f_nul);
  EXPECT_ERROR(empty_env, "NUL byte", where, "--config", f_nul);
  unlink(f_nul);
  free(f_nul);
  snprintf(where, sizeof(where), "(file %s:3)", f_bad);
  EXPECT_ERROR(empty_env, "option --workers: \"abc\" is not an integer", where, "--config", f_bad);
  snprintf(where, sizeof(where), "(file %s:2)", f_unknown);
  EXPECT_ERROR(empty_env, "\"bogus\"", where, "--config", f_unknown);
  snprintf(where, sizeof(where), "(file %s:5)", f_noeq);
  EXPECT_ERROR(empty_env, "justakey", where,
               "--config="
               "/dev/null",
               "--config", f_noeq);
  snprintf(where, sizeof(where), "(file %s:1)", f_long);
  EXPECT_ERROR(empty_env, "--name", where, "--config", f_long);
  EXPECT_ERROR(empty_env, "/nonexistent/dir/x.conf", "--config", "--config",
               "/nonexistent/dir/x.conf");
  EXPECT_ERROR(empty_env, "--config", "missing value", "--config");
  char env_cfg[] = "PS_CONFIG=/nonexistent/y.conf";
  char *envp_cfg[] = {env_cfg, NULL};
  EXPECT_ERROR(envp_cfg, "/nonexistent/y.conf", "PS_CONFIG", "--verbose");
  char *files[] = {f_bad, f_unknown, f_noeq, f_long};
  for (int i = 0; i < 4; i++) {
    unlink(files[i]);
    free(files[i]);
  }

  /* A bad default is reported too, naming the option. */
  static const struct config_option bad_def[] = {
      {"rate", CONFIG_DOUBLE, 0, 0, "fast", 0, 0, NULL, "x"}};
  struct config_spec s2 = {"ps-test", "x", bad_def, 1, NULL};
  double d;
  char *msg = NULL;
  size_t len = 0;
  FILE *err = open_memstream(&msg, &len);
  char *argv[] = {"ps-test", NULL};
  CHECK(config_parse(&s2, &d, 1, argv, empty_env, err) == -EINVAL);
  fclose(err);
  CHECK(strstr(msg, "--rate") && strstr(msg, "(default)"));
  free(msg);
}

/* Runs config_parse with stdout redirected to a temp file; returns the text. */
static char *capture_stdout(const char *arg, int *rc) {
  struct tcfg c;
  char *argv[] = {"ps-test", (char *)arg, NULL};
  char *out = calloc(1, 65536);
  FILE *tmp = tmpfile();
  fflush(stdout);
  int saved = dup(1);
  dup2(fileno(tmp), 1);
  *rc = config_parse(&spec, &c, 2, argv, empty_env, stderr);
  fflush(stdout);
  dup2(saved, 1);
  close(saved);
  rewind(tmp);
  size_t n = fread(out, 1, 65535, tmp);
  out[n] = '\0';
  fclose(tmp);
  return out;
}

static int check_color(const char *v, char *err, size_t errlen) {
  static const char *const names[] = {"red", "green", "blue"};
  return config_choice(v, names, 3, err, errlen) < 0 ? -EINVAL : 0;
}

/* --help=json: typed defaults, bounds, choices read from the check's own
 * refusal (none for a format such as host:port), the env knobs. */
static void test_help_json(void) {
  static const struct config_option more[] = {
      {"color", CONFIG_STRING, offsetof(struct tcfg, listen), sizeof(((struct tcfg *)0)->listen),
       "red", 0, 0, check_color, "a \"color\""},
  };
  const struct config_spec both[] = {spec, {"ps-test", NULL, more, 1, NULL}};
  for (int k = 0; k < 2; k++) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    config_print_json(&both[k], f);
    fclose(f);
    if (k == 0) {
      CHECK(strstr(buf,
                   "{\"name\": \"workers\", \"type\": \"int\", \"default\": 4, \"min\": 1, "
                   "\"max\": 64,") != NULL);
      CHECK(strstr(buf, "\"name\": \"buf-size\", \"type\": \"size\", \"default\": 65536,") != NULL);
      CHECK(strstr(buf,
                   "\"name\": \"verbose\", \"type\": \"bool\", \"default\": false, "
                   "\"min\": null, \"max\": null,") != NULL);
      CHECK(
          strstr(buf, "\"name\": \"lr\", \"type\": \"float\", \"default\": 0.10000000000000001,") !=
          NULL);
      CHECK(strstr(buf, "\"env\": \"PS_BUF_SIZE\"") != NULL);
      const char *env = strstr(buf, "\"env\": [");
      const char *choices = strstr(buf, "\"choices\"");
      CHECK(env && (!choices || choices > env)); /* host:port is not a fixed set */
    } else {
      CHECK(strstr(buf, "\"choices\": [\"red\", \"green\", \"blue\"]") != NULL);
      CHECK(strstr(buf, "\"help\": \"a \\\"color\\\"\"") != NULL);
    }
    CHECK(strstr(buf,
                 "\"name\": \"PS_HEARTBEAT_MS\", \"type\": \"int\", \"default\": 500, "
                 "\"min\": 0, \"max\": 60000") != NULL);
    free(buf);
  }
}

/* config_forward: the program's entry into another struct, overridden only
 * where set says; a missing entry or a field of another type is refused. */
struct fcfg {
  int64_t n;
  char where[32];
  double rate;
};
#define CONFIG_STRUCT struct fcfg
static void test_forward(void) {
  const struct config_forward fwd[] = {
      CONFIG_FWD_SET(&spec, "workers", n, CONFIG_SET_DEF | CONFIG_SET_RANGE, .def = "8", .min = 2,
                     .max = 9),
      CONFIG_FWD(&spec, "listen", where),
      CONFIG_OWN(CONFIG_OPT("rate", CONFIG_DOUBLE, rate, "2.5", 0, 5, "own")),
  };
  struct config_option out[3];
  CHECK(config_forward(fwd, 3, out, stderr) == 0);
  CHECK(strcmp(out[0].name, "workers") == 0 && strcmp(out[0].def, "8") == 0);
  CHECK(out[0].min == 2 && out[0].max == 9 && strcmp(out[0].help, "number of workers") == 0);
  CHECK(out[0].offset == offsetof(struct fcfg, n) && out[0].type == CONFIG_INT);
  CHECK(out[1].check == check_listen && strcmp(out[1].def, ":7070") == 0);
  CHECK(out[1].size == sizeof(((struct fcfg *)0)->where));
  CHECK(strcmp(out[2].name, "rate") == 0 && out[2].max == 5);
  const struct config_spec fs = {"ps-fwd", NULL, out, 3, NULL};
  struct fcfg c;
  char *argv[] = {"ps-fwd", "--listen", "h:2", NULL};
  CHECK(config_parse(&fs, &c, 3, argv, empty_env, stderr) == CONFIG_OK);
  CHECK(c.n == 8 && strcmp(c.where, "h:2") == 0 && c.rate == 2.5);

  char *msg = NULL;
  size_t len = 0;
  FILE *err = open_memstream(&msg, &len);
  const struct config_forward missing[] = {CONFIG_FWD(&spec, "nope", n)};
  const struct config_forward wrong[] = {CONFIG_FWD(&spec, "verbose", n)}; /* bool into int64 */
  CHECK(config_forward(missing, 1, out, err) == -ENOENT);
  CHECK(config_forward(wrong, 1, out, err) == -ENOENT);
  fclose(err);
  CHECK(strstr(msg, "ps-test: option --nope: no such option to forward (table)") != NULL);
  CHECK(strstr(msg, "ps-test: option --verbose: forwarded into a field of another type") != NULL);
  free(msg);
}
#undef CONFIG_STRUCT

static void test_help_version(void) {
  int rc;
  for (int i = 0; i < 2; i++) {
    char *out = capture_stdout(i ? "-h" : "--help", &rc);
    CHECK(rc == CONFIG_HELP);
    CHECK(strstr(out, "Usage: ps-test") != NULL);
    CHECK(strstr(out, "A test program.") != NULL);
    for (size_t k = 0; k < spec.num_options; k++) {
      char flag[64];
      snprintf(flag, sizeof(flag), "--%s <", options[k].name);
      CHECK(strstr(out, flag) != NULL);
      CHECK(strstr(out, options[k].help) != NULL);
    }
    CHECK(strstr(out, "env PS_BUF_SIZE, default 64k") != NULL);
    CHECK(strstr(out, "--config <path>") != NULL);
    free(out);
  }
  char *out = capture_stdout("--version", &rc);
  CHECK(rc == CONFIG_VERSION);
  CHECK(strcmp(out, "ps-test 0.1.0\n") == 0);
  free(out);

  /* config_print_help to any stream gives the same text. */
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  config_print_help(&spec, f);
  fclose(f);
  CHECK(strstr(buf, "--workers <int>") && strstr(buf, "range 1..64"));
  free(buf);
}

static void test_sizes(void) {
  static const struct {
    const char *s;
    uint64_t v;
  } good[] = {
      {"0", 0},
      {"12", 12},
      {"4k", 4096},
      {"4K", 4096},
      {"4KiB", 4096},
      {"4KB", 4096},
      {"1MiB", 1u << 20},
      {"3m", 3u << 20},
      {"2G", 2ull << 30},
      {"2GiB", 2ull << 30},
      {"18446744073709551615", UINT64_MAX},
  };
  static const char *const bad[] = {
      "",
      "-1",
      "12x",
      "99999999999999999999G",
      "18446744073709551616",
      "k",
      " 1",
      "1 k",
      "1.5G",
      "+1",
      "17179869184G",
      "4KiBx",
  };
  for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
    uint64_t v = 7;
    int rc = config_parse_size(good[i].s, &v);
    if (rc != 0 || v != good[i].v) {
      fprintf(stderr, "size \"%s\": rc=%d v=%llu\n", good[i].s, rc, (unsigned long long)v);
      failures++;
    }
  }
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    uint64_t v = 7;
    if (config_parse_size(bad[i], &v) != -EINVAL || v != 7) {
      fprintf(stderr, "size \"%s\" was accepted\n", bad[i]);
      failures++;
    }
  }
}

/* --shard/--rank auto: PS_POD_INDEX first, then the hostname's -N suffix. */
static void test_pod_index(void) {
  int64_t v = -1;
  char *buf = NULL;
  size_t len = 0;
  FILE *err = open_memstream(&buf, &len);
  CHECK(config_pod_index("3", "p", "rank", 4, "--world-size", err, &v) == 0 && v == 3);
  CHECK(config_pod_index("4", "p", "rank", 4, "--world-size", err, &v) < 0);
  CHECK(config_pod_index("-1", "p", "rank", 4, "--world-size", err, &v) < 0);
  CHECK(config_pod_index("2x", "p", "rank", 4, "--world-size", err, &v) < 0);
  /* Issue 30: --shard ' 0' was taken as 0. */
  static const char *const bad[] = {" 0", "+0",  "0 ",  "-0",
                                    "",   "0x1", "1e0", "99999999999999999999"};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    v = -1;
    CHECK(config_pod_index(bad[i], "p", "shard", 4, "--num-shards", err, &v) < 0 && v == -1,
          "\"%s\" accepted as %lld", bad[i], (long long)v);
  }
  setenv("PS_POD_INDEX", " 1", 1);
  CHECK(config_pod_index("auto", "p", "rank", 4, "--world-size", err, &v) < 0);
  setenv("PS_POD_INDEX", "2", 1);
  CHECK(config_pod_index("auto", "p", "rank", 4, "--world-size", err, &v) == 0 && v == 2);
  setenv("PS_POD_INDEX", "9", 1);
  CHECK(config_pod_index("auto", "p", "shard", 4, "--num-shards", err, &v) < 0);
  unsetenv("PS_POD_INDEX");
  fclose(err);
  CHECK(buf && strstr(buf, "p: option --shard: \"9\" is not in [0, 4) (--num-shards)"));
  free(buf);
}

/* Knobs outside the tables: read with the tables' rules, named when bad. */
static void test_env_knobs(void) {
  char err[256] = "";
  bool b = true;
  int64_t v = 0;
  unsetenv("PS_TEST_KNOB");
  CHECK(config_env_bool("PS_TEST_KNOB", &b, err, sizeof(err)) == 0 && !b);
  CHECK(config_env_int("PS_TEST_KNOB", 500, 0, 60000, &v, err, sizeof(err)) == 0 && v == 500);
  setenv("PS_TEST_KNOB", "on", 1);
  CHECK(config_env_bool("PS_TEST_KNOB", &b, err, sizeof(err)) == 0 && b);
  setenv("PS_TEST_KNOB", "0", 1);
  CHECK(config_env_bool("PS_TEST_KNOB", &b, err, sizeof(err)) == 0 && !b);
  CHECK(config_env_int("PS_TEST_KNOB", 500, 0, 60000, &v, err, sizeof(err)) == 0 && v == 0);
  setenv("PS_TEST_KNOB", "-1", 1);
  CHECK(config_env_int("PS_TEST_KNOB", 500, -1, 60000, &v, err, sizeof(err)) == 0 && v == -1);
  static const char *const bad_int[] = {" 5", "+5", "5ms", "60001", "-1", "99999999999999999999"};
  for (size_t i = 0; i < sizeof(bad_int) / sizeof(bad_int[0]); i++) {
    setenv("PS_TEST_KNOB", bad_int[i], 1);
    err[0] = 0;
    CHECK(config_env_int("PS_TEST_KNOB", 500, 0, 60000, &v, err, sizeof(err)) == -EINVAL,
          "\"%s\" accepted", bad_int[i]);
    CHECK(strstr(err, "PS_TEST_KNOB=") && strstr(err, "from 0 to 60000"), "%s", err);
  }
  setenv("PS_TEST_KNOB", "maybe", 1);
  CHECK(config_env_bool("PS_TEST_KNOB", &b, err, sizeof(err)) == -EINVAL);
  CHECK(strstr(err, "PS_TEST_KNOB=\"maybe\"") && strstr(err, "yes/no"), "%s", err);
  unsetenv("PS_TEST_KNOB");
}

/* envknob: each knob read with its table entry's default and bounds. */
static void test_envknob_table(void) {
  char err[256] = "";
  int64_t v = 0;
  uint64_t u = 0;
  bool b = true;
  const char *s = NULL;
  unsetenv("PS_HEARTBEAT_MS");
  CHECK(envknob_int("PS_HEARTBEAT_MS", &v, err, sizeof(err)) == 0 && v == 500);
  setenv("PS_HEARTBEAT_MS", "60001", 1);
  CHECK(envknob_int("PS_HEARTBEAT_MS", &v, err, sizeof(err)) == -EINVAL);
  CHECK(strstr(err, "PS_HEARTBEAT_MS=\"60001\": expected a whole number from 0 to 60000"), "%s",
        err);
  unsetenv("PS_HEARTBEAT_MS");
  unsetenv("PS_TRANSPORT");
  CHECK(envknob_str("PS_TRANSPORT", &s, err, sizeof(err)) == 0 && strcmp(s, "tcp") == 0);
  setenv("PS_TRANSPORT", "rdma", 1);
  CHECK(envknob_str("PS_TRANSPORT", &s, err, sizeof(err)) == -EINVAL);
  CHECK(strcmp(err, "PS_TRANSPORT=\"rdma\": expected tcp or ucx") == 0, "%s", err);
  unsetenv("PS_TRANSPORT");
  unsetenv("PS_UCX_RNDV_BYTES");
  CHECK(envknob_u64("PS_UCX_RNDV_BYTES", &u, err, sizeof(err)) == 0 && u == 65536);
  setenv("PS_UCX_RNDV_BYTES", "18446744073709551615", 1);
  CHECK(envknob_u64("PS_UCX_RNDV_BYTES", &u, err, sizeof(err)) == 0 && u == UINT64_MAX);
  setenv("PS_UCX_POLL_US", "1000001", 1);
  CHECK(envknob_u64("PS_UCX_POLL_US", &u, err, sizeof(err)) == -EINVAL);
  CHECK(strstr(err, "from 0 to 1000000 (digits only)"), "%s", err);
  unsetenv("PS_UCX_RNDV_BYTES");
  unsetenv("PS_UCX_POLL_US");
  setenv("PS_DISABLE_IO_URING", "yes", 1);
  CHECK(envknob_bool("PS_DISABLE_IO_URING", &b, err, sizeof(err)) == 0 && b);
  unsetenv("PS_DISABLE_IO_URING");
  /* A name missing from the table, or read as another type, is refused. */
  CHECK(envknob_int("PS_NO_SUCH_KNOB", &v, err, sizeof(err)) == -EINVAL);
  CHECK(envknob_bool("PS_HEARTBEAT_MS", &b, err, sizeof(err)) == -EINVAL);
}

int main(void) {
  test_envknob_table();
  test_env_knobs();
  test_pod_index();
  test_defaults_and_forms();
  test_precedence();
  test_errors();
  test_help_version();
  test_help_json();
  test_forward();
  test_sizes();
  if (failures) {
    fprintf(stderr, "test_config: %d failure(s)\n", failures);
    return 1;
  }
  printf("test_config: ok\n");
  return 0;
}
