"""Local stand-ins for what the ported DeepSpeedExamples scripts would download or import from packages that are
not installed here (each port's docstring says which lines use them). Nothing here is DeepSpeed's or zerofit's:
they only feed the scripts tiny data that the tests write.

- ``datasets.CIFAR10`` and ``transforms`` (torchvision's names): a CIFAR-shaped data set read from
  ``<root>/cifar10_{train,test}.pt`` (``{"data": uint8 (N, 32, 32, 3), "targets": [int]}``, as torchvision
  keeps CIFAR-10 in memory), and torchvision's ``Compose``, ``ToTensor`` (HWC uint8 -> CHW float in [0, 1]) and
  ``Normalize`` ((x - mean) / std per channel).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from torch.utils.data import Dataset


class _Compose:
    def __init__(self, ts):
        self.ts = ts

    def __call__(self, x):
        for t in self.ts:
            x = t(x)
        return x


class _ToTensor:
    def __call__(self, img):
        return img.permute(2, 0, 1).contiguous().float().div(255)


class _Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


transforms = SimpleNamespace(Compose=_Compose, ToTensor=_ToTensor, Normalize=_Normalize)


class CIFAR10(Dataset):
    def __init__(self, root, train=True, download=False, transform=None):
        blob = torch.load(os.path.join(root, f"cifar10_{'train' if train else 'test'}.pt"))
        self.data, self.targets, self.transform = blob["data"], list(blob["targets"]), transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        img = self.data[i]
        return (self.transform(img) if self.transform else img), self.targets[i]


datasets = SimpleNamespace(CIFAR10=CIFAR10)


def write_cifar10(root, n_train: int = 64, n_test: int = 20, seed: int = 0) -> None:
    """The tiny CIFAR-shaped data set the cifar10 port reads (every class in the test split, whose accuracy per
    class the script prints; its size a multiple of the script's test batch of 4)."""
    g = torch.Generator().manual_seed(seed)
    os.makedirs(root, exist_ok=True)
    for name, n in (("train", n_train), ("test", n_test)):
        targets = torch.arange(n) % 10
        torch.save(
            {
                "data": torch.randint(0, 256, (n, 32, 32, 3), generator=g, dtype=torch.uint8),
                "targets": targets[torch.randperm(n, generator=g)].tolist(),
            },
            os.path.join(root, f"cifar10_{name}.pt"),
        )


# ---------------------------------------------------------------------------------------------- HelloDeepSpeed
# train_bert_ds.py imports fire, loguru, pytz and sh (not installed here) and downloads wikitext-2 and roberta-base's
# tokenizer. fire.Fire(train) becomes a call of train with the command line's --name value pairs (typed by the
# default's type, as fire reads them); loguru.logger the standard logging; pytz.timezone zoneinfo's; sh.git a
# subprocess call of git; load_dataset the lines of <cwd>/data/wikitext.txt, the test's text; the tokenizer is a
# local directory (the script's own --tokenizer argument) with roberta's special tokens at roberta's ids.

import inspect
import logging
import subprocess


def _fire(fn):
    import sys

    params = inspect.signature(fn).parameters
    kwargs, args = {}, sys.argv[1:]
    while args:
        key = args.pop(0)
        name, _, value = key[2:].partition("=")
        name = name.replace("-", "_")
        if not value:
            value = args.pop(0)
        default = params[name].default
        kind = type(default) if default is not None and default is not inspect.Parameter.empty else str
        kwargs[name] = kind(value) if kind is not bool else value.lower() in ("1", "true")
    return fn(**kwargs)


fire = SimpleNamespace(Fire=_fire)
loguru = SimpleNamespace(logger=logging.getLogger("train_bert_ds"))
logging.basicConfig(level=logging.INFO, format="%(message)s")


def _timezone(name):
    from zoneinfo import ZoneInfo

    return ZoneInfo(name)


pytz = SimpleNamespace(timezone=_timezone)


class _Ran:
    def __init__(self, out: str):
        self.stdout = out.encode()


class _ErrorReturnCode(Exception):
    pass


def _git(cmd):
    def run(*args, **_):
        r = subprocess.run(["git", cmd, *[a for a in args]], capture_output=True, text=True)
        if r.returncode:
            raise {128: sh.ErrorReturnCode_128, 129: sh.ErrorReturnCode_129}.get(r.returncode, _ErrorReturnCode)(
                r.stderr
            )
        return _Ran(r.stdout)

    return run


sh = SimpleNamespace(
    git=SimpleNamespace(log=lambda *a, format=None, **k: _git("log")(*a, f"--format={format}"), diff=_git("diff")),
    ErrorReturnCode_128=type("ErrorReturnCode_128", (_ErrorReturnCode,), {}),
    ErrorReturnCode_129=type("ErrorReturnCode_129", (_ErrorReturnCode,), {}),
)


def load_dataset(path, name=None, split=None):
    """wikitext-2's train split: here the lines of ./data/wikitext.txt, as wikitext has them (each text with its
    newline, an empty line as "")."""
    import datasets

    with open(os.path.join("data", "wikitext.txt")) as f:
        return datasets.Dataset.from_dict({"text": ["" if line == "\n" else line for line in f]})


WORDS = (
    "the of and to in a is was for on as with by he at from his an were are which this that be it or had "
    "first one their its new after but who not they have her she two been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can state "
    "about national out known university united then made"
).split()


def write_wikitext(root, lines: int = 48, seed: int = 0) -> None:
    """A tiny wikitext-like text: sentences of the tokenizer's words, with empty lines between some."""
    g = torch.Generator().manual_seed(seed)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "wikitext.txt"), "w") as f:
        for i in range(lines):
            n = int(torch.randint(6, 20, (1,), generator=g))
            f.write(" ".join(WORDS[int(j)] for j in torch.randint(0, len(WORDS), (n,), generator=g)) + " .\n")
            if i % 5 == 4:
                f.write("\n")


def write_roberta_like_tokenizer(out_dir) -> None:
    """A word-level tokenizer with roberta's special tokens at roberta's ids (<s> 0, <pad> 1, </s> 2, <unk> 3,
    <mask> 4), saved so that AutoTokenizer.from_pretrained(out_dir) loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", "<mask>", ".", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        mask_token="<mask>",
    ).save_pretrained(out_dir)
