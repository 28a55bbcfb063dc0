#!/usr/bin/env bash
# Installs hybridrec with its test dependencies and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
# the stream tests start a real redis-server (Debian's package) on loopback; they skip, naming the
# reason, only where it cannot be installed
if ! command -v redis-server >/dev/null 2>&1 && ! [ -x /usr/bin/redis-server ] && command -v apt-get >/dev/null 2>&1; then
  sudo_=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && sudo_="sudo -n"
  { $sudo_ apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends redis-server; } \
    >/dev/null 2>&1 || echo "scripts/test.sh: redis-server could not be installed; the Redis stream tests will skip" >&2
fi
python -m pytest -q "$@"
