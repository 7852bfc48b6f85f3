#!/usr/bin/env bash
# install-deps.sh - installs the Debian/Ubuntu packages dflash builds with,
# only those that are missing. Uses sudo when not root. Set DFLASH_NO_INSTALL=1
# to only check.
set -euo pipefail
PKGS=(cmake make gcc liburing-dev liblz4-dev libzstd-dev libcjson-dev xz-utils)
# LAPACK (dsyevr): the eigendecomposition of formats/basis.c
PKGS+=(liblapack-dev)
# clang + its runtime: the AddressSanitizer/UBSan build and the libFuzzer targets
PKGS+=(clang libclang-rt-dev)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "${DFLASH_NO_INSTALL:-0}" = 1 ]; then
  echo "missing packages: ${missing[*]}" >&2
  exit 1
fi
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
echo "installing: ${missing[*]}" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
