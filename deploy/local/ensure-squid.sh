#!/usr/bin/env bash
# Make sure the real Squid (and curl, which the end-to-end tests drive it
# with) are installed: tests and the local provider run them.
set -euo pipefail
missing=()
command -v squid >/dev/null 2>&1 || [ -x /usr/sbin/squid ] || missing+=(squid)
command -v curl >/dev/null 2>&1 || missing+=(curl)
[ ${#missing[@]} -eq 0 ] && exit 0
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing ${missing[*]} (apt-get)..."
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  exit 0
fi
echo "${missing[*]} not installed: run 'sudo apt-get install ${missing[*]}' (Debian/Ubuntu) and try again" >&2
exit 1
