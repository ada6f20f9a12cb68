"""benchmarks/decode_throughput.py: the budget counts exactly the bytes the cache allocates, the
batch is the largest that fits, bad flags exit 2 naming them, and a tiny run of the protocol end
to end (modes interleaved, steady-state window, JSON, bytes per step and roofline)."""
import json
import math

import pytest
import torch

from dmc.inference import Engine, PagedKVCache
from dmc.inference.delayed_cache import DelayedMergeCache
from dmc.inference.dms_cache import DMSPagedCache
from tiny_models import build_tiny
from conftest import load_benchmark

bench = load_benchmark("decode_throughput")
TINY = ["--preset", "cpu", "--layers", "1", "--hidden", "64", "--heads", "4", "--groups", "2",
        "--ffn", "64", "--vocab", "64", "--prompt-len", "24"]  # a model of a few kB, P = 24


def allocated_bytes(root, device: torch.device) -> int:
    """Bytes of every distinct tensor storage on ``device`` reachable from ``root`` through the
    attributes of ``dmc`` objects (the cache, its allocator, ...)."""
    return sum(storage_sizes(root, device))


def storage_sizes(root, device: torch.device) -> list[int]:
    """The byte size of each distinct storage :func:`allocated_bytes` counts."""
    seen_objects, storages, sizes = set(), set(), []
    pending = [root]
    while pending:
        obj = pending.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        for value in vars(obj).values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                if value.device == device and storage.data_ptr() not in storages:
                    storages.add(storage.data_ptr())
                    sizes.append(storage.nbytes())
            elif type(value).__module__.startswith("dmc.") and hasattr(value, "__dict__"):
                pending.append(value)
    return sizes


@pytest.mark.parametrize(
    "layers,kv_heads,head_dim,pages,page_size,seqs,window,dtype,max_len,ring", [
    (2, 4, 16, 37, 16, 3, None, torch.float32, 100, torch.float32),
    (3, 2, 32, 10, 5, 4, 12, torch.bfloat16, 64, torch.float32),
    (3, 2, 32, 10, 5, 4, 12, torch.bfloat16, 64, torch.bfloat16),
    (1, 1, 8, 1, 7, 1, 3, torch.float16, 13, torch.float16),
    ])
def test_budget_accounting_equals_the_bytes_the_cache_allocates(
        layers, kv_heads, head_dim, pages, page_size, seqs, window, dtype, max_len, ring):
    cache = PagedKVCache(layers, kv_heads, head_dim, pages, page_size=page_size, max_seqs=seqs,
                         window=window, dtype=dtype, max_seq_len=max_len, ring_dtype=ring)
    counted = bench.cache_allocation(layers, kv_heads, head_dim, pages, page_size, seqs, window,
                                     dtype, max_len, ring_dtype=ring)
    assert counted["total"] == allocated_bytes(cache, cache.device)


@pytest.mark.parametrize("layers,kv_heads,head_dim,pages,seqs,dms_window,dtype", [
    (2, 4, 16, 37, 3, 32, torch.float32),
    (1, 2, 8, 5, 1, 0, torch.bfloat16),
])
def test_dms_budget_accounting_equals_the_bytes_the_cache_allocates(
        layers, kv_heads, head_dim, pages, seqs, dms_window, dtype):
    """The DMS cache: the pages, the unused one-row merge state of its base class, the window
    rings and the host position counter (the device is the CPU)."""
    cache = DMSPagedCache(layers, kv_heads, head_dim, pages, dms_window, page_size=4,
                          max_seqs=seqs, dtype=dtype, max_seq_len=50)
    counted = bench.cache_allocation(layers, kv_heads, head_dim, pages, 4, seqs, None, dtype,
                                     50, dms_window=dms_window)
    assert counted["total"] == allocated_bytes(cache, cache.device)
    element = torch.empty((), dtype=dtype).element_size()
    assert counted["dms_ring"] == seqs * layers * kv_heads * (dms_window + 1) * (
        2 * head_dim * element + 1)
    with pytest.raises(ValueError, match="DMC window"):
        bench.cache_allocation(1, 1, 8, 1, 4, 1, 12, dtype, 50, dms_window=4)


@pytest.mark.parametrize("layers,kv_heads,head_dim,pages,seqs,delay,window,dtype", [
    (2, 4, 16, 37, 3, 16, 12, torch.float32),
    (1, 2, 8, 5, 1, 1, None, torch.bfloat16),
])
def test_delayed_merge_budget_accounting_equals_the_bytes_the_cache_allocates(
        layers, kv_heads, head_dim, pages, seqs, delay, window, dtype):
    """Delayed merging: the pages, the DMC merge state, the rings of raw tokens with their two
    float32 decisions, and the host position counter (the device is the CPU)."""
    cache = DelayedMergeCache(layers, kv_heads, head_dim, pages, delay, page_size=4,
                              max_seqs=seqs, window=window, dtype=dtype, max_seq_len=50)
    counted = bench.cache_allocation(layers, kv_heads, head_dim, pages, 4, seqs, window, dtype,
                                     50, merge_delay=delay)
    assert counted["total"] == allocated_bytes(cache, cache.device)
    element = torch.empty((), dtype=dtype).element_size()
    assert counted["delay_ring"] == seqs * layers * kv_heads * (delay + 1) * (
        2 * head_dim * element + 2 * 4)
    with pytest.raises(ValueError, match="exclude each other"):
        bench.cache_allocation(1, 1, 8, 1, 4, 1, None, dtype, 50, dms_window=4, merge_delay=4)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 12])
def test_budget_accounting_on_cuda(window):
    """On CUDA the host copies of the block tables and lengths are not counted: the budget is
    device memory. The caching allocator's report exceeds it by its rounding only: each block
    rounded up to 512 bytes, and a block over 1 MiB may keep a remainder under 1 MiB of the
    cached segment it was cut from (seen on an H200: a 6 MiB ring in a 6.19 MiB block)."""
    device = torch.device("cuda", torch.cuda.current_device())  # tensors report cuda:N
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    cache = PagedKVCache(4, 8, 128, 1000, page_size=16, max_seqs=32, window=window,
                         dtype=torch.bfloat16, device=device, max_seq_len=4096,
                         ring_dtype=torch.bfloat16 if window else torch.float32)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated(device) - before
    counted = bench.cache_allocation(4, 8, 128, 1000, 16, 32, window, torch.bfloat16, 4096,
                                     device="cuda", ring_dtype=cache.open_k.dtype)
    sizes = storage_sizes(cache, device)
    assert counted["total"] == sum(sizes)
    rounding = 512 * len(sizes) + 2**20 * sum(size > 2**20 for size in sizes)
    assert 0 <= grown - counted["total"] < rounding


@pytest.mark.parametrize("window", ["vanilla", 3])
def test_budget_accounting_of_an_engine_cache(parallel_1x1, window):
    model, _ = build_tiny(2, window, max_seq=64)
    engine = Engine(model, page_size=4, max_batch=3, num_pages=50, max_seq_len=64)
    cache = engine.cache
    counted = bench.cache_allocation(2, 2, 16, 50, 4, 3, cache.window, cache.dtype, 64)
    assert counted["total"] == allocated_bytes(cache, cache.device)


def test_fit_batch_is_the_largest_batch_within_the_budget():
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, window=12,
                 dtype=torch.float32, max_seq_len=64)
    budget = 200_000
    batch, pages = bench.fit_batch(budget, 20, 100, shape)

    def used(b, n):
        return bench.cache_allocation(num_pages=n, max_seqs=b, **shape)["total"] + 100 * b

    assert batch >= 1 and pages >= 20 * batch
    assert used(batch, pages) <= budget < used(batch, pages + 1)
    assert used(batch + 1, 20 * (batch + 1)) > budget
    assert bench.fit_batch(1000, 20, 100, shape) == (0, 0)
    spared, spared_pages = bench.fit_batch(budget, 20, 100, shape, headroom_pages=30)
    assert spared_pages >= 20 * spared + 30 and used(spared, spared_pages) <= budget
    assert used(spared + 1, 20 * (spared + 1) + 30) > budget and spared < batch


@pytest.mark.parametrize("flags,named", [
    (["--modes", "dmc:1"], "--modes"),
    (["--modes", "turbo"], "--modes"),
    (["--modes", "policy:nope:2"], "tova"),
    (["--modes", "policy:snapkv@later:2"], "schedule must be one of ['prefill', 'streaming']"),
    (["--modes", "model"], "--model"),
    (["--modes", "gqa:3"], "--groups"),
    (["--modes", "dms:1"], "--modes"),
    (["--modes", "dms:4", "--dms-window", "-1"], "--dms-window"),
    (["--modes", "dms:8", "--dms-window", "63"], "--dms-window"),
    (["--modes", "delay:4", "--merge-delay", "0"], "--merge-delay"),
    (["--modes", "delay:8", "--merge-delay", "63"], "--merge-delay"),
    (["--modes", "delay:1"], "--modes"),
    (["--gen-len", "8", "--steady", "8"], "--steady"),
    (["--budget-mib", "0"], "--budget-mib"),
    (["--preset", "tpu"], "--preset"),
    (["--prefill-tokens", "0"], "--prefill-tokens"),
    (["--chunk-size", "-5"], "--chunk-size: must be >= 1"),
    (["--c", "nan"], "--c: must be a finite number"),
    (["--overlap", "on"], "--overlap: on needs --cuda-graphs"),
    (["--overlap", "maybe", "--cuda-graphs"], "--overlap"),
    (["--groups", "0"], "model.num_query_groups: must be > 0"),
    (["--vocab", "0"], "model.vocab_size: must be > 0"),
])
def test_bad_flags_exit_2_naming_them(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--preset", "cpu"] + flags)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_a_presets_budget_is_lowered_to_what_the_gpu_holds():
    """On a GPU every mode's cache must fit beside the models and a reserve for activations
    (5 caches of 12 GiB do not fit an H100 beside five 1B models): a preset's budget is
    lowered to an equal share, a budget given on the command line is refused (the benchmark
    exits 2 with the message)."""
    gib, reserve = 2**30, bench.ACTIVATION_RESERVE
    assert bench.device_budget(12 * gib, 130 * gib, 5, given=False) == 12 * gib
    assert bench.device_budget(12 * gib, 60 * gib, 5, given=False) == (60 * gib - reserve) // 5
    with pytest.raises(ValueError, match="--budget-mib: 5 caches of 12288 MiB do not fit"):
        bench.device_budget(12 * gib, 60 * gib, 5, given=True)
    with pytest.raises(ValueError, match="at most 0 MiB per mode"):
        bench.device_budget(gib, reserve // 2, 2, given=False)
    assert not bench.parse_args(["--preset", "cpu"]).budget_given
    assert bench.parse_args(["--preset", "cpu", "--budget-mib", "8"]).budget_given


def test_prefill_tokens_cap_the_step():
    args = bench.parse_args(["--preset", "cpu", "--prompt-len", "100"])
    assert args.prefill_tokens is None and bench.step_tokens(args, 8) == 8 * 101
    args = bench.parse_args(["--preset", "cpu", "--prompt-len", "100", "--prefill-tokens", "300"])
    assert bench.step_tokens(args, 8) == 8 + 300  # the decode tokens beside
    args = bench.parse_args(["--preset", "cpu", "--prompt-len", "100", "--prefill-tokens", "50"])
    assert bench.step_tokens(args, 8) == 8 + 100  # a chunk at least
    args = bench.parse_args(["--preset", "cpu", "--prompt-len", "100", "--prefill-tokens", "5000"])
    assert bench.step_tokens(args, 8) == 8 * 101  # never more than every prompt at once
    assert bench.parse_args(["--preset", "gpu"]).prefill_tokens == 32768


def test_prompts_prefilled_over_several_steps(tmp_path):
    """With ``--prefill-tokens`` the batch is admitted over several steps; the steady window
    still holds full-batch decode steps only."""
    out = tmp_path / "decode.json"
    assert bench.main([
        *TINY, "--gen-len", "24", "--steady", "4",
        "--budget-mib", "0.25", "--modes", "vanilla,dmc:4", "--prefill-tokens", "60",
        "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    for row in rows:
        assert row["steady_steps"] == 4 and row["steady_tokens"] == 4 * row["batch"]
        assert row["batch"] > 2  # more prompts than one 60-token step prefills
    assert json.loads(out.read_text())["args"]["prefill_tokens"] == 60


def test_tiny_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "decode.json"
    code = bench.main([
        *TINY, "--gen-len", "10", "--steady", "4",
        "--budget-mib", "0.25", "--modes",
        "vanilla,dmc:4,gqa:2,policy:streamingllm:2,dms:2,delay:4", "--dms-window", "8",
        "--merge-delay", "4", "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["partial"] is False and not (tmp_path / "decode.json.partial").exists()
    rows = {row["mode"]: row for row in data["rows"]}
    assert set(rows) == {"vanilla", "dmc 4x", "gqa 2x", "streamingllm 2x", "dms 2x",
                         "dmc delay 4x"}
    for row in rows.values():
        assert row["memory"]["total"] + row["memory"]["policy_state"] <= data["budget_bytes"]
        assert row["steady_steps"] == 4 and row["steady_tokens"] == 4 * row["batch"]
        assert row["preemptions"] == 0 and row["tokens_per_s"] > 0
    assert rows["vanilla"]["speedup_vs_vanilla"] == 1.0
    assert rows["dmc 4x"]["measured_cr"] > 2 and rows["dmc 4x"]["batch"] > rows["vanilla"]["batch"]
    dms = rows["dms 2x"]
    assert 1.6 < dms["measured_cr"] < 2.4 and dms["batch"] > rows["vanilla"]["batch"]
    assert dms["memory"]["dms_ring"] == dms["batch"] * 2 * 9 * (2 * 16 * 4 + 1)
    assert data["args"]["dms_window"] == 8
    delay = rows["dmc delay 4x"]
    assert 2.5 < delay["measured_cr"] < 5.5 and delay["batch"] > rows["vanilla"]["batch"]
    assert delay["memory"]["delay_ring"] == delay["batch"] * 2 * 5 * (2 * 16 * 4 + 2 * 4)
    out = capsys.readouterr().out
    assert "x vanilla" in out and "GB/s" in out and "roofline" in out
    for row in rows.values():  # the roofline columns
        parts = row["step_bytes"]
        assert parts["total"] == parts["weights"] + parts["kv"] + parts["dmc_state"]
        assert 0 < parts["kv"] <= row["memory"]["pages"]
        assert (parts["dmc_state"] > 0) == (row["kind"] in ("dmc", "dms", "delay"))
        roof = row["roofline"]
        assert 0 < roof["fraction"] and roof["bound_seconds"] > 0 and row["step_flops"] > 0
        median = row["batch"] / row["median_step_tokens_per_s"]
        assert roof["achieved_bytes_per_s"] == pytest.approx(parts["total"] / median)
        assert roof["fraction"] == pytest.approx(roof["bound_seconds"] / median)
    assert rows["gqa 2x"]["step_bytes"]["weights"] < rows["vanilla"]["step_bytes"]["weights"]
    assert dms["step_bytes"]["dmc_state"] == dms["memory"]["dms_ring"]  # the ring it attends
    assert delay["step_bytes"]["dmc_state"] == (delay["memory"]["dmc_state"]
                                                + delay["memory"]["delay_ring"])


def test_overlapped_twins_run_in_blocks(tmp_path):
    """``--overlap both``: every mode but the policy twice (with ``Engine(overlap=True)``);
    every mode runs blocks of steps, the first of each not timed, and the overlapped twins draw
    what their plain twins draw."""
    from dmc.eval.decode_modes import Mode

    tova = Mode("policy", 2.0, "tova")
    one, two, three = ("base", None, None), ("base", None, "tova"), ("base", "dmc", None)
    built = {Mode("vanilla"): one, tova: two, Mode("dmc", 4.0): three}
    assert list(bench.with_overlap(built, "both").items()) == [
        (Mode("vanilla"), one), (Mode("vanilla", overlap=True), one), (tova, two),
        (Mode("dmc", 4.0), three), (Mode("dmc", 4.0, overlap=True), three)]
    assert list(bench.with_overlap(built, "on")) == [
        Mode("vanilla", overlap=True), tova, Mode("dmc", 4.0, overlap=True)]
    assert bench.with_overlap(built, "off") is built
    out = tmp_path / "decode.json"
    assert bench.main([
        *TINY, "--gen-len", "40", "--steady", "8",
        "--budget-mib", "0.25", "--modes", "vanilla,dmc:4,dms:2", "--dms-window", "8",
        "--cuda-graphs", "--overlap", "both", "--out", str(out)]) == 0
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"vanilla", "vanilla overlap", "dmc 4x", "dmc 4x overlap", "dms 2x",
                         "dms 2x overlap"}
    for name, row in rows.items():
        assert row["overlap"] == name.endswith("overlap")
        assert (row["median_host_seconds"] is None) == row["overlap"]
        assert row["steady_steps"] == 8 and row["steady_tokens"] == 8 * row["batch"]
    for kind in ("vanilla", "dmc 4x", "dms 2x"):
        plain, twin = rows[kind], rows[f"{kind} overlap"]
        assert twin["batch"] == plain["batch"] and twin["measured_cr"] == plain["measured_cr"]
    assert rows["vanilla overlap"]["speedup_vs_vanilla"] == 1.0  # against vanilla overlapped
    assert rows["dmc 4x overlap"]["speedup_vs_vanilla"] == pytest.approx(
        rows["dmc 4x overlap"]["tokens_per_s"] / rows["vanilla overlap"]["tokens_per_s"])


def test_partial_figures_are_written_during_the_run(tmp_path, monkeypatch):
    """Every PARTIAL_EVERY interleaved steps ``--out`` holds the figures so far ("partial":
    true; no rooflines), so a run stopped by a time limit leaves them."""
    monkeypatch.setattr(bench, "PARTIAL_EVERY", 4)
    seen = []
    real_save = json.dump

    def spy(obj, f, **kwargs):
        seen.append(json.loads(json.dumps(obj)))
        real_save(obj, f, **kwargs)

    monkeypatch.setattr(bench.json, "dump", spy)
    out = tmp_path / "decode.json"
    assert bench.main([
        *TINY, "--gen-len", "16", "--steady", "4",
        "--budget-mib", "0.25", "--modes", "vanilla,dmc:4", "--out", str(out)]) == 0
    partial = [d for d in seen if d["partial"]]
    assert len(partial) >= 3 and not seen[-1]["partial"]
    later = {row["mode"]: row for row in partial[-1]["rows"]}
    assert later["dmc 4x"]["steady_steps"] > 0 and later["dmc 4x"]["speedup_vs_vanilla"] > 0
    assert "roofline" not in later["dmc 4x"] and "roofline" in seen[-1]["rows"][1]


def test_a_mode_that_fails_leaves_the_others_figures(tmp_path, monkeypatch, capsys):
    """A mode whose engine raises in the timed run is reported (its row's ``error``, the table,
    exit 1); the other modes run to the end and are written."""
    real_step = bench.Run.step

    def step(self, cuda, first=True):
        if self.mode.kind == "dmc" and len(self.steps) == 3:
            raise RuntimeError("injected fault")
        real_step(self, cuda, first)

    monkeypatch.setattr(bench.Run, "step", step)
    out = tmp_path / "decode.json"
    assert bench.main([
        *TINY, "--gen-len", "10", "--steady", "4",
        "--budget-mib", "0.25", "--modes", "vanilla,dmc:4", "--out", str(out)]) == 1
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["dmc 4x"]["error"] == "RuntimeError: injected fault"
    assert rows["vanilla"]["steady_steps"] == 4 and "error" not in rows["vanilla"]
    assert "dmc 4x | failed: RuntimeError: injected fault" in capsys.readouterr().out


def test_roofline_counts_and_bound(parallel_1x1):
    """Weights read once (an untied input embedding only for the batch's rows), 2 flops per
    weight and token, 4 * head_dim per (query head, slot); the bound is the slower resource."""
    from dmc.eval.roofline import (
        Machine,
        attention_flops,
        measure_machine,
        roofline,
        weight_bytes_and_flops,
    )

    model, _ = build_tiny(2, None, max_seq=64)
    params = dict(model.named_parameters())
    table = params["embedding.word_embeddings.weight"]
    total = sum(p.numel() * 4 for p in params.values())
    matrices = sum(p.numel() for p in params.values() if p.dim() == 2)
    weights, flops = weight_bytes_and_flops(model, batch=3)
    if model.share_embeddings_and_output_weights:
        assert (weights, flops) == (total, 2 * 3 * matrices)
    else:
        assert weights == total - (table.shape[0] - 3) * table.shape[1] * 4
        assert flops == 2 * 3 * (matrices - table.numel())
    assert attention_flops(100, 2, 16) == 4 * 100 * 2 * 16
    machine = Machine(read_bytes_per_s=1e9, gemm_flops_per_s=1e10)
    memory = roofline(2e6, 1e6, 4e-3, machine)  # 2 ms of bytes, 0.1 ms of flops, in 4 ms
    assert memory["bound"] == "memory" and memory["fraction"] == pytest.approx(0.5)
    assert memory["achieved_bytes_per_s"] == pytest.approx(5e8)
    assert roofline(1e3, 1e8, 2e-2, machine)["fraction"] == pytest.approx(0.5)
    measured = measure_machine(torch.device("cpu"), torch.float32, read_mib=4, gemm_size=64,
                               repeats=1)
    assert measured.read_bytes_per_s > 0 and measured.gemm_flops_per_s > 0


def test_measure_machine_rates_are_bytes_and_gemm_flops_over_the_timed_seconds(monkeypatch):
    """With the timer pinned (the read timed at 0.5 s, the GEMM at 0.25 s): read bandwidth is
    the buffer's bytes / 0.5 s, the GEMM rate 2 n^3 flops of an [n, n] @ [n, n] / 0.25 s."""
    import dmc.eval.roofline as roofline

    timed = []

    def pinned(fn, device, repeats):
        timed.append((fn().shape, repeats))
        return 0.5 if len(timed) == 1 else 0.25

    monkeypatch.setattr(roofline, "_best_seconds", pinned)
    got = roofline.measure_machine(torch.device("cpu"), torch.float32, read_mib=4, gemm_size=64,
                                   repeats=3)
    assert timed == [(torch.Size([]), 3), (torch.Size([64, 64]), 3)]  # the sum, then the matmul
    assert got == roofline.Machine(4 * 2**20 / 0.5, 2 * 64**3 / 0.25)


def test_trained_checkpoint_with_model(parallel_1x1, tmp_path):
    from dmc.inference import save_inference_state

    model, runtime = build_tiny(2, 3, max_seq=64)
    config = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                  num_query_groups=2, vocab_size=96, max_seq_length=64)
    path = tmp_path / "model.pt"
    save_inference_state(path, model, config, runtime.config)
    out = tmp_path / "decode.json"
    assert bench.main(["--preset", "cpu", "--model", str(path), "--prompt-len", "20",
                       "--gen-len", "8", "--steady", "4", "--budget-mib", "0.2",
                       "--modes", "vanilla,model", "--out", str(out)]) == 0
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["model"]["measured_cr"] > 1.2 and rows["vanilla"]["measured_cr"] == 1.0
    assert rows["model"]["batch"] >= rows["vanilla"]["batch"]
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--model", str(path), "--modes", "dmc:2"])
    assert exit_info.value.code == 2


def test_a_checkpoints_head_size_sizes_the_budget(parallel_1x1, tmp_path, monkeypatch):
    """--model of heads of 32 channels at hidden 64 / 4 heads (kv_channels != hidden / heads):
    the pages counted against the budget are the page pool the engine allocates."""
    from dmc.inference import save_inference_state
    from dmc.megatron.config import ModelConfig
    from dmc.megatron.model import build_model_from_config

    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                         num_query_groups=2, vocab_size=96, max_seq_length=64, kv_channels=32)
    path, out = tmp_path / "model.pt", tmp_path / "decode.json"
    save_inference_state(path, build_model_from_config(config), config, None)
    engines, engine_for = [], bench.engine_for
    monkeypatch.setattr(bench, "engine_for", lambda *a, **k: engines.append(
        engine_for(*a, **k)) or engines[-1])
    assert bench.main(["--preset", "cpu", "--model", str(path), "--prompt-len", "20",
                       "--gen-len", "8", "--steady", "4", "--budget-mib", "0.2",
                       "--modes", "vanilla", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    cache = engines[-1].cache
    assert cache.head_dim == 32
    assert row["memory"]["pages"] == 2 * cache.k_pages.numel() * cache.k_pages.element_size()


def test_batch_leaves_the_pages_a_decode_step_reserves(tmp_path, monkeypatch):
    """A DMS head whose next slot starts a page is given one for the step whether or not its
    token survives: sized on the pages its sequences end with alone, a full pool preempts at
    the end of generation (small pages make such heads common); with the probe's reservation
    per sequence counted, none. Vanilla's steps take what they reserve: nothing counted."""
    args = ["--preset", "cpu", "--layers", "4", "--hidden", "64", "--heads", "8", "--groups",
            "8", "--ffn", "64", "--vocab", "64", "--prompt-len", "24", "--gen-len", "24",
            "--steady", "4", "--page-size", "4", "--budget-mib", "2", "--modes",
            "vanilla,dms:4", "--dms-window", "4"]
    rows = []
    for reserve in (True, False):
        if not reserve:
            probe = bench.probe
            monkeypatch.setattr(bench, "probe", lambda *a: {**probe(*a),
                                                            "step_reserve_per_seq": 0})
        out = tmp_path / f"{reserve}.json"
        assert bench.main([*args, "--out", str(out)]) == 0
        rows.append({row["mode"]: row for row in json.loads(out.read_text())["rows"]})
    counted, uncounted = rows
    assert counted["vanilla"]["step_reserve_per_seq"] == 0
    assert counted["dms 4x"]["step_reserve_per_seq"] > 0
    assert counted["dms 4x"]["preemptions"] == 0 and uncounted["dms 4x"]["preemptions"] > 0
    assert counted["dms 4x"]["batch"] < uncounted["dms 4x"]["batch"]


def test_profile_names_where_a_mode_spends_more_than_vanilla(tmp_path, capsys):
    """``--profile``: one step of each mode under the profiler, its busiest ops, and for each
    mode but vanilla the ops whose time exceeds vanilla's most."""
    assert bench.main([*TINY, "--gen-len", "8", "--steady", "2", "--budget-mib", "0.25",
                       "--modes", "vanilla,dmc:4", "--profile",
                       "--out", str(tmp_path / "decode.json")]) == 0
    err = capsys.readouterr().err
    assert err.count("profile of one") == 2
    excess = err.split("dmc 4x: the 15 ops whose time in the profiled step exceeds vanilla's")
    assert len(excess) == 2 and "vanilla: the 15 ops" not in err
    lines = [line for line in excess[1].splitlines()[1:] if line.strip().startswith("+")]
    assert lines and all(float(line.split()[0]) > 0 for line in lines)


def test_the_peak_per_sequence_divides_by_every_probed_sequence(monkeypatch):
    """The probe's peak pages per sequence is the engine's peak over all the probed sequences,
    also where they end at different steps (here each asks for twice the tokens of the one
    before, so the last decodes alone at the end): the peak was once divided by the sequences
    of the last decode-only step, which halved a CPU preset's DMC 4x batch."""
    from dmc.inference import SamplingParams

    engines, engine_for = [], bench.engine_for

    def staggered(*args):
        engine = engine_for(*args)
        add_request = engine.add_request
        engine.add_request = lambda prompt, params: add_request(prompt, SamplingParams(
            max_new_tokens=2 ** (len(engine.scheduler.waiting) + 1), temperature=1.0))
        engines.append(engine)
        return engine

    monkeypatch.setattr(bench, "engine_for", staggered)
    args = bench.parse_args([*TINY, "--gen-len", "8", "--steady", "4", "--modes", "dmc:4",
                             "--probe", "3"])
    (mode, built), = bench.build_models(args).items()
    row = bench.probe(mode, *built, args, SamplingParams(max_new_tokens=8, temperature=1.0))
    engine, = engines
    assert engine.stats.generated_tokens == 2 + 4 + 8
    assert row["peak_pages_per_seq"] == math.ceil(engine.stats.peak_pages / 3)


def test_many_probed_sequences_size_the_batch_by_the_bound_of_their_spread(tmp_path,
                                                                          monkeypatch):
    """``--probe 12``: each sequence's pages recorded (4 for vanilla, whose pages do not
    vary), the batch sized by :func:`~dmc.eval.kv_budget.batch_pages_bound` (with the step's
    reservation), no preemption; an overlapped twin takes its plain twin's probe, not a second
    one."""
    from dmc.eval.kv_budget import batch_pages_bound

    probed, probe = [], bench.probe
    monkeypatch.setattr(bench, "probe", lambda mode, *a: probed.append(mode.label) or probe(
        mode, *a))
    out = tmp_path / "decode.json"
    assert bench.main([*TINY, "--gen-len", "10", "--steady", "4", "--budget-mib", "0.25",
                       "--modes", "vanilla,dmc:4", "--probe", "12", "--cuda-graphs",
                       "--overlap", "both", "--out", str(out)]) == 0
    assert probed == ["vanilla", "dmc 4x"]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    for name, row in rows.items():
        assert len(row["pages_probed"]) == (4 if name.startswith("vanilla") else 12), name
        assert row["preemptions"] == 0 and row["probe_preemptions"] == 0, name
        batch, bound = row["batch"], batch_pages_bound(row["pages_probed"])
        pages = max(bound(batch), batch * row["peak_pages_per_seq"]) \
            + batch * row["step_reserve_per_seq"]
        assert row["pages_per_seq"] == math.ceil(pages / batch)
        assert row["num_pages"] >= pages + 1 * 2  # the headroom: a page per (layer, KV head)
    assert len(set(rows["vanilla"]["pages_probed"])) == 1  # vanilla's pages do not vary
    assert rows["dmc 4x overlap"]["pages_probed"] == rows["dmc 4x"]["pages_probed"]
    assert bench.probe_pages(bench.parse_mode("dmc:4"), bench.parse_args(TINY), 12) == math.ceil(
        1.5 * 12 * 1 * 2 * math.ceil((24 + 64) / 16) / 4) + 12 * 2  # 1.5x at 4x, a page a head
    assert bench.probe_pages(bench.parse_mode("vanilla"), bench.parse_args(TINY), 12) is None


@pytest.mark.parametrize("cr, tokens, ring", [(4.0, 1024, 65), (2.0, 48, 9), (3.0, 100, 1),
                                              (1.5, 33, 17), (8.0, 4096, 13)])
def test_window_keep_fraction_reaches_the_cr_at_the_full_length(cr, tokens, ring):
    """The ring plus the kept share of the older tokens is tokens / cr (float64), a share in
    [0, 1]."""
    from dmc.eval.decode_modes import window_keep_fraction

    keep = window_keep_fraction(cr, tokens, ring)
    assert 0.0 < keep < 1.0
    assert ring + keep * (tokens - ring) == pytest.approx(tokens / cr, rel=1e-12, abs=0)


@pytest.mark.parametrize("cr, tokens, ring, keep", [
    (4.0, 100, 26, 0.0),  # the window alone (26) is more than tokens / cr (25): keep none
    (4.0, 100, 25, 0.0),  # the window alone is tokens / cr
    (1.0, 100, 9, 1.0),  # 1x keeps every older token
    (2.0, 9, 9, 1.0),  # no token older than the window
    (2.0, 5, 9, 1.0),
])
def test_window_keep_fraction_clamps(cr, tokens, ring, keep):
    """0 when the window alone reaches tokens / cr, 1 at 1x and when no token is older than
    the window."""
    from dmc.eval.decode_modes import window_keep_fraction

    assert window_keep_fraction(cr, tokens, ring) == keep
