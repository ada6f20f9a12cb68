"""NVIDIA Megatron-LM DMC checkpoint -> dmc checkpoint (same as `dmc convert nvidia-dmc`);
`--help` lists the options."""
import sys

from dmc.convert.cli import main

if __name__ == "__main__":
    sys.exit(main("nvidia-dmc"))
