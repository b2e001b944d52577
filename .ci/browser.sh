#!/usr/bin/env bash
# The MLflow UI browser test's system packages: Debian's chromium and chromedriver, installed where apt-get exists
# and chromedriver is not there yet (needs root). Elsewhere it does nothing, and that one test skips saying why.
set -uo pipefail
command -v chromedriver >/dev/null && exit 0
command -v apt-get >/dev/null || { echo "browser: no apt-get here; the MLflow UI browser test will skip"; exit 0; }
(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
    || echo "browser: apt-get could not install chromium chromium-driver; the MLflow UI browser test will skip"
exit 0
