#!/usr/bin/env bash
# The browser test drives Debian's Chromium (Playwright cannot download its own browser here).
set -euo pipefail
if [ -x /usr/bin/chromium ]; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
  echo "Chromium is missing and this user cannot install it: run 'apt-get install chromium' as root." >&2
  exit 1
fi
echo "Installing Debian's chromium for the browser test..."
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
