#!/usr/bin/env bash
# The API reference from the headers' /// comments, with Doxygen (Debian's `doxygen`, installed if missing):
# HTML under OUTDIR/html. Fails on any Doxygen warning (a malformed comment, a reference to
# nothing); members without a comment are not warned about.
#
#   ci/docs.sh [OUTDIR]        (default build/docs)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-build/docs}")
if ! command -v doxygen > /dev/null; then
  echo "ci/docs.sh: installing doxygen"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends doxygen
fi
mkdir -p "$out"
version=$(sed -n 's/^project(strata LANGUAGES CXX VERSION \([0-9.]*\)).*/\1/p' CMakeLists.txt)
cat > "$out/Doxyfile" <<DOXY
PROJECT_NAME           = strata
PROJECT_NUMBER         = $version
PROJECT_BRIEF          = "Training strategies for models larger than one GPU, checked for parity"
OUTPUT_DIRECTORY       = $out
INPUT                  = strategies models correctness/support/parity.h correctness/support/chain.h
FILE_PATTERNS          = *.h
RECURSIVE              = YES
STRIP_FROM_PATH        = $(pwd)
STRIP_FROM_INC_PATH    = $(pwd)
FULL_PATH_NAMES        = YES
EXTRACT_ALL            = NO
EXTRACT_PRIVATE        = NO
EXTRACT_STATIC         = YES
JAVADOC_AUTOBRIEF      = YES
QUIET                  = YES
WARNINGS               = YES
WARN_IF_UNDOCUMENTED   = NO
WARN_IF_DOC_ERROR      = YES
WARN_NO_PARAMDOC       = NO
WARN_LOGFILE           = $out/warnings.log
GENERATE_HTML          = YES
GENERATE_LATEX         = NO
ENABLE_PREPROCESSING   = YES
HAVE_DOT               = NO
CLASS_GRAPH            = NO
MACRO_EXPANSION        = NO
DOXY
doxygen "$out/Doxyfile"
if [ -s "$out/warnings.log" ]; then
  cat "$out/warnings.log"
  echo "ci/docs.sh: $(wc -l < "$out/warnings.log") warning lines (above)"
  exit 1
fi
echo "ci/docs.sh: API reference at $out/html/index.html, no warnings"
