"""``deepspeed.runtime.lr_schedules``: DeepSpeed 0.19.8's schedule names and parameter keys, and its five schedule
classes as the types of the scheduler ``initialize`` returns for a config's scheduler block.

::

    from deepspeed.runtime.lr_schedules import WARMUP_LR, WARMUP_NUM_STEPS, WarmupLR
    config["scheduler"] = {"type": WARMUP_LR, "params": {WARMUP_NUM_STEPS: 100}}
    engine, _, _, lr_scheduler = deepspeed.initialize(model=model, config=config)
    isinstance(lr_scheduler, WarmupLR)          # True: the config's WarmupLR, with DeepSpeed's formula

zerofit computes DeepSpeed's schedules itself from the config's block (zerofit.optim.schedules, DeepSpeed's
formulas); the object ``initialize`` returns for one is a view of it (``SchedulerView``: ``get_lr()``,
``get_last_lr()``, ``get_mom()``, ``state_dict()``, ``step()`` a no-op) whose class is DeepSpeed's name for the
schedule. Building one by hand over an optimizer (``WarmupLR(optimizer, ...)``) is refused by name: put the
schedule in the config, or pass a torch scheduler over the client optimizer as ``initialize(lr_scheduler=...)``.
"""

from __future__ import annotations

from zerofit.engine.faces.deepspeed_names import DeepSpeedUnsupported
from zerofit.engine.faces.deepspeed_views import DeepSpeedScheduler

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"

CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"

CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"

CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"

WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"

TOTAL_NUM_STEPS = "total_num_steps"


class _ConfigSchedule(DeepSpeedScheduler):
    """The view of a config's DeepSpeed schedule, under DeepSpeed's class name (built by the engine only)."""

    def __init__(self, *args, **kwargs):
        name = type(self).__name__
        raise DeepSpeedUnsupported(
            f"{name}(optimizer, ...): zerofit applies DeepSpeed's {name} from the config's scheduler block, with "
            f'DeepSpeed\'s formula: put "scheduler": {{"type": "{name}", "params": {{...}}}} in the config '
            "(initialize() then returns this schedule's view), or pass a torch scheduler over your optimizer as "
            "initialize(optimizer=..., lr_scheduler=...)"
        )

    @classmethod
    def _of(cls, hypers, optimizer) -> _ConfigSchedule:
        """The view over the engine's step count and settings (``engine.hypers``) and its optimizer view."""
        view = object.__new__(cls)
        DeepSpeedScheduler.__init__(view, hypers, optimizer)
        return view


class LRRangeTest(_ConfigSchedule):
    """DeepSpeed's LRRangeTest (the config's, a view)."""


class OneCycle(_ConfigSchedule):
    """DeepSpeed's OneCycle (the config's, a view; get_mom() gives its momentum)."""

    def get_mom(self):
        """DeepSpeed's OneCycle.get_mom(): each group's (beta1, beta2) for the next step; None without
        cycle_momentum. Before the first step DeepSpeed's reports its cycle's start, (cycle_max_mom, 0.99), though
        that step applies (cycle_min_mom, 0.99), which its constructor wrote into the optimizer: so does this view,
        and the engine applies what DeepSpeed applies (engine.get_mom() says which)."""
        one_cycle = self._hypers.config.scheduler.one_cycle
        if one_cycle is not None and not one_cycle.cycle_momentum:
            return None
        moms = [(h.beta1, h.beta2) for h in self.optimizer.hypers()]  # engine.get_mom()
        if self._hypers.global_step + self._hypers.skipped_steps == 0 and one_cycle is not None:
            return [(one_cycle.cycle_max_mom, 0.99) for _ in moms]
        return moms


class WarmupLR(_ConfigSchedule):
    """DeepSpeed's WarmupLR (the config's, a view)."""


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR (a WarmupLR, as in DeepSpeed; the config's, a view)."""


class WarmupCosineLR(_ConfigSchedule):
    """DeepSpeed's WarmupCosineLR (the config's, a view)."""


_BY_TYPE = {c.__name__: c for c in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)}


def view_class(schedule_type: str):
    """The class of the view of a config schedule of ``schedule_type`` (zerofit's SchedulerConfig.type), or None
    for zerofit's own schedules (constant, linear, cosine, hf_*)."""
    return _BY_TYPE.get(schedule_type)


def add_tuning_arguments(parser):
    raise DeepSpeedUnsupported(
        "add_tuning_arguments(parser): zerofit's schedules come from the config's scheduler "
        "block (docs/config.md), not from command-line arguments"
    )


def get_config_from_args(args):
    raise DeepSpeedUnsupported("get_config_from_args(args): put the schedule in the config's scheduler block")


def get_lr_from_config(config):
    raise DeepSpeedUnsupported("get_lr_from_config(config): engine.get_lr() gives each group's lr for the next step")
