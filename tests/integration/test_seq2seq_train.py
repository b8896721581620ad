"""``zerofit train`` on an encoder-decoder's folder and input/target pairs ([Note: pairs for an encoder-decoder],
zerofit/data/pairs.py): the pairs as the model's own tokenizer encodes them, padded into one shape; the run streams
the model's layers in the hooked mode, its first step's loss is plain PyTorch's on the same micro-batches, and the
exported folder loads with transformers' AutoModelForSeq2SeqLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.model_dirs import make_model_dir
from tests.support.tiny_tokenizer import build_tokenizer
from tests.support.train_cli import invoke, losses, train_args
from zerofit.data import DataError, StepLoader, build_datasets
from zerofit.data.pairs import IGNORE_INDEX

pytestmark = pytest.mark.usefixtures("one_thread")


def _pairs(folder: Path, n: int = 24, kind: str = "pairs") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{kind}.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            a, b = f"What is {i} plus {i}?", f"It is {2 * i}."
            row = {"input": a, "target": b} if kind == "pairs" else {"prompt": a, "completion": b}
            f.write(json.dumps(row) + "\n")
    return path


def test_pairs_are_the_tokenizers_encodings_padded_into_one_shape(tmp_path):
    tok = build_tokenizer()
    files = [_pairs(tmp_path / "d"), _pairs(tmp_path / "d", 4, kind="completions")]
    data = build_datasets(files, tok, seq_len=32, eval_size=2, seed=0, seq2seq=True)
    assert len(data.train) + len(data.eval) == 28 and dict(data.stats.documents) == {"input/target": 28}
    batch = data.train.batch([0, 1, 2])
    assert batch["input_ids"].shape == (3, 32) and batch["attention_mask"].shape == (3, 32)
    assert batch["labels"].shape == (3, data.train.target_len) and data.train.target_len <= 32
    for row, k in enumerate([0, 1, 2]):
        pair = data.train.pairs[k]
        i = int(pair.source.rsplit("row ", 1)[1]) - 1  # the row's number in its file
        source = tok(f"What is {i} plus {i}?")["input_ids"]
        target = tok(text_target=f"It is {2 * i}.")["input_ids"] + [tok.eos_token_id]  # (this tokenizer adds no EOS)
        assert batch["input_ids"][row, : len(source)].tolist() == source
        assert batch["attention_mask"][row].tolist() == [1] * len(source) + [0] * (32 - len(source))
        assert batch["labels"][row, : len(target)].tolist() == target and target[-1] == tok.eos_token_id
        assert (batch["labels"][row, len(target) :] == IGNORE_INDEX).all()
    loader = StepLoader(data.train, 2, 2, seed=0)
    assert [mb["input_ids"].shape for mb in next(loader)] == [(2, 32), (2, 32)]


def test_a_text_row_is_refused_for_an_encoder_decoder_by_name(tmp_path):
    (tmp_path / "notes.jsonl").write_text(json.dumps({"text": "just a text"}) + "\n")
    with pytest.raises(DataError, match=r"notes.jsonl, row 1: a text row, but an encoder-decoder trains on pairs"):
        build_datasets([tmp_path / "notes.jsonl"], build_tokenizer(), seq_len=8, seq2seq=True)


def test_zerofit_train_on_a_t5_folder_and_pairs(tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    model = make_model_dir(tmp_path / "t5", "t5", torch.float32)
    data = _pairs(tmp_path / "data")
    out = tmp_path / "out"
    result = invoke(train_args(model, [data], out, "--steps", "3"))
    assert result.exit_code == 0, result.output[-3000:]
    said = " ".join(result.output.split())
    assert "24 input/target" in said.replace("input/ target", "input/target") and "training pairs" in said, said
    got = losses(out)
    assert [s for s, _ in got] == [1, 2, 3]
    # the first step's loss: plain PyTorch's on the same micro-batches, from the folder's weights
    split = build_datasets([data], model, 32, eval_size=2, seed=0, seq2seq=True)
    loader = StepLoader(split.train, 2, 2, seed=0)
    ref = AutoModelForSeq2SeqLM.from_pretrained(model)
    with torch.no_grad():
        want = sum(float(ref(**mb).loss) for mb in next(loader)) / 2
    assert got[0][1] == pytest.approx(want, rel=1e-5)
    trained = AutoModelForSeq2SeqLM.from_pretrained(out / "model")
    assert type(trained).__name__ == "T5ForConditionalGeneration"
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), ref.parameters()))
