#!/usr/bin/env bash
# Make sure the system tools the project runs are installed: the real Squid
# (the local provider and the tests run it) and curl (the end-to-end tests
# drive Squid with it). Extra `command:package` pairs add more, e.g. the tests
# pass `promtool:prometheus` to check the alert rules with Prometheus's own tool.
set -euo pipefail
missing=()
command -v squid >/dev/null 2>&1 || [ -x /usr/sbin/squid ] || missing+=(squid)
command -v curl >/dev/null 2>&1 || missing+=(curl)
for pair in "$@"; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing ${missing[*]} (apt-get)..."
  apt-get update -qq
  # No daemon of theirs is wanted: packages like prometheus would start one.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d.proxy-operator
  chmod +x /usr/sbin/policy-rc.d.proxy-operator
  [ -e /usr/sbin/policy-rc.d ] || ln -s policy-rc.d.proxy-operator /usr/sbin/policy-rc.d
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  [ -L /usr/sbin/policy-rc.d ] && rm -f /usr/sbin/policy-rc.d
  rm -f /usr/sbin/policy-rc.d.proxy-operator
  exit 0
fi
echo "${missing[*]} not installed: run 'sudo apt-get install ${missing[*]}' (Debian/Ubuntu) and try again" >&2
exit 1
