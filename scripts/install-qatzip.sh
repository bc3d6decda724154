#!/usr/bin/env bash
# Make libqatzip.so.3 (Intel QATzip >= 1.2) available to kvtool's qat codec.
#
# 1. Already loadable from the system: nothing to do.
# 2. The distribution packages it (Debian 13, Ubuntu 24.04): apt-get install libqatzip3.
# 3. Otherwise (e.g. Debian 12): download Debian 13's libqatzip3, libqat4 and libusdm0
#    with a private apt state (the system's apt sources and state are left untouched)
#    and unpack them into $XDG_DATA_HOME/kvtool/qatzip (~/.local/share/kvtool/qatzip),
#    where kvtool looks for them, installed or run from a checkout. A checkout's
#    .local/qatzip, where this script unpacked them before, is still used.
#    No system library is replaced; without QAT hardware QATzip runs its software fallback.
#    KVTOOL_QATZIP_MIRROR and KVTOOL_QATZIP_SUITE override the Debian mirror and suite.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
data_home=${XDG_DATA_HOME:-}
[[ "$data_home" == /* ]] || data_home="$HOME/.local/share"
dest="$data_home/kvtool/qatzip"
packages=(libqatzip3 libqat4 libusdm0)
suite=${KVTOOL_QATZIP_SUITE:-trixie}
mirror=${KVTOOL_QATZIP_MIRROR:-http://deb.debian.org/debian}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

fail() { echo "install-qatzip: error: $*" >&2; exit 1; }

if /sbin/ldconfig -p 2>/dev/null | grep -q 'libqatzip\.so\.3 '; then
    echo "install-qatzip: libqatzip.so.3 is already installed on this system; nothing to do"
    exit 0
fi

local_lib=$(ls "$dest"/usr/lib/*/libqatzip.so.3 "$repo"/.local/qatzip/usr/lib/*/libqatzip.so.3 2>/dev/null | head -n1 || true)
if [[ -n "$local_lib" ]]; then
    echo "install-qatzip: already unpacked at $local_lib; nothing to do"
    exit 0
fi

command -v apt-get >/dev/null || fail "apt-get not found; install QATzip >= 1.2 (libqatzip.so.3) yourself and set KVTOOL_QATZIP_LIB to its path"

candidate=$(apt-cache policy libqatzip3 2>/dev/null | awk '/Candidate:/ {print $2}')
if [[ -n "$candidate" && "$candidate" != "(none)" ]]; then
    [[ $(id -u) -eq 0 ]] || fail "libqatzip3 $candidate is packaged here; install it as root: apt-get install libqatzip3"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libqatzip3 >/dev/null \
        || fail "apt-get install libqatzip3 failed"
    echo "install-qatzip: installed libqatzip3 $candidate from the system's package sources"
    exit 0
fi

[[ -r "$keyring" ]] || fail "$keyring not found; install the debian-archive-keyring package"
command -v dpkg >/dev/null || fail "dpkg not found"

work=$(mktemp -d)
trap 'rm -rf "$work" "$dest.tmp"' EXIT
mkdir -p "$work"/state/lists/partial "$work"/cache/archives/partial "$work"/etc/sources.list.d \
    "$work"/etc/preferences.d "$work"/debs
touch "$work"/state/status
echo "deb [signed-by=$keyring] $mirror $suite main" >"$work"/etc/sources.list
apt_opts=(
    -o Dir::State="$work/state"
    -o Dir::State::status="$work/state/status"
    -o Dir::Cache="$work/cache"
    -o Dir::Etc::sourcelist="$work/etc/sources.list"
    -o Dir::Etc::sourceparts="$work/etc/sources.list.d"
    -o Dir::Etc::preferences="$work/etc/preferences"
    -o Dir::Etc::preferencesparts="$work/etc/preferences.d"
    -o APT::Sandbox::User=root
    -o Acquire::Languages=none
    -o Debug::NoLocking=true
)

apt-get "${apt_opts[@]}" -qq update >"$work/log" 2>&1 \
    || fail "cannot read the $suite package index from $mirror: $(tail -n1 "$work/log")"
(cd "$work/debs" && apt-get "${apt_opts[@]}" -qq download "${packages[@]}" >"$work/log" 2>&1) \
    || fail "cannot download ${packages[*]} from $suite: $(tail -n1 "$work/log")"

rm -rf "$dest.tmp"
mkdir -p "$dest.tmp"
for deb in "$work"/debs/*.deb; do
    dpkg -x "$deb" "$dest.tmp"
done
lib=$(ls "$dest".tmp/usr/lib/*/libqatzip.so.3 2>/dev/null | head -n1 || true)
[[ -n "$lib" ]] || fail "the downloaded packages hold no libqatzip.so.3"
if command -v ldd >/dev/null; then
    missing=$(LD_LIBRARY_PATH="$(dirname "$lib")" ldd "$lib" | awk '/not found/ {print $1}' | tr '\n' ' ')
    [[ -z "$missing" ]] || fail "libqatzip.so.3 needs libraries this system lacks: $missing(Debian: libnuma1, liblz4-1, zlib1g, libssl3)"
fi
rm -rf "$dest"
mv "$dest.tmp" "$dest"
versions=$(cd "$work/debs" && ls *.deb | sed -E 's/_([^_]+)_[^_]+\.deb$/ \1/' | tr '\n' ',' | sed 's/,$//; s/,/, /g')
echo "install-qatzip: unpacked $versions from Debian $suite into $dest"
