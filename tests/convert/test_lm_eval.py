"""lm-eval (``--model hf ... trust_remote_code=True``) runs a small local multiple-choice task on an
exported tiny DMC model, offline (slow: a subprocess importing lm-eval)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
tokenizers = pytest.importorskip("tokenizers")

from dmc.convert import mcore_to_hf  # noqa: E402
from dmc_models import VOCAB, save_tiny, tiny_dmc  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread", "parallel_1x1")]
WORDS = [f"w{i}" for i in range(VOCAB - 2)]
TASK = """task: tiny_dmc_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def word_tokenizer(folder):
    """A whitespace word-level tokenizer over the tiny vocabulary, as HF files."""
    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "</s>"}))


def test_lm_eval_multiple_choice_on_exported_dmc_model(tmp_path):
    model, cfg, dmc = tiny_dmc(groups=2, window=4)
    save_tiny(model, cfg, dmc, tmp_path / "mc")
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    word_tokenizer(tok_dir)
    mcore_to_hf(tmp_path / "mc", tmp_path / "hf", tokenizer=tok_dir)

    rows = [{"context": " ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(12)),
             "choices": [WORDS[(3 * i + k) % len(WORDS)] for k in range(3)], "answer": i % 3}
            for i in range(8)]
    data = tmp_path / "task" / "data.jsonl"
    data.parent.mkdir()
    data.write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "task" / "tiny_dmc_choice.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "results"
    lm_eval = shutil.which("lm_eval", path=os.path.dirname(sys.executable)) or "lm_eval"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "ds_cache"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [lm_eval, "--model", "hf", "--model_args",
         f"pretrained={tmp_path / 'hf'},trust_remote_code=True,dtype=float32",
         "--tasks", "tiny_dmc_choice", "--include_path", str(tmp_path / "task"),
         "--device", "cpu", "--batch_size", "4", "--output_path", str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result_files = list(out.rglob("results*.json"))
    assert result_files, proc.stdout[-2000:]
    results = json.loads(result_files[0].read_text())["results"]["tiny_dmc_choice"]
    print("lm-eval tiny_dmc_choice:", results)
    assert 0.0 <= results["acc,none"] <= 1.0
    assert json.loads(result_files[0].read_text())["n-samples"]["tiny_dmc_choice"]["effective"] == 8
