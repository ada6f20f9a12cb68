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


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_state_bytes_are_what_the_sequences_slices_of_the_state_hold(name):
    """``PolicyRunner.state_bytes``: the bytes of the sequence's slices of every per-slot tensor
    (the original positions and the policy's slot state) over its held slots, the float32 key
    copies of the slots that may move (StreamingLLM's re-rotation), plus its slice of every
    per-sequence tensor, summed tensor by tensor over (layer, head)."""
    from dmc.inference import PagedKVCache
    from dmc.policies import PolicyRunner

    layers, kv = 2, 2
    cache = PagedKVCache(layers, kv, 8, num_pages=32, page_size=4, max_seqs=MAX_SEQS,
                         window=None, dtype=torch.float32, max_seq_len=32)
    runner = PolicyRunner(get_policy(name, 2.0), cache, num_heads=2 * kv, scale=8 ** -0.5)
    cache.add_sequence()
    seq = cache.add_sequence()
    runner.reset(seq)
    for layer in range(layers):
        for _ in range(5 + layer):
            cache.append(layer, [seq], torch.randn(1, kv, 8), torch.randn(1, kv, 8))
    owner = getattr(runner.policy, "base", runner.policy)
    per_slot = [runner.positions] + [getattr(owner, n) for n in owner.slot_state_names]
    if name == "streamingllm":
        per_slot.append(runner.rerotation.anchors)  # [seqs, layers, kv, sinks, head_dim]
    want = sum(t[seq, layer, head, :int(cache.lengths[seq, layer, head])].nbytes
               for t in per_slot for layer in range(layers) for head in range(kv))
    want += sum(getattr(owner, n)[seq].nbytes for n in owner.seq_state_names)
    assert (runner.rerotation is None) == (name != "streamingllm")
    assert runner.state_bytes(seq) == want > 0
