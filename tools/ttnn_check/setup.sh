#!/usr/bin/env bash
# A Python 3.10 virtualenv holding the real ttnn 0.81.1 (its wheels are cp310 only; it imports without a
# Tenstorrent card and without torch), for tools/ttnn_check/check_calls.py. Usage: setup.sh VENV_DIR
# Downloads the 103 MB wheel and two small packages (--no-deps: numpy, pandas, seaborn ... are not needed to
# import it or bind its signatures). Needs a python3.10: pyenv's (this machine image has 3.10.13) or on PATH.
set -euo pipefail
venv="${1:?usage: setup.sh VENV_DIR}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import ttnn" >/dev/null 2>&1; then
    exit 0
fi
py=""
for candidate in "${TTNN_PYTHON310:-}" "$(pyenv root 2>/dev/null)"/versions/3.10*/bin/python3.10 \
        /root/.pyenv/versions/3.10*/bin/python3.10 "$(command -v python3.10 || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then py="$candidate"; break; fi
done
if [ -z "$py" ]; then
    echo "tools/ttnn_check/setup.sh: no Python 3.10 found (ttnn's wheels are cp310 only); set TTNN_PYTHON310" >&2
    exit 1
fi
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps ttnn==0.81.1 loguru==0.7.3 graphviz==0.21
"$venv/bin/python" -c "import ttnn" >/dev/null 2>&1
echo "real ttnn 0.81.1 for the signature check: $venv/bin/python"
