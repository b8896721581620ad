import zerofit.deepspeed.alias  # the one change: `deepspeed` is zerofit's from here on
# Ported from DeepSpeed's tests/unit/checkpoint/test_tag_validation.py (github.com/deepspeedai/DeepSpeed at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641,
# Apache-2.0, DeepSpeed Team). Test bodies as written; besides the line above:
# - left out: test_checkpoint_unique_tag (its tags differ by rank: it needs 2 ranks).
# - the other cases keep world_size 2 as written; they need no second rank (the stand-in DistributedTest runs one).
# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import deepspeed

from unit.common import DistributedTest
from unit.simple_model import *

import pytest


class TestCheckpointValidationTag(DistributedTest):
    world_size = 2

    def test_checkpoint_unknown_tag_validation(self, tmpdir):

        config_dict = {
            "train_batch_size": 2,
            "steps_per_print": 1,
            "optimizer": {
                "type": "Adam",
                "params": {
                    "lr": 0.00015
                }
            },
            "checkpoint": {
                "tag_validation": "foo"
            }
        }
        hidden_dim = 10
        args = args_from_dict(tmpdir, config_dict)
        model = SimpleModel(hidden_dim)

        with pytest.raises(deepspeed.DeepSpeedConfigError):
            model, _, _, _ = deepspeed.initialize(config=config_dict, model=model, model_parameters=model.parameters())


class TestSaveCheckpointInvalidDir(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize('save_dir', [None, ""])
    def test_save_checkpoint_empty_dir(self, save_dir):
        config_dict = {
            "train_batch_size": 2,
            "steps_per_print": 1,
            "optimizer": {
                "type": "Adam",
                "params": {
                    "lr": 0.00015
                }
            }
        }
        hidden_dim = 10
        model = SimpleModel(hidden_dim)

        model, _, _, _ = deepspeed.initialize(config=config_dict, model=model, model_parameters=model.parameters())
        with pytest.raises(ValueError):
            model.save_checkpoint(save_dir=save_dir)
