#!/usr/bin/env bash
# The proof that a project outside this tree can use fsdp: install the build given as $1 into a
# fresh prefix, build examples/ against it with find_package(fsdp), and train the example at W = 2.
#   examples/build_and_run.sh BUILD_DIR TORCH_CMAKE_PREFIX
set -euo pipefail
BUILD=$1
TORCH_CMAKE=$2
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d /tmp/fsdp-example.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cmake --install "$BUILD" --prefix "$WORK/prefix" > "$WORK/install.log"
test -f "$WORK/prefix/lib/cmake/fsdp/fsdpConfig.cmake"
test -f "$WORK/prefix/include/fsdp/fsdp.h"
test -f "$WORK/prefix/lib/libfsdp.a"
LAUNCHER=()
if command -v ccache > /dev/null; then
  # Paths under the temporary folder are hashed relative to it, so every run hits the same entries.
  export CCACHE_BASEDIR=$WORK CCACHE_NOHASHDIR=true
  LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
cmake -S "$HERE" -B "$WORK/build" -DCMAKE_PREFIX_PATH="$WORK/prefix;$TORCH_CMAKE" "${LAUNCHER[@]}" > "$WORK/configure.log" 2>&1 \
  || { cat "$WORK/configure.log"; exit 1; }
cmake --build "$WORK/build" -j2 > "$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
"$WORK/build/regression" --nproc-per-node 2
