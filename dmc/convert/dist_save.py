"""Worker of :func:`dmc.convert.mcore_io.write_checkpoint` for ``tp * pp > 1``: run by
``torch.distributed.run`` as ``python -m dmc.convert.dist_save PAYLOAD.pt FOLDER``. Each rank
builds its shard of the model, loads its part of the full weights and joins the distributed save.
"""
from __future__ import annotations

import sys
import warnings


def main(payload: str, folder: str) -> None:
    import torch

    from dmc.convert.mcore_io import load_full_state, save_model_checkpoint
    from dmc.megatron.model import build_model_from_config
    from dmc.megatron.parallel import destroy_parallel, initialize_parallel

    saved = torch.load(payload, map_location="cpu", weights_only=True)
    meta = saved["meta"]
    initialize_parallel(meta["tp"], meta["pp"])
    model = build_model_from_config(meta["model_config"], meta["dmc_config"])
    load_full_state(model, saved["state"])
    save_model_checkpoint(model, folder, meta)
    destroy_parallel()


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main(*sys.argv[1:3])
