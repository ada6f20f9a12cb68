import warnings

import pytest

warnings.filterwarnings("ignore", module="megatron")


@pytest.fixture(scope="module")
def parallel_1x1():
    """Single-process megatron set-up (gloo on CPU)."""
    from dmc.megatron.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(1, 1, seed=1234)
    yield
    destroy_parallel()
