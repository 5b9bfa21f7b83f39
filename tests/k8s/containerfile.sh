#!/usr/bin/env bash
# containerfile: deploy/Containerfile cannot be built here (no registry), so
# its structure is checked against what the manifests and the binaries need:
#  - two stages, both Debian 12: a build stage that runs meson setup, ninja,
#    the unit tests and meson install, and a runtime stage that copies only
#    what meson installed under /usr/local from it (nothing from the context);
#  - the binaries land where the manifests' `command` points, and what
#    `meson install` of this build puts under /usr/local is what the image
#    needs: the binaries, libps.so.0, the ps package where /usr/bin/python3
#    imports it;
#  - the runtime stage installs python3-torch and python3-numpy (the torch
#    overlay runs /usr/bin/python3 scripts);
#  - it runs as the non-root uid the manifests' runAsUser names;
#  - every shared library the built ps-server, ps-worker and libps.so load
#    comes from a Debian package the runtime stage installs (or that
#    debian:12-slim has).
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
grep -qx 'COPY --from=build /install/usr/local/ /usr/local/' <<<"$copy" ||
  bad "the runtime stage does not copy what meson installed (COPY --from=build /install/usr/local/ /usr/local/)"
grep -q '^RUN ldconfig' <<<"$runtime_stage" || bad "the runtime stage does not run ldconfig after copying libps"
grep -qE '^COPY (\.|[^-])' <<<"$runtime_stage" && bad "the runtime stage copies from the context"
user="$(sed -n 's/^USER \([0-9]*\)\(:[0-9]*\)\{0,1\}$/\1/p' <<<"$runtime_stage" | tail -1)"
[ -n "$user" ] && [ "$user" != 0 ] || bad "the runtime stage does not run as a numeric non-root USER"

# against the manifests
if command -v kubectl >/dev/null; then
  rendered="$(kubectl kustomize "$root/deploy/k8s/overlays/ps")"
  for bin in ps-server ps-worker; do
    grep -q "\"/usr/local/bin/$bin\"\|- /usr/local/bin/$bin" <<<"$rendered" ||
      bad "the manifests do not run /usr/local/bin/$bin"
  done
  torch="$(kubectl kustomize "$root/deploy/k8s/overlays/torch")"
  grep -q '"/usr/bin/python3"\|- /usr/bin/python3$' <<<"$torch" || bad "overlays/torch does not run /usr/bin/python3"
  for uid in $(sed -n 's/^ *runAsUser: //p' <<<"$rendered$torch" | sort -u); do
    [ "$uid" = "$user" ] || bad "the manifests run as uid $uid, the image as $user"
  done
else
  echo "containerfile: kubectl missing, manifest cross-checks skipped"
fi

pkgs="$(grep -A4 'apt-get install' <<<"$runtime_stage" | sed '/^ *&& rm /,$d' | tr ' \\' '\n\n' |
        grep -E '^[a-z0-9][a-z0-9.+-]+$' | grep -vx 'apt-get\|install\|rm' || true)"
for p in python3-torch python3-numpy; do
  grep -qx "$p" <<<"$pkgs" || bad "the runtime stage does not install $p (overlays/torch needs it)"
done

# what meson install of this build puts under /usr/local: the image's
# /usr/local (the pod test mounts the same tree)
if [ -f "$build/build.ninja" ] && command -v meson >/dev/null; then
  stage="$(mktemp -d "${PS_BUILD_DIR:-/tmp}/k8s-install-XXXXXX")"
  trap 'rm -rf "$stage"' EXIT
  if ! meson install -C "$build" --destdir "$stage" --no-rebuild --quiet >"$stage.log" 2>&1; then
    bad "meson install --destdir failed: $(tail -5 "$stage.log")"
  else
    local="$stage/usr/local"
    for f in bin/ps-server bin/ps-worker; do
      [ -x "$local/$f" ] || bad "meson install puts no /usr/local/$f"
    done
    # libps and the Python package, once this tree builds them
    if [ -e "$build/ps-worker/libps/libps.so.0" ]; then
      [ -n "$(find "$local/lib" -maxdepth 2 -name libps.so.0 2>/dev/null)" ] ||
        bad "the build has libps.so.0 but meson install puts none under /usr/local/lib"
    fi
    if [ -d "$root/python/ps" ]; then
      pkg="$(cd "$local" && find . -path '*/ps/__init__.py' | head -1)"
      if [ -z "$pkg" ]; then
        bad "meson install puts no ps package under /usr/local"
      elif [ -x /usr/bin/python3 ]; then
        dir="/usr/local/${pkg#./}"; dir="${dir%/ps/__init__.py}"
        sites="$(/usr/bin/python3 -c 'import site; print("\n".join(site.getsitepackages()))')"
        grep -qx "$dir" <<<"$sites" ||
          bad "meson install puts the ps package in $dir, which /usr/bin/python3 does not search ($(tr '\n' ' ' <<<"$sites"))"
      fi
    fi
  fi
  rm -f "$stage.log"
else
  echo "containerfile: no configured build or no meson, install check skipped"
fi

# the runtime libraries
if command -v dpkg >/dev/null && [ -x "$build/ps-server/ps-server" ]; then
  base="libc6 libgcc-s1 zlib1g libstdc++6"
  # everything the runtime packages pull in
  # shellcheck disable=SC2086
  closure="$({ printf '%s\n' $pkgs; apt-cache depends --recurse --important $pkgs 2>/dev/null |
             sed -n 's/^ *\(Pre\)\{0,1\}Depends: //p'; } | sort -u)"
  objs=(ps-server/ps-server ps-worker/ps-worker)
  [ -e "$build/ps-worker/libps/libps.so.0" ] && objs+=(ps-worker/libps/libps.so.0)
  for bin in "${objs[@]}"; do
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
