#!/usr/bin/env bash
# The CPU build of torch 2.13.0 into the active Python environment, unless torch is there
# already. A CPU wheel pip can reach (e.g. an offline wheel folder in pip's find-links) first;
# otherwise PyTorch's CPU index: on PyPI the Linux wheel of torch 2.13.0 is the CUDA build and
# pulls in ~3 GB of CUDA packages. DMC_TORCH_INDEX replaces that index (a mirror).
set -euo pipefail
python -c "import torch" >/dev/null 2>&1 && exit 0
python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null ||
  python -m pip install -q "torch==2.13.0" \
    --index-url "${DMC_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
