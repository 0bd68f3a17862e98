#!/usr/bin/env bash
# Make sure the real Squid is installed: tests and the local provider run it.
set -euo pipefail
if command -v squid >/dev/null 2>&1 || [ -x /usr/sbin/squid ]; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing squid (apt-get)..."
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq squid >/dev/null
  exit 0
fi
echo "squid is not installed: run 'sudo apt-get install squid' (Debian/Ubuntu) and try again" >&2
exit 1
