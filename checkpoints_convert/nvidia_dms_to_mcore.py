"""NVIDIA Model-Optimizer DMS checkpoint (Hugging Face folder) -> dmc checkpoint (same as
`dmc convert nvidia-dms`); `--help` lists the options."""
import sys

from dmc.convert.cli import main

if __name__ == "__main__":
    sys.exit(main("nvidia-dms"))
