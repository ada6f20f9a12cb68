"""dmc checkpoint -> Hugging Face folder (same as `dmc convert mcore-to-hf`); `--help` lists the
options."""
import sys

from dmc.convert.cli import main

if __name__ == "__main__":
    sys.exit(main("mcore-to-hf"))
