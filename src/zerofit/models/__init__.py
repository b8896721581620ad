"""Models from local Hugging Face directories: config, safetensors weights and tokenizer files.

See :mod:`zerofit.models.directory` (the directory) and :mod:`zerofit.models.safetensors` (tensor reads).
"""

from zerofit.models.directory import TOKENIZER_FILES, ModelDir, ModelDirError
from zerofit.models.safetensors import WeightFileError

__all__ = ["ModelDir", "ModelDirError", "WeightFileError", "TOKENIZER_FILES"]
