"""The DeepSpeed engine's names zerofit does not have, and what to do instead (a table, no state).

Every name of DeepSpeed's engine (deepspeed/runtime/engine.py, read at commit 38327e07f6cd39b63418f60cedd1651b0be3e7c3)
that zerofit's engine does not provide raises :class:`UnsupportedAttribute` naming it and what to do instead;
nothing is silently ignored. The table of names and their status is docs/migration.md.
"""

from __future__ import annotations

from zerofit.errors import InputError


class DeepSpeedUnsupported(InputError, NotImplementedError):
    """A DeepSpeed feature, argument or call zerofit does not provide; the message names it and says what to do."""


class UnsupportedAttribute(DeepSpeedUnsupported, AttributeError):
    """A DeepSpeed attribute zerofit does not provide (an ``AttributeError`` too, so ``hasattr`` is False)."""


class DeepSpeedAssertion(DeepSpeedUnsupported, ValueError, AssertionError):
    """A call DeepSpeed refuses with an ``assert`` (an ``AssertionError`` there, which its callers and tests catch):
    zerofit refuses it too, with a message that says what to do."""


# ---------------------------------------------------------------------------------------------- refusals

# what the DeepSpeed door does with several processes; the engine itself trains on several GPUs (ranks.py)
ONE_PROCESS = (
    "zerofit.deepspeed runs one process (one GPU, or the CPU); several GPUs of one host train with "
    "zerofit.initialize (or zerofit.hf.Trainer) in a script launched by torchrun --nproc-per-node N, "
    "or with zerofit train --gpus N (docs/ranks.md)"
)
_CONFIG_GETTER = (
    "a DeepSpeed config getter; zerofit's resolved configuration is engine.config (a ZerofitConfig; "
    "`zerofit config show ds_config.json` shows how each DeepSpeed key was read)"
)
_NO_ZERO = (
    "zerofit has no ZeRO stages: it streams whole blocks through the GPU (engine.plan says what stays "
    "where) and its resolved configuration is engine.config"
)
_HINTS = {
    "save_16bit_model": "use engine.save_pretrained(out_dir, dtype='bf16' or 'fp16'): a Hugging Face model "
    "directory of safetensors, streamed block by block",
    "save_fp16_model": "use engine.save_pretrained(out_dir, dtype='fp16')",
    "module_state_dict": "use engine.module.state_dict() (the model with its current fp32 weights, on the host)",
    "load_module_state_dict": "load weights with engine.load_checkpoint(dir), or into the model before "
    "zerofit.deepspeed.initialize",
    "load_moe_state_dict": "zerofit has no mixture-of-experts layers of its own",
    "set_train_batch_size": "set train_batch_size / gradient_accumulation_steps in the config",
    "set_train_micro_batch_size": "set train_micro_batch_size_per_gpu in the config",
    "no_sync": ONE_PROCESS + " (there is no gradient all-reduce to skip)",
    "compile": "zerofit runs the model's own forward per block; torch.compile the model's blocks yourself",
    "is_compiled": "zerofit does not compile the model",
    "clip_fp32_gradients": "set gradient_clipping in the config: zerofit clips by the global norm in step()",
    "load_universal_checkpoint": "engine.load_checkpoint(dir) reads zerofit's checkpoints under any placement, and "
    "DeepSpeed's (ZeRO stages 1-3 and the universal layout) too",
    "get_pld_theta": "progressive layer drop is not implemented",
    "print_forward_breakdown": "see engine.timeline() and engine.trace()",
    "get_data_types": "zerofit computes in config.precision with fp32 master weights and gradients",
    "get_sequence_parallel_group": ONE_PROCESS,
    "set_data_post_process_func": "data efficiency is not implemented",
    "set_custom_curriculum_learning_schedule": "curriculum learning is not implemented",
    "random_ltd_initialize": "random layer-token drop is not implemented",
    "basic_optimizer": "zerofit's AdamW is its own; engine.optimizer is a view of its settings",
    "client_optimizer": "zerofit's AdamW is its own; engine.optimizer is a view of its settings",
    "client_lr_scheduler": "engine.lr_scheduler is the client's scheduler itself when initialize() was given one",
    "timers": "see engine.timeline() and engine.trace()",
    "monitor": "zerofit logs to its own timeline (engine.timeline())",
    "losses": "engine(**batch).loss is each micro-batch's loss",
    "mpu": ONE_PROCESS,
    "mesh_device": ONE_PROCESS,
    "checkpoint_engine": "zerofit's checkpoints are written by zerofit.checkpoint (engine.save_checkpoint)",
    "flops_profiler": "see engine.timeline() and engine.trace()",
}
_COMMUNICATION = {
    "allreduce_gradients",
    "allreduce_bucket",
    "allreduce_and_copy",
    "allreduce_no_retain",
    "buffered_allreduce_fallback",
    "sparse_allreduce",
    "sparse_allreduce_bucket",
    "sparse_allreduce_no_retain",
    "sparse_all_gather",
    "all_gather_scalar",
    "data_parallel_group",
    "seq_data_parallel_group",
    "seq_parallel_group",
    "expert_parallel_group",
    "expert_data_parallel_group",
    "all_to_all_group",
    "local_all_to_all_group",
    "mp_world_size",
    "seq_dp_world_size",
    "sequence_parallel_size",
    "dist_backend",
    "use_ds_comm",
    "enable_backward_allreduce",
    "inside_no_sync_ctxt",
    "gradient_average",
    "communication_data_type",
}
_CONFIG_GETTERS = {
    "aio_config",
    "amp_enabled",
    "amp_params",
    "autotp_size",
    "autotuning_enabled",
    "autotuning_end_profile_step",
    "autotuning_metric",
    "autotuning_metric_path",
    "autotuning_model_info_path",
    "autotuning_profile_model_info",
    "autotuning_start_profile_step",
    "checkpoint_tag_validation_enabled",
    "checkpoint_tag_validation_fail",
    "curriculum_enabled_legacy",
    "curriculum_learning_config",
    "curriculum_learning_enabled",
    "curriculum_params_legacy",
    "data_efficiency_config",
    "data_efficiency_enabled",
    "data_sampling_config",
    "data_sampling_enabled",
    "dataloader_drop_last",
    "dump_state",
    "dynamic_loss_scale",
    "dynamic_loss_scale_args",
    "eigenvalue_enabled",
    "eigenvalue_gas_boundary_resolution",
    "eigenvalue_layer_name",
    "eigenvalue_layer_num",
    "eigenvalue_max_iter",
    "eigenvalue_stability",
    "eigenvalue_tol",
    "eigenvalue_verbose",
    "elasticity_enabled",
    "is_elastic_model_parallel_supported",
    "flops_profiler_detailed",
    "flops_profiler_enabled",
    "flops_profiler_module_depth",
    "flops_profiler_output_file",
    "flops_profiler_profile_step",
    "flops_profiler_recompute_fwd_factor",
    "flops_profiler_top_modules",
    "fp16_auto_cast",
    "fp16_master_weights_and_gradients",
    "gradient_predivide_factor",
    "graph_harvesting",
    "initial_dynamic_scale",
    "loss_scale",
    "memory_breakdown",
    "optimizer_legacy_fusion",
    "optimizer_name",
    "optimizer_params",
    "pld_enabled",
    "pld_gamma",
    "pld_params",
    "pld_theta",
    "postscale_gradients",
    "quantize_training",
    "random_ltd_config",
    "random_ltd_enabled",
    "scheduler_name",
    "scheduler_params",
    "sparse_gradients_enabled",
    "swap_tensor_config",
    "use_node_local_storage",
    "get_batch_info",
}
_ZERO = {
    "is_first_weights_partition_group",
    "mics_shard_size",
    "zero_grad_hooks",
    "save_zero_checkpoint",
    "save_non_zero_checkpoint",
}
_OTHER_STATE = {
    "autotuning_model_info",
    "block_eigenvalue",
    "collate_fn",
    "compression_scheduler",
    "curriculum_scheduler_legacy",
    "dont_change_device",
    "eigenvalue",
    "engine_timers",
    "first_dataloader_check",
    "flatten",
    "flops",
    "fwd_duration",
    "gas_boundary_ctr",
    "gate_modules",
    "has_moe_layers",
    "loaded_checkpoint_dp_world_size",
    "loaded_checkpoint_mp_world_size",
    "moe_layers",
    "num_experts",
    "optimized_linear_base_weight_sharding",
    "optimized_linear_lora_enabled",
    "param_names",
    "pipeline_parallelism",
    "progressive_layer_drop",
    "quantizer",
    "random_ltd_scheduler",
    "scale_wrt_gas",
    "sparse_tensor_module_names",
    "summary_events",
    "training_data",
    "unflatten",
    "warn_unscaled_loss",
    "get_type",
    "is_map_style_dataset",
    "is_iterable_style_dataset",
}


def deepspeed_hint(name: str) -> str | None:
    """What to do instead of DeepSpeed engine attribute ``name``; None if DeepSpeed's engine has no such name."""
    if name in _HINTS:
        return _HINTS[name]
    if name in _COMMUNICATION:
        return ONE_PROCESS
    if name in _CONFIG_GETTERS:
        return _CONFIG_GETTER
    if name in _ZERO or name.startswith(("zero_", "zeropp_")):
        return _NO_ZERO
    if name in _OTHER_STATE:
        return "DeepSpeed engine internals with no counterpart in zerofit"
    return None


def refuse_attribute(owner: str, name: str, hint: str) -> UnsupportedAttribute:
    return UnsupportedAttribute(f"zerofit's DeepSpeed {owner} has no {name}: {hint}")
