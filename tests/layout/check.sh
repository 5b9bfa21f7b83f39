#!/usr/bin/env bash
# layout: the rules of docs/ARCHITECTURE.md ("The tree, and who may include
# what") checked on the sources, so a change that breaks them fails here:
#  - dependencies point one way: common <- proto <- ps-server, libps <- train
#    <- ps-worker; no folder includes a header of a folder above it;
#  - libps's include/ holds its public headers, which include no internal
#    header; libps's internal headers are included only inside libps;
#  - libps's two rooms stay apart: no file of client/ includes a header of
#    coll/ and none of coll/ one of client/; both may include base/'s;
#  - ps-worker/blas (psblas, the BLAS kernel choice) is not libps: its
#    include/ is public to ps-worker and the tools, its internal header is
#    included only inside it (and blas_kernel_impl.h, the pure kernel
#    decision, by its unit test);
#  - examples/ includes libps's public headers (<ps.h>) and system headers
#    only, as a program built against the installed library;
#  - device_impl.h only by the device files, kernels.h only by the CUDA ones;
#  - no source file of common/, proto/, ps-server/, ps-worker/ over 900 lines,
#    no tool over 1,000;
#  - docs/ARCHITECTURE.md names every source file (the last block).
#   check.sh SOURCE_ROOT
set -euo pipefail
root="$1"
cd "$root"
fails=0
bad() { echo "layout: $*" >&2; fails=$((fails + 1)); }

# The folder each project header lives in (header names are unique).
declare -A home
while IFS= read -r h; do
  name="${h##*/}"
  [ -z "${home[$name]:-}" ] || bad "two headers named $name: ${home[$name]} and $h"
  home[$name]="${h%/*}"
done < <(find common proto ps-server ps-worker -name '*.h' | sort)

# What each folder may include (besides itself and system headers).
declare -A may=(
  [common]=""
  [proto]="common"
  [ps-server]="common proto"
  [ps-worker/libps/include]=""
  [ps-worker/libps/base]="common ps-worker/libps/include"
  [ps-worker/libps/client]="common proto ps-worker/libps/include ps-worker/libps/base"
  [ps-worker/libps/coll]="common proto ps-worker/libps/include ps-worker/libps/base"
  [ps-worker/blas/include]="ps-worker/libps/include"
  [ps-worker/blas]="common ps-worker/libps/include ps-worker/blas/include"
  [ps-worker/train]="common ps-worker/libps/include"
  [ps-worker]="common ps-worker/libps/include ps-worker/train ps-worker/blas/include"
)
# libps's rooms, each against the other (the table above says it too; this
# says it by name).
declare -A other_room=([ps-worker/libps/client]=ps-worker/libps/coll
  [ps-worker/libps/coll]=ps-worker/libps/client)
checked=0
while IFS= read -r f; do
  dir="${f%/*}"
  allowed=" $dir ${may[$dir]} "
  while IFS= read -r inc; do
    [ -n "$inc" ] || continue
    where="${home[$inc]:-}"
    [ -n "$where" ] || continue # generated (ps.pb-c.h) or a header of another project
    [ "$where" = "${other_room[$dir]:-}" ] && bad "$f includes $inc of libps's other room $where"
    case "$allowed" in *" $where "*) ;; *) bad "$f includes $inc of $where" ;; esac
    case "$inc" in
      device_impl.h) case "${f##*/}" in device*.c|device_impl.h) ;; *) bad "$f includes device_impl.h" ;; esac ;;
      kernels.h) case "${f##*/}" in device_cuda.c|kernels.cu|kernels.h) ;; *) bad "$f includes kernels.h" ;; esac ;;
    esac
    checked=$((checked + 1))
  done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f")
done < <(find common proto ps-server ps-worker \( -name '*.c' -o -name '*.h' -o -name '*.cu' \) | sort)

# Everyone else (tests, tools) may include libps's and psblas's public
# headers only; tests/unit/test_blas_kernel.c feeds fake CPUs to
# blas_kernel_impl.h, tests/unit/test_pipeline.c schedules broken on purpose
# to pipeline_impl.h's validator, tests/integration/nccl_plugin_stub.c is a
# plugin of the wrong ABI version (nccl_plugin.h's entry table).
while IFS= read -r f; do
  for inc in $(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f"); do
    [ "$f:$inc" = tests/unit/test_blas_kernel.c:blas_kernel_impl.h ] && continue
    [ "$f:$inc" = tests/unit/test_pipeline.c:pipeline_impl.h ] && continue
    [ "$f:$inc" = tests/integration/nccl_plugin_stub.c:nccl_plugin.h ] && continue
    case "${home[$inc]:-}" in
      ps-worker/libps/include | ps-worker/blas/include) ;;
      ps-worker/libps/* | ps-worker/blas) bad "$f includes the internal $inc of ${home[$inc]}" ;;
    esac
  done
done < <(find tests tools \( -name '*.c' -o -name '*.h' -o -name '*.cc' \) -not -path '*/corpus/*' | sort)

# The examples build against the installed libps: its public headers, as
# <ps.h> etc., and system headers; nothing of the tree.
public=" $(cd ps-worker/libps/include && echo *.h) "
while IFS= read -r f; do
  while IFS= read -r inc; do
    [ -n "$inc" ] && bad "$f includes \"$inc\": an example includes only installed headers"
  done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f")
  while IFS= read -r inc; do
    if [ -n "${home[$inc]:-}" ]; then
      case "$public" in *" $inc "*) ;; *) bad "$f includes <$inc> of ${home[$inc]}" ;; esac
    fi
  done < <(sed -n 's/^#include <\([^>]*\)>.*/\1/p' "$f")
done < <(find examples \( -name '*.c' -o -name '*.h' \) 2>/dev/null | sort)

while read -r n f; do
  [ "$f" = total ] && continue
  case "$f" in
    tools/*) [ "$n" -le 1000 ] || bad "$f has $n lines (tools: at most 1,000)" ;;
    *) [ "$n" -le 900 ] || bad "$f has $n lines (at most ~900: split it)" ;;
  esac
done < <(find common proto ps-server ps-worker tools \( -name '*.c' -o -name '*.cu' \) -print0 |
  xargs -0 wc -l)

# Transports by name only (issue 31): outside the transport files, no
# source file of ps-server/ or ps-worker/libps/ names a transport. The
# transport files are the shard's conn_tcp.c, conn_ucx.c and their registry
# conn_transports.c, and libps's client/shard_tcp.c, shard_ucx.c and their
# registry shard_transports.c; everything else holds the name the user gave
# and asks its registry. Counted: code, #include lines and string literals
# without a space (a name: "ucx"). Not counted: comments and string literals
# with a space (prose: option and metric help, messages), which may explain
# a transport. Names: `ucx` anywhere in a word (conn_ucx_ops, ucx_env.h),
# ulink_ (common/ucx_link.h), ucp_ (UCX itself) and uv_tcp (libuv's TCP
# handles), case-insensitive; plain "tcp" is not a name here (the ring and
# the socket options are TCP whatever the push/pull transport).
tp_files=" ps-server/conn_tcp.c ps-server/conn_ucx.c ps-server/conn_transports.c
  ps-worker/libps/client/shard_tcp.c ps-worker/libps/client/shard_ucx.c
  ps-worker/libps/client/shard_transports.c "
while IFS= read -r f; do
  case "$tp_files" in *[[:space:]]"$f"[[:space:]]*) continue ;; esac
  while IFS= read -r hit; do
    bad "$f:$hit: names a transport outside the transport files (ask the registry)"
  done < <(perl -0777 -ne '
    s{(/\*.*?\*/)|(//[^\n]*)|("(?:[^"\\\n]|\\.)*")|('"'"'(?:[^'"'"'\\\n]|\\.)*'"'"')}{
      defined $1 ? "\n" x ($1 =~ tr/\n//) : defined $2 ? "" :
      defined $3 ? ($3 =~ / / ? q("") : $3) : $4 }gse;
    my $n = 0;
    for (split /\n/) { $n++; print "$n: $_\n" if /ucx|ulink_|ucp_|uv_tcp/i }' "$f")
done < <(find ps-server ps-worker/libps \( -name '*.c' -o -name '*.h' \) | sort)

[ "$fails" = 0 ] || { echo "layout: $fails rule(s) broken" >&2; exit 1; }
echo "layout: $checked includes of project headers follow the rules; file sizes within bounds"

# docs/ARCHITECTURE.md names every source file of the tree, so the map stays
# true as files come and go. Source files: under common/, proto/, ps-server/,
# ps-worker/, python/ps/ and tools/ (sub-folders included), every *.c, *.h,
# *.cc, *.cu, *.py, *.py.in and *.proto, and every executable file under
# tools/ (the scripts); not meson.build, libps.map or data. A file is named
# when ARCHITECTURE.md contains its basename as a word (so its path too; le.h
# is not named by handle.h), for C the basename of its pair (foo.h for foo.c
# and back: one module, one pair) or its stem as a whole code span (`clock`
# names clock.c and clock.h), or a code span ending in * that its basename
# starts with (`bench-*`).
doc=docs/ARCHITECTURE.md
declare -A span=()
spans=()
while IFS= read -r s; do
  [ -n "$s" ] || continue
  span[$s]=1
  case "$s" in *\*) spans+=("${s%\*}") ;; esac
done < <(grep -o '`[^`]*`' "$doc" | tr -d '`' | sort -u)
unnamed=0
while IFS= read -r f; do
  b="${f##*/}"
  stem="${b%%.*}"
  grep -qwF -- "$b" "$doc" && continue
  case "$b" in
    *.c) grep -qwF -- "$stem.h" "$doc" && continue ;;
    *.h) grep -qwF -- "$stem.c" "$doc" && continue ;;
  esac
  case "$b" in *.c | *.h) [ -n "${span[$stem]:-}" ] && continue ;; esac
  named=
  for p in "${spans[@]}"; do case "$b" in "$p"*) named=1 ;; esac; done
  [ -n "$named" ] && continue
  echo "layout: $f is not named in $doc (add one line on what it owns)" >&2
  unnamed=$((unnamed + 1))
done < <({
  find common proto ps-server ps-worker python/ps tools -type f \( -name '*.c' -o -name '*.h' \
    -o -name '*.cc' -o -name '*.cu' -o -name '*.py' -o -name '*.py.in' -o -name '*.proto' \) \
    -not -path '*/__pycache__/*'
  find tools -type f -perm -u+x
} | sort -u)
[ "$unnamed" = 0 ] || { echo "layout: $unnamed source file(s) missing from $doc" >&2; exit 1; }
echo "layout: $doc names every source file"
