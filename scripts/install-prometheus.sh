#!/usr/bin/env bash
# The e2e tests need a real Prometheus server and promtool: Debian's prometheus package.
# Installs it where this can (root with apt-get); elsewhere says so, and those tests skip
# (or fail when CI=true).
set -euo pipefail
if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
else
  echo "note: prometheus/promtool not installed and not installable here (needs root and apt);" \
       "the e2e tests will skip. Install Debian's prometheus package to run them." >&2
fi
