/* test_grid: the pure functions of grid.h. Megatron-LM's 16-rank vector
 * (parallel_state.initialize_model_parallel's docstring: t = 2, p = 4,
 * d = 2), the 32-rank example (t = 4, p = 4, d = 2) with nodes of 4 ranks
 * (no tensor-parallel group spans nodes) and of 2 (every one does), and the
 * refusals. */
#include <stdio.h>
#include <string.h>

#include "grid.h"

#include "check.h"

static int same(const int *a, const int *b, int n) {
  return memcmp(a, b, (size_t)n * sizeof(*a)) == 0;
}

/* Every group of axis, as Megatron lists them: group g holds want[g][..]. */
static void check_groups(int world, int t, int p, char axis, int ngroups, int len,
                         const int want[][4]) {
  for (int g = 0; g < ngroups; g++) {
    for (int i = 0; i < len; i++) {
      int got[64] = {0};
      int rank = want[g][i];
      int n = ps_grid_group_ranks(world, t, p, rank, axis, got);
      CHECK(n == len && same(got, want[g], len), "axis %c rank %d: group %d of %d", axis, rank, g,
            n);
      struct ps_grid_coords c;
      CHECK(ps_grid_coords_of(world, t, p, rank, &c) == PS_OK);
      int place = axis == 't' ? c.tp : axis == 'd' ? c.dp : c.pp;
      CHECK(place == i, "rank %d is %d in its %c group, want %d", rank, place, axis, i);
      CHECK(ps_grid_rank_of(world, t, p, c) == rank);
    }
  }
}

static void test_megatron_16(void) {
  static const int tp[8][4] = {{0, 1}, {2, 3},   {4, 5},   {6, 7},
                               {8, 9}, {10, 11}, {12, 13}, {14, 15}};
  static const int pp[4][4] = {{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}};
  static const int dp[8][4] = {{0, 2},  {1, 3},  {4, 6},   {5, 7},
                               {8, 10}, {9, 11}, {12, 14}, {13, 15}};
  int d = 0;
  CHECK(ps_grid_dims(16, 2, 4, &d, NULL, 0) == PS_OK && d == 2);
  check_groups(16, 2, 4, 't', 8, 2, tp);
  check_groups(16, 2, 4, 'p', 4, 4, pp);
  check_groups(16, 2, 4, 'd', 8, 2, dp);
  int r[4];
  CHECK(ps_grid_group_ranks(16, 2, 4, 0, 'x', r) == -1);
  CHECK(ps_grid_group_ranks(16, 2, 4, 16, 't', r) == -1);
}

static void test_32(void) {
  /* t = 4, p = 4, d = 2 on 8 nodes of 4: TP {0-3}, DP {0,4}, PP {0,8,16,24} */
  int r[4], d = 0;
  CHECK(ps_grid_dims(32, 4, 4, &d, NULL, 0) == PS_OK && d == 2);
  CHECK(ps_grid_group_ranks(32, 4, 4, 0, 't', r) == 4 && same(r, (int[]){0, 1, 2, 3}, 4));
  CHECK(ps_grid_group_ranks(32, 4, 4, 0, 'd', r) == 2 && same(r, (int[]){0, 4}, 2));
  CHECK(ps_grid_group_ranks(32, 4, 4, 0, 'p', r) == 4 && same(r, (int[]){0, 8, 16, 24}, 4));
  CHECK(ps_grid_group_ranks(32, 4, 4, 13, 'p', r) == 4 && same(r, (int[]){5, 13, 21, 29}, 4));
  char names4[32][16], names2[32][16], msg[256];
  const char *by4[32], *by2[32];
  for (int i = 0; i < 32; i++) {
    snprintf(names4[i], sizeof(names4[i]), "node%d", i / 4);
    snprintf(names2[i], sizeof(names2[i]), "node%d", i / 2);
    by4[i] = names4[i];
    by2[i] = names2[i];
  }
  CHECK(ps_grid_tp_spanning(32, 4, 4, by4, msg, sizeof(msg)) == 0 && msg[0] == 0, "%s", msg);
  CHECK(ps_grid_tp_spanning(32, 4, 4, by2, msg, sizeof(msg)) == 8);
  CHECK(strcmp(msg, "tensor-parallel group 0 (ranks 0-3) spans nodes node0, node1") == 0, "%s",
        msg);
  /* one unknown name: nothing can be said */
  by2[7] = "";
  CHECK(ps_grid_tp_spanning(32, 4, 4, by2, msg, sizeof(msg)) == 0);
  by2[7] = NULL;
  CHECK(ps_grid_tp_spanning(32, 4, 4, by2, msg, sizeof(msg)) == 0);
  CHECK(ps_grid_tp_spanning(32, 4, 4, NULL, msg, sizeof(msg)) == 0);
}

static void test_refusals(void) {
  char err[256];
  int d = -1;
  CHECK(ps_grid_dims(12, 4, 2, &d, err, sizeof(err)) == PS_ERR_INVALID && d == -1);
  CHECK(strstr(err, "12") && strstr(err, "tensor-parallel 4") && strstr(err, "pipeline-parallel 2"),
        "%s", err);
  CHECK(ps_grid_dims(16, 3, 1, &d, err, sizeof(err)) == PS_ERR_INVALID);
  CHECK(ps_grid_dims(16, 0, 1, &d, err, sizeof(err)) == PS_ERR_INVALID);
  CHECK(ps_grid_dims(16, 2, -1, &d, err, sizeof(err)) == PS_ERR_INVALID);
  struct ps_grid_coords c;
  CHECK(ps_grid_coords_of(12, 4, 2, 0, &c) == PS_ERR_INVALID);
  CHECK(ps_grid_coords_of(16, 2, 4, -1, &c) == PS_ERR_INVALID);
  CHECK(ps_grid_rank_of(16, 2, 4, (struct ps_grid_coords){2, 0, 0}) == -1);
  CHECK(ps_grid_rank_of(16, 2, 4, (struct ps_grid_coords){1, 1, 3}) == 15);
  CHECK(ps_grid_new(NULL, 2, 4, NULL, err, sizeof(err)) == PS_ERR_INVALID);
  /* 1 x 1 x W: every rank its own tensor and pipeline group */
  CHECK(ps_grid_dims(5, 1, 1, &d, NULL, 0) == PS_OK && d == 5);
}

int main(void) {
  test_megatron_16();
  test_32();
  test_refusals();
  if (failures) fprintf(stderr, "%d checks failed\n", failures);
  return failures ? 1 : 0;
}
