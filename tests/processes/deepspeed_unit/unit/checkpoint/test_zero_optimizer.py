import zerofit.deepspeed.alias  # the one change: `deepspeed` is zerofit's from here on
# Ported from DeepSpeed's tests/unit/checkpoint/test_zero_optimizer.py (github.com/deepspeedai/DeepSpeed at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641,
# Apache-2.0, DeepSpeed Team). Test bodies as written; besides the line above:
# - kept: TestZeROSaveLoadEdgeCase (one rank suffices; world_size 2 as written, the stand-in runs one), some stages.
#   Its cases are xfail(strict): _NO_LR_STATES. test_save_before_accum_grad_is_done is left out: its batch triple
#   (4 = 1 x 2 x world size) needs 2 ranks.
# - left out: TestZeROCheckpoint, TestZeROElasticCheckpoint and the ws4 fixtures (2 to 4 ranks, DeepSpeed's
#   partitioned optimizer files), TestZeROCheckpointFrozenWeights and TestSaveTensorClone (they read DeepSpeed's
#   checkpoint files, mp_rank_00_model_states.pt: zerofit writes its own format; DeepSpeed-format loading is
#   another helper's), TestZeRONonDistributed (DeepSpeed's checkpoint engine's chmod), TestZeROPPLoadCheckpoint,
#   test_elastic_checkpoint_is_deprecated_for_zero3; and the imports only they use (deepspeed.ops.op_builder,
#   deepspeed.checkpoint.utils, deepspeed.runtime.zero.config, DistributedFixture).
# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import deepspeed
from types import SimpleNamespace
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero import ZeroParamStatus
from deepspeed.utils.torch import required_torch_version

from unit.common import DistributedTest
from unit.simple_model import *

from unit.checkpoint.common import *

import pytest


from zerofit.engine.faces.deepspeed_surface import DeepSpeedAssertion, DeepSpeedUnsupported, UnsupportedAttribute  # port: xfail marks
_NO_LR_STATES = pytest.mark.xfail(strict=True, raises=DeepSpeedUnsupported, reason="load_checkpoint(load_lr_scheduler_states=False) is refused: "
                                  "zerofit's lr schedule is a function of the restored step count")


class TestZeROSaveLoadEdgeCase(DistributedTest):
    world_size = 2

    @_NO_LR_STATES
    @pytest.mark.parametrize('zero_stage', [0, 2])  # port: 1, 3 the same calls
    def test_immediate_save_load(self, tmpdir, zero_stage):
        config_dict = {
            "train_batch_size": 4,
            "optimizer": {
                "type": 'Adam'
            },
            "zero_optimization": {
                "stage": zero_stage,
            }
        }
        if get_accelerator().is_bf16_supported():
            config_dict["bf16"] = {"enabled": True}
        elif get_accelerator().is_fp16_supported():
            config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}
        hidden_dim = 10
        model = SimpleModel(hidden_dim)

        ds_model = create_deepspeed_model(config_dict=config_dict, model=model, base_optimizer=None)
        ds_model.save_checkpoint(tmpdir)
        ds_model.load_checkpoint(tmpdir,
                                 load_optimizer_states=False,
                                 load_lr_scheduler_states=False,
                                 load_module_only=False)

    @_NO_LR_STATES
    @pytest.mark.parametrize('zero_stage', [2])  # port: 0 DeepSpeed skips on the CPU; 1, 3 the same calls
    def test_load_immediate_save(self, tmpdir, zero_stage):
        if zero_stage == 0 and get_accelerator().device_name() == "cpu":
            pytest.skip("CPU Accelerator does not support this test")
        config_dict = {
            "train_batch_size": 4,
            "optimizer": {
                "type": 'Adam'
            },
            "zero_optimization": {
                "stage": zero_stage,
            }
        }
        if get_accelerator().is_bf16_supported():
            config_dict["bf16"] = {"enabled": True}
        elif get_accelerator().is_fp16_supported():
            config_dict["fp16"] = {"enabled": True, "initial_scale_power": 8}
        hidden_dim = 10
        model = SimpleModel(hidden_dim)

        # 1. pretrain a model and save it
        ds_model = create_deepspeed_model(config_dict=config_dict, model=model, base_optimizer=None)
        data_loader = random_dataloader(model=ds_model, total_samples=1, hidden_dim=hidden_dim, device=ds_model.device)
        for _, batch in enumerate(data_loader):
            loss = ds_model(batch[0], batch[1])
            ds_model.backward(loss)
            ds_model.step()

        ds_model.empty_partition_cache()
        ds_model.save_checkpoint(tmpdir)

        # 2. load and immediately save a model with a fresh ds engine
        ds_model = create_deepspeed_model(config_dict=config_dict, model=model, base_optimizer=None)
        ds_model.load_checkpoint(tmpdir,
                                 load_optimizer_states=False,
                                 load_lr_scheduler_states=False,
                                 load_module_only=False)
        ds_model.save_checkpoint(tmpdir)
