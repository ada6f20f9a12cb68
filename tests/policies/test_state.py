"""Every tensor a policy keeps per sequence is declared as slot or sequence state, so that the
runner counts it in ``state_bytes`` and ``reset`` clears it for the next sequence."""
import pytest
import torch

from dmc.policies import POLICY_NAMES, get_policy
from dmc.policies.base import PolicyShape

MAX_SEQS = 3


def bound(name):
    policy = get_policy(name, 2.0)
    shape = PolicyShape(num_layers=4, num_kv_heads=2, group=2, head_dim=8, max_seqs=MAX_SEQS,
                        max_slots=16, scale=8 ** -0.5, inv_freq=torch.ones(4),
                        device=torch.device("cpu"))
    policy.bind(shape)
    return policy


def per_sequence_tensors(policy):
    """Tensor attributes of the policy (or its base) whose first dimension is the sequences."""
    owner = getattr(policy, "base", policy)
    return {n for n, t in vars(owner).items()
            if isinstance(t, torch.Tensor) and t.dim() > 1 and t.shape[0] == MAX_SEQS}


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_per_sequence_tensors_are_declared_and_reset(name):
    policy = bound(name)
    owner = getattr(policy, "base", policy)
    declared = set(owner.slot_state_names) | set(owner.seq_state_names)
    assert per_sequence_tensors(policy) <= declared
    fresh = {n: getattr(owner, n).clone() for n in declared}
    for n in declared:
        getattr(owner, n)[1] = 7
    policy.reset(1)
    for n in declared:
        assert torch.equal(getattr(owner, n), fresh[n]), n
