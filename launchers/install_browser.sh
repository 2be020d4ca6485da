#!/usr/bin/env bash
# Headless Chromium + its WebDriver for launchers/mlflow_compare_screenshot.py (Debian packages).
#   launchers/install_browser.sh      # installs chromium and chromium-driver if missing (needs root)
# Idempotent: exits at once when both are on PATH. Used by `make ui-check` and the slow UI test,
# so the compare-view check works from a fresh machine.
set -euo pipefail

log() { echo "[install_browser] $*" >&2; }

if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { log "chromium/chromium-driver are missing and this is not root: install them as root"; exit 1; }
  SUDO="sudo"
fi
log "installing chromium chromium-driver (apt-get)"
export DEBIAN_FRONTEND=noninteractive
# A fresh machine has no package lists yet; `install` alone would find nothing.
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null
command -v chromium >/dev/null && command -v chromedriver >/dev/null || { log "install finished but chromium/chromedriver are not on PATH"; exit 1; }
log "ok: $(chromium --version 2>/dev/null | head -1)"
