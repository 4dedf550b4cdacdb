# Sourced by scripts/demo and scripts/test: create or reuse .venv and install the
# project into it. Reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ZEROSERVICE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating virtualenv $VENV" >&2
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.zeroservice-installed"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "installing zeroservice and its dependencies into $VENV (first run: about 2 minutes)" >&2
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
  # torch is pinned in pyproject.toml to the CPU wheel these machines carry.
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[dev]" >&2
  echo "$want" > "$stamp"
fi
# Keep every process on loopback; Ray must not probe cloud metadata addresses.
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"
export RAY_USAGE_STATS_ENABLED=0
export PATH="$VENV/bin:$PATH"
