#!/usr/bin/env bash
# containerfile: deploy/Containerfile cannot be built here (no registry), so
# its structure is checked against what the manifests and the binaries need:
#  - two stages, both Debian 12: a build stage that runs meson setup, ninja,
#    the unit tests and meson install, and a runtime stage that copies only
#    the installed binaries from it;
#  - the binaries land where the manifests' `command` points;
#  - it runs as the non-root uid the manifests' runAsUser names;
#  - every shared library the built ps-server and ps-worker load comes from a
#    Debian package the runtime stage installs (or that debian:12-slim has).
#   containerfile.sh BUILD_DIR
set -euo pipefail
build="$1"
root="$(cd "$(dirname "$0")/../.." && pwd)"
cf="$root/deploy/Containerfile"
fails=0
bad() { echo "containerfile: $*" >&2; fails=$((fails + 1)); }

froms="$(grep -Ec '^FROM ' "$cf")"
[ "$froms" -ge 2 ] || bad "not multi-stage ($froms FROM lines)"
grep -Eq '^FROM debian:12[^ ]* AS build$' "$cf" || bad "the first stage is not 'FROM debian:12... AS build'"
[ "$(grep -E '^FROM ' "$cf" | tail -1 | grep -Ec '^FROM debian:12(-slim)?$')" = 1 ] ||
  bad "the runtime stage is not Debian 12"
build_stage="$(awk '/^FROM .* AS build$/{on=1;next} /^FROM /{on=0} on' "$cf")"
runtime_stage="$(awk '/^FROM /{n++} n>=2' "$cf" | awk 'BEGIN{s=""} /^FROM /{s=""} {s=s $0 "\n"} END{printf "%s", s}')"
for step in "meson setup" "ninja -C" "meson test" "meson install"; do
  grep -q -- "$step" <<<"$build_stage" || bad "the build stage does not run '$step'"
done
grep -q -- "-Dwerror=true" <<<"$build_stage" || bad "the build stage does not treat warnings as errors"
grep -q -- "--prefix=/usr/local" <<<"$build_stage" || bad "the build stage does not install to /usr/local"
copy="$(grep -E '^COPY --from=build ' <<<"$runtime_stage" || true)"
[ -n "$copy" ] || bad "the runtime stage copies nothing from the build stage"
grep -qE '^COPY (\.|[^-])' <<<"$runtime_stage" && bad "the runtime stage copies from the context"
user="$(sed -n 's/^USER \([0-9]*\)\(:[0-9]*\)\{0,1\}$/\1/p' <<<"$runtime_stage" | tail -1)"
[ -n "$user" ] && [ "$user" != 0 ] || bad "the runtime stage does not run as a numeric non-root USER"

# against the manifests
if command -v kubectl >/dev/null; then
  rendered="$(kubectl kustomize "$root/deploy/k8s/overlays/ps")"
  for bin in ps-server ps-worker; do
    grep -q "\"/usr/local/bin/$bin\"\|- /usr/local/bin/$bin" <<<"$rendered" ||
      bad "the manifests do not run /usr/local/bin/$bin"
    grep -q "/install/usr/local/bin/$bin" <<<"$copy" || bad "$bin is not copied into the image"
  done
  grep -q "/usr/local/bin/$" <<<"$copy" || bad "binaries are not copied to /usr/local/bin/"
  for uid in $(sed -n 's/^ *runAsUser: //p' <<<"$rendered" | sort -u); do
    [ "$uid" = "$user" ] || bad "the manifests run as uid $uid, the image as $user"
  done
else
  echo "containerfile: kubectl missing, manifest cross-checks skipped"
fi

# the runtime libraries
if command -v dpkg >/dev/null && [ -x "$build/ps-server/ps-server" ]; then
  pkgs="$(grep -A3 'apt-get install' <<<"$runtime_stage" | tr ' \\' '\n\n' |
          grep -E '^[a-z0-9][a-z0-9.+-]+$' | grep -vx 'apt-get\|install\|rm' || true)"
  base="libc6 libgcc-s1 zlib1g libstdc++6"
  # everything the runtime packages pull in
  # shellcheck disable=SC2086
  closure="$({ printf '%s\n' $pkgs; apt-cache depends --recurse --important $pkgs 2>/dev/null |
             sed -n 's/^ *\(Pre\)\{0,1\}Depends: //p'; } | sort -u)"
  for bin in ps-server/ps-server ps-worker/ps-worker; do
    for lib in $(ldd "$build/$bin" | awk '$3 ~ /^\// {print $3}'); do
      # the image is built with -Dcuda=disabled -Dnccl=disabled and without
      # sanitizers (a build dir may have them)
      case "$lib" in /usr/local/cuda* | */libasan.* | */libubsan.* | */liblsan.* | */libtsan.*) continue ;; esac
      real="$(readlink -f "$lib")"
      pkg=""
      # merged /usr: dpkg may know the file under /lib or under /usr/lib
      for f in "$lib" "$real" "${real#/usr}" "/usr${lib}"; do
        pkg="$(dpkg -S "$f" 2>/dev/null | head -1 | cut -d: -f1 || true)"
        [ -n "$pkg" ] && break
      done
      [ -n "$pkg" ] || { bad "$(basename "$bin") needs $lib, from no Debian package"; continue; }
      # a library may come in as a dependency of an installed package
      if ! grep -qx "$pkg" <<<"$closure" && ! grep -qw "$pkg" <<<"$base"; then
        bad "$(basename "$bin") needs $lib ($pkg), which the runtime stage does not install"
      fi
    done
  done
else
  echo "containerfile: no dpkg or no built binaries, runtime library check skipped"
fi

[ "$fails" = 0 ] || exit 1
echo "containerfile: ok"
