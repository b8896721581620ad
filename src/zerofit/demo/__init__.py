"""The embedded default that ``zerofit train`` and ``make demo`` run: no download of any kind.

- :mod:`~zerofit.demo.tokenizer`: bytes are tokens (256 + BOS/EOS);
- :mod:`~zerofit.demo.corpus`: Python's own standard-library source as text, random windows;
- :mod:`~zerofit.demo.model`: a ~3 M-parameter Hugging Face Llama, sampling, held-out loss;
- :mod:`~zerofit.demo.run`: the training run through ``zerofit.initialize``;
- :mod:`~zerofit.demo.report`: how the run reads on the terminal.
"""

from zerofit.demo.corpus import Corpus, load_corpus, micro_batches
from zerofit.demo.model import build_model, sample
from zerofit.demo.run import DemoOptions, DemoResult, run_demo
from zerofit.demo.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Corpus", "DemoOptions", "DemoResult", "build_model", "load_corpus",
           "micro_batches", "run_demo", "sample"]
