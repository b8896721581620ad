"""zerofit.data: formats and their loss masks, packing, split, shuffling, the resumable loader, evaluation.

Expected tokens are built independently of zerofit.data: each piece of a document is tokenized on its own with
the test tokenizer (tests/support/tiny_tokenizer.py) and marked by hand as scored or not.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.support.tiny_tokenizer import build_tokenizer, build_tokenizer_without_bos
from zerofit.data import (
    DataError,
    Document,
    PackedDataset,
    StepLoader,
    build_datasets,
    evaluate,
    load_documents,
    load_tokenizer,
    model_loss_fn,
    pack,
    split_documents,
)
from zerofit.data.shuffle import permutation

SYSTEM, USER1, ANSWER1, USER2, ANSWER2 = "Be brief.", "hi", "Hello there", "and the fox?", "The quick fox."
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": USER1},
    {"role": "assistant", "content": ANSWER1},
    {"role": "user", "content": USER2},
    {"role": "assistant", "content": ANSWER2},
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def pieces(tok, *parts: tuple[str, bool]) -> tuple[list[int], list[bool]]:
    """Token ids and scored flags of a document given as (text, scored) pieces, each tokenized alone."""
    ids, scored = [], []
    for text, flag in parts:
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids += t
        scored += [flag] * len(t)
    return ids, scored


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def only_doc(paths, tok, **kw) -> Document:
    docs = load_documents(paths, tok, **kw).documents
    assert len(docs) == 1
    return docs[0]


# --- the test tokenizer ------------------------------------------------------------------------------------


def test_tiny_tokenizer_is_deterministic_and_saves(tmp_path, tok):
    from transformers import AutoTokenizer

    again = build_tokenizer(tmp_path / "tok")
    assert again.get_vocab() == tok.get_vocab() and len(tok) > 300
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "Hello there! The answer is 42.\n\tdef f(): é"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded(text)["input_ids"][0] == loaded.bos_token_id
    assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text
    assert len(loaded(text, add_special_tokens=False)["input_ids"]) < len(text.encode())  # merges are in use
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert (
        loaded.apply_chat_template(CHAT[1:3], tokenize=False)
        == "<bos><|user|>\nhi<|end|>\n<|assistant|>\nHello there<|end|>\n"
    )
    assert (
        loaded.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=True)
        == "<bos><|user|>\nhi<|end|>\n<|assistant|>\n"
    )
    with pytest.raises(Exception, match="unknown role: tool"):
        loaded.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


# --- formats and their loss masks ----------------------------------------------------------------------------


def test_text_rows_every_token_is_a_target(tmp_path, tok):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "Hello there, the fox!", "id": 7}])
    (tmp_path / "b.txt").write_text("def train(model):\n\n    return 42\n")
    docs = load_documents(tmp_path, tok).documents
    for doc, text in zip(docs, ["Hello there, the fox!", "def train(model):\n\n    return 42\n"]):
        ids, _ = pieces(tok, ("<bos>", True), (text, True), ("<eos>", True))
        assert doc.input_ids.tolist() == ids and doc.targets.all() and doc.kind == "text"
    assert [d.source.rsplit("/", 1)[-1] for d in docs] == ["a.jsonl, row 1", "b.txt, row 1"]


def test_prompt_completion_masks_the_prompt(tmp_path, tok):
    doc = only_doc(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "What is 42?", "completion": " The answer."}]), tok)
    ids, scored = pieces(tok, ("<bos>", False), ("What is 42?", False), (" The answer.", True), ("<eos>", True))
    assert doc.input_ids.tolist() == ids
    assert doc.targets.tolist() == scored
    assert doc.kind == "prompt/completion"


def test_chat_scores_only_assistant_turns(tmp_path, tok):
    doc = only_doc(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}]), tok)
    ids, scored = pieces(
        tok,
        ("<bos><|system|>\n", False),
        (SYSTEM, False),
        ("<|end|>\n<|user|>\n", False),
        (USER1, False),
        ("<|end|>\n<|assistant|>\n", False),
        (ANSWER1, True),
        ("<|end|>\n", True),
        ("<|user|>\n", False),
        (USER2, False),
        ("<|end|>\n<|assistant|>\n", False),
        (ANSWER2, True),
        ("<|end|>\n", True),
        ("<eos>", True),
    )
    assert doc.input_ids.tolist() == ids
    assert doc.targets.tolist() == scored
    assert doc.input_ids.tolist().count(tok.bos_token_id) == 1  # the template's BOS, not a second one
    first = only_doc(write_jsonl(tmp_path / "first.jsonl", [{"messages": CHAT[2:3]}]), tok)  # assistant first
    ids, scored = pieces(tok, ("<bos><|assistant|>\n", False), (ANSWER1, True), ("<|end|>\n", True), ("<eos>", True))
    assert (first.input_ids.tolist(), first.targets.tolist()) == (ids, scored)


def test_chat_template_that_rewrites_earlier_turns_falls_back_to_the_content(tmp_path):
    tok = build_tokenizer()
    # Marks the last message only: a prefix of the conversation renders differently than in the whole.
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
        "{% if loop.last %} [end]{% endif %}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    doc = only_doc(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT[1:]}]), tok)
    ids, scored = pieces(
        tok,
        ("<bos><|user|>\n", False),
        (USER1, False),
        ("<|end|>\n<|assistant|>\n", False),
        (ANSWER1, True),
        ("<|end|>\n<|user|>\n", False),
        (USER2, False),
        ("<|end|>\n<|assistant|>\n", False),
        (ANSWER2, True),
        (" [end]<|end|>\n", False),
        ("<eos>", False),
    )
    assert doc.input_ids.tolist() == ids
    assert doc.targets.tolist() == scored


def test_tokenizer_without_bos_starts_documents_without_one(tmp_path):
    tok = build_tokenizer_without_bos()
    write_jsonl(
        tmp_path / "d.jsonl",
        [{"text": "Hello there"}, {"prompt": "hi", "completion": "the fox"}, {"messages": CHAT[1:3]}],
    )
    text, pc, chat = load_documents(tmp_path, tok).documents
    assert text.input_ids.tolist() == pieces(tok, ("Hello there", True), ("<eos>", True))[0]
    ids, scored = pieces(tok, ("hi", False), ("the fox", True), ("<eos>", True))
    assert (pc.input_ids.tolist(), pc.targets.tolist()) == (ids, scored)
    assert chat.input_ids.tolist()[0] == tok.bos_token_id  # the template writes it


def test_parquet_and_json_list_read_like_jsonl(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "What is 42?", "completion": " The answer."}, {"prompt": "hi", "completion": "yo"}]
    write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "b.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    chats = [{"messages": CHAT}, {"messages": CHAT[1:3]}]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "d.parquet")
    write_jsonl(tmp_path / "e.jsonl", chats)
    docs = load_documents(tmp_path, tok).documents
    assert len(docs) == 10
    for x, y in [
        (docs[0], docs[2]),
        (docs[0], docs[4]),
        (docs[1], docs[3]),
        (docs[1], docs[5]),
        (docs[6], docs[8]),
        (docs[7], docs[9]),
    ]:
        assert x.input_ids.tolist() == y.input_ids.tolist() and x.targets.tolist() == y.targets.tolist()
    assert docs[6].kind == "messages" and docs[6].targets.any() and not docs[6].targets.all()


def test_text_unit_and_rows_without_targets(tmp_path, tok):
    (tmp_path / "a.txt").write_text("first paragraph\n\nsecond paragraph\n\nthird")
    assert len(load_documents(tmp_path / "a.txt", tok).documents) == 1
    assert len(load_documents(tmp_path / "a.txt", tok, text_unit="paragraph").documents) == 3
    write_jsonl(tmp_path / "b.jsonl", [{"text": ""}, {"messages": CHAT[:2]}, {"text": "x"}])
    loaded = load_documents(tmp_path / "b.jsonl", tok)
    assert len(loaded.documents) == 1 and loaded.stats.rows == 3 and loaded.stats.rows_without_targets == 2


# --- packing -------------------------------------------------------------------------------------------------


def random_documents(rng: np.random.Generator, n: int, vocab: int = 300) -> list[Document]:
    docs = []
    for i in range(n):
        length = int(rng.integers(1, 30))
        docs.append(
            Document(rng.integers(3, vocab, length).astype(np.int32), rng.random(length) < 0.7, "text", f"doc {i}")
        )
    return docs


@pytest.mark.parametrize("seq_len", [2, 3, 7, 16, 64])
def test_packing_scores_every_target_exactly_once(seq_len):
    rng = np.random.default_rng(seq_len)
    docs = random_documents(rng, 25)
    data = pack(docs, seq_len, pad_id=0)
    # Expected, from the documents alone: the stream, and which of its positions carry a loss.
    stream = np.concatenate([d.input_ids for d in docs])
    expected = np.concatenate([np.r_[False, d.targets[1:]] for d in docs])  # a document's first token: context
    scored_at = []  # stream positions scored, over all windows
    rebuilt = []
    for k in range(len(data)):
        w = data[k]
        ids, labels = w["input_ids"], w["labels"]
        assert ids.shape == labels.shape == (seq_len,) and ids.dtype == labels.dtype == torch.int64
        rebuilt += ids.tolist() if k == 0 else ids[1:].tolist()  # windows overlap by one token
        # The model scores labels[t] for t >= 1 (from the tokens before it in the window).
        assert labels[0] == -100
        for t in range(1, seq_len):
            if labels[t] != -100:
                assert labels[t] == ids[t]
                scored_at.append(k * (seq_len - 1) + t)
    n = len(stream)
    assert rebuilt[:n] == stream.tolist()  # no token lost, order kept
    assert set(rebuilt[n:]) <= {0} and len(rebuilt) - n < seq_len - 1  # only the last window's padding
    assert sorted(scored_at) == np.flatnonzero(expected).tolist()  # every target once, masks preserved
    assert len(scored_at) == len(set(scored_at)) == data.num_target_tokens


@pytest.mark.parametrize("seq_len", [2, 3, 7, 16, 64])
def test_positions_restart_at_each_document_and_each_window(seq_len):
    """Each window's position_ids count the tokens since the latest document start in the window (or its first
    token), from the documents alone; so they never reach the window's length, and the padding starts at 0."""
    rng = np.random.default_rng(seq_len)
    docs = random_documents(rng, 25)
    data = pack(docs, seq_len, pad_id=0)
    starts = np.zeros(len(data.stream), dtype=bool)  # from the documents: where each one, and the padding, begins
    at = 0
    for d in docs:
        starts[at] = starts[at] or len(d) > 0
        at += len(d)
    if at < len(starts):
        starts[at] = True
    for k in range(len(data)):
        pos = data[k]["position_ids"]
        assert pos.dtype == torch.int64 and pos.shape == (seq_len,)
        want, run = [], 0
        for t in range(seq_len):
            i = k * (seq_len - 1) + t
            run = 0 if t == 0 or starts[i] else run + 1
            want.append(run)
        assert pos.tolist() == want
    assert int(data.batch(list(range(len(data))))["position_ids"].max()) < seq_len


def test_packed_windows_feed_a_causal_lm_like_unpacked_documents():
    """A document that fits in one window is scored on the same tokens as on its own (HF shift convention)."""
    doc = Document(np.arange(5, 15, dtype=np.int32), np.r_[[False] * 4, [True] * 6], "prompt/completion", "d")
    data = pack([doc], seq_len=16, pad_id=0)
    w = data[0]
    assert len(data) == 1
    assert w["input_ids"][:10].tolist() == list(range(5, 15)) and w["input_ids"][10:].tolist() == [0] * 6
    assert w["labels"].tolist() == [-100] * 4 + list(range(9, 15)) + [-100] * 6


# --- split, shuffling, determinism ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_jsonl(
        root / "a.jsonl", [{"text": f"The quick brown fox {i} jumps over the lazy dog {i * i}."} for i in range(30)]
    )
    write_jsonl(
        root / "b.jsonl",
        [{"prompt": f"What is {i}?", "completion": f" It is {i}."} for i in range(10)] + [{"messages": CHAT}] * 3,
    )
    return root


def test_split_by_documents_fraction_and_count(corpus, tok):
    docs = load_documents(corpus, tok).documents
    assert len(docs) == 43
    for eval_size, n_eval in [(0.1, 4), (5, 5), (0.0, 0), (0.01, 1)]:
        train, held = split_documents(docs, eval_size, seed=3)
        assert len(held) == n_eval and len(train) == 43 - n_eval
        assert sorted(map(id, train + held)) == sorted(map(id, docs))  # a partition of the documents
        again = split_documents(docs, eval_size, seed=3)
        assert [d.source for d in again[0]] == [d.source for d in train]
        assert [d.source for d in again[1]] == [d.source for d in held]
    other = split_documents(docs, 5, seed=4)[1]
    assert [d.source for d in other] != [d.source for d in split_documents(docs, 5, seed=3)[1]]
    with pytest.raises(DataError, match="cannot hold out 43 of 43 documents"):
        split_documents(docs, 43, seed=0)
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\)"):
        split_documents(docs, 1.0, seed=0)


def test_build_datasets_is_deterministic_in_the_seed(corpus, tok, tmp_path):
    a = build_datasets(corpus, tok, seq_len=16, eval_size=0.1, seed=1)
    b = build_datasets(corpus, tok, seq_len=16, eval_size=0.1, seed=1, cache_dir=tmp_path / "cache")
    c = build_datasets(corpus, tok, seq_len=16, eval_size=0.1, seed=2)
    assert torch.equal(a.train.stream, b.train.stream) and torch.equal(a.eval.stream, b.eval.stream)
    assert a.train.fingerprint == b.train.fingerprint != c.train.fingerprint
    assert a.train.num_documents + a.eval.num_documents == 43 and a.eval.num_documents == 4
    assert a.eval.fingerprint != c.eval.fingerprint  # another seed holds out other documents
    unshuffled = build_datasets(corpus, tok, seq_len=16, eval_size=0.1, seed=1, shuffle=False)
    assert torch.equal(unshuffled.eval.stream, a.eval.stream)  # the same held-out documents
    assert not torch.equal(unshuffled.train.stream, a.train.stream)  # packed in file order instead
    assert any((tmp_path / "cache").iterdir())  # datasets' Arrow cache went where it was told
    assert a.stats.documents == (("messages", 3), ("prompt/completion", 10), ("text", 30))
    assert permutation(6, 0, 1).tolist() == permutation(6, 0, 1).tolist() != permutation(6, 0, 2).tolist()


# --- the step loader -----------------------------------------------------------------------------------------


def numbered_windows(n_windows: int, seq_len: int) -> PackedDataset:
    """Windows whose first token is their own index (the stream counts up), so batches can be read back."""
    n = n_windows * (seq_len - 1) + 1
    doc = Document(np.arange(n, dtype=np.int32) // (seq_len - 1), np.ones(n, dtype=bool), "text", "d")
    data = pack([doc], seq_len, pad_id=0)
    assert len(data) == n_windows
    return data


def window_ids(step: list[dict[str, torch.Tensor]]) -> list[int]:
    return [int(i) for mb in step for i in mb["input_ids"][:, 0]]


def test_loader_steps_epochs_and_shapes():
    data = numbered_windows(10, 8)
    loader = StepLoader(data, micro_batch_size=2, gradient_accumulation_steps=2, seed=5)
    steps = [next(loader) for _ in range(5)]  # 20 windows: two epochs exactly
    for step in steps:
        assert len(step) == 2
        for mb in step:
            assert mb["input_ids"].shape == mb["labels"].shape == (2, 8)
            assert mb["input_ids"].dtype == mb["labels"].dtype == torch.int64
    seen = [w for s in steps for w in window_ids(s)]
    assert sorted(seen[:10]) == sorted(seen[10:]) == list(range(10))  # each epoch: every window once
    assert seen[:10] != seen[10:] and seen[:10] != list(range(10))  # a new shuffle each epoch
    assert (loader.epoch, loader.position) == (2, 0)
    same = StepLoader(data, 2, 2, seed=5)
    assert [window_ids(next(same)) for _ in range(5)] == [window_ids(s) for s in steps]
    other = StepLoader(data, 2, 2, seed=6)
    assert [window_ids(next(other)) for _ in range(5)] != [window_ids(s) for s in steps]
    plain = StepLoader(data, 2, 2, seed=5, shuffle=False)
    assert [w for _ in range(5) for w in window_ids(next(plain))] == list(range(10)) * 2


@pytest.mark.parametrize("steps_before", [0, 1, 2, 3, 4, 7])
def test_loader_resumes_exactly_across_epoch_boundaries(steps_before):
    data = numbered_windows(11, 6)  # 11 windows, 4 per step: steps 3, 6, 9 straddle an epoch boundary
    old = StepLoader(data, micro_batch_size=2, gradient_accumulation_steps=2, seed=9)
    for _ in range(steps_before):
        next(old)
    state = json.loads(json.dumps(old.state_dict()))  # as a checkpoint's client state stores it
    expected = [next(old) for _ in range(8)]
    new = StepLoader(data, micro_batch_size=2, gradient_accumulation_steps=2, seed=0)  # the state's seed wins
    new.load_state_dict(state)
    for want, got in zip(expected, (next(new) for _ in range(8))):
        for a, b in zip(want, got):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert new.state_dict() == old.state_dict()


def test_loader_refuses_a_state_from_other_data():
    state = StepLoader(numbered_windows(11, 6), 2, 1, seed=0).state_dict()
    loader = StepLoader(numbered_windows(12, 6), 2, 1, seed=0)
    with pytest.raises(ValueError, match="saved on other data: 11 windows"):
        loader.load_state_dict(state)
    loader.load_state_dict(state | {"num_windows": 12}, check_data=False)
    with pytest.raises(ValueError, match="lacks"):
        loader.load_state_dict({"seed": 0})


# --- evaluation ----------------------------------------------------------------------------------------------


def test_evaluate_is_the_token_weighted_mean_over_all_windows(corpus, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=len(tok),
            max_position_embeddings=64,
            attn_implementation="sdpa",
        )
    ).eval()
    data = build_datasets(corpus, tok, seq_len=16, eval_size=12, seed=0).eval
    assert len(data) >= 5
    # Direct: every window at once, cross-entropy of the shifted logits over the scored labels.
    batch = data.batch(range(len(data)))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits  # (W, T, V)
    per_token = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    n = int((batch["labels"][:, 1:] != -100).sum())
    direct = float(per_token) / n
    for mb in (1, 3, len(data)):  # windows carry different numbers of targets: weighting matters
        result = evaluate(data, model_loss_fn(model), micro_batch_size=mb)
        assert result.tokens == n == data.num_target_tokens and result.windows == len(data)
        assert result.loss == pytest.approx(direct, rel=1e-5)
        assert result.perplexity == pytest.approx(np.exp(direct), rel=1e-5)
    with torch.no_grad():
        per_window = [
            float(model_loss_fn(model)(data.batch([k])))
            for k in range(len(data))
            if (data[k]["labels"][1:] != -100).any()
        ]
    assert abs(np.mean(per_window) - direct) > 1e-4  # the check above could tell the two apart
    assert evaluate(data, model_loss_fn(model), 2, max_windows=2).windows == 2


# --- errors --------------------------------------------------------------------------------------------------


def test_errors_name_the_file_row_and_field(tmp_path, tok, capfd):
    with pytest.raises(DataError, match="nope.jsonl: no such file or folder"):
        load_documents(tmp_path / "nope.jsonl", tok)
    (tmp_path / "data.csv").write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"data.csv: unsupported extension '.csv'"):
        load_documents(tmp_path / "data.csv", tok)
    (tmp_path / "empty_folder").mkdir()
    with pytest.raises(DataError, match="holds no supported file"):
        load_documents(tmp_path / "empty_folder", tok)
    cases = {
        "nofield.jsonl": (
            [{"text": "ok"}, {"body": "x", "title": "y"}],
            r"nofield.jsonl, row 2: no 'text', 'prompt'\+'completion', 'messages' or 'input'\+'target' field"
            r" \(found 'body', 'title'\)",
        ),
        "mixed.jsonl": ([{"text": "a", "messages": CHAT}], r"mixed.jsonl, row 1: the row mixes formats"),
        "half.jsonl": ([{"prompt": "a"}], r"half.jsonl, row 1: .*'completion' is missing"),
        "types.jsonl": (
            [{"text": "a"}, {"text": {"nested": 1}}],
            r"types.jsonl, row 2: field 'text' must be a"
            r" string, found dict",
        ),
        "msg.jsonl": (
            [{"messages": [{"role": "user", "content": 3}]}],
            r"msg.jsonl, row 1: messages\[0\].content must be a string, found int",
        ),
    }
    for name, (rows, pattern) in cases.items():
        with pytest.raises(DataError, match=pattern):
            load_documents(write_jsonl(tmp_path / name, rows), tok)
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    capfd.readouterr()
    with pytest.raises(DataError, match="broken.jsonl: cannot be read as json"):
        load_documents(tmp_path / "broken.jsonl", tok)
    assert "Failed to load JSON" not in capfd.readouterr().err  # the reader's own log line: the error says it once
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "fine.txt").write_text("fine")
    with pytest.raises(DataError, match="latin1.txt: cannot be read as text"):
        load_documents([tmp_path / "fine.txt", tmp_path / "latin1.txt"], tok)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "empty.jsonl").write_text("")
    (tmp_path / "e" / "blank.txt").write_text("")
    with pytest.raises(DataError, match="the data set is empty: 2 files"):
        load_documents(tmp_path / "e", tok)
    plain = build_tokenizer()
    plain.chat_template = None
    with pytest.raises(DataError, match="chat.jsonl, row 1: a chat .* has no chat template"):
        load_documents(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}]), plain)
    with pytest.raises(DataError, match="no such folder"):
        load_tokenizer(tmp_path / "no_model")


def test_reads_offline_from_a_model_directory(tmp_path, monkeypatch, corpus):
    build_tokenizer(tmp_path / "model")

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", no_network)
    data = build_datasets(corpus, tmp_path / "model", seq_len=32, eval_size=0.1, seed=0)  # tokenizer by path
    assert len(data.train) > 0 and data.eval is not None
    assert "HF_HUB_OFFLINE" not in os.environ  # the switch was for the call only
