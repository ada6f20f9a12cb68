"""Hugging Face Llama folder -> dmc megatron-core checkpoint (same as `dmc convert hf-to-mcore`);
`--help` lists the options."""
import sys

from dmc.convert.cli import main

if __name__ == "__main__":
    sys.exit(main("hf-to-mcore"))
