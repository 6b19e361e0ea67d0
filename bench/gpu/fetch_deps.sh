#!/usr/bin/env bash
# Downloads the Debian packages mt's build needs into build-deps/ (ignored by git), on a machine
# with Debian's package archive (a developer's machine), for a GPU machine that has no network:
# bench/gpu/run.sh unpacks them into a private prefix there when the system lacks them.
#   bench/gpu/fetch_deps.sh            then carry build-deps/ along with the working tree (~25 MB)
# Only the headers and libraries of scripts/setup.sh's list (less the tools and Google Benchmark,
# which run.sh does not build) and the shared libraries they load, Debian 12's versions.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dest=${1:-$root/build-deps}
packages=(
  libboost1.74-dev
  libyaml-cpp-dev libyaml-cpp0.7
  libfmt-dev libfmt9
  libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 libhwloc15
  libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread libgfortran5 libquadmath0
  libgtest-dev libgmock-dev
  libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3
  libsentencepiece-dev libsentencepiece0
  libutf8proc-dev libutf8proc2
  pkgconf pkgconf-bin libpkgconf3
)
mkdir -p "$dest"
cd "$dest"
rm -f ./*.deb
if ! apt-get download "${packages[@]}" >/dev/null; then
  echo "fetch_deps: apt-get download failed (run 'apt-get update' first?)." >&2
  exit 1
fi
echo "fetch_deps: $(find . -maxdepth 1 -name '*.deb' | wc -l) packages, $(du -sh . | cut -f1), in $dest" >&2
