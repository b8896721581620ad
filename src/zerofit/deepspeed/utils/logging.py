"""``deepspeed.utils.logging``: DeepSpeed 0.19.8's logger and rank-aware log helpers (deepspeed/utils/logging.py).

``logger`` is the ``"DeepSpeed"`` logger as DeepSpeed sets it up: level WARNING, its own handler on stdout
with DeepSpeed's format, not propagated to the root logger (so ``log_dist(..., level=logging.INFO)`` prints
nothing until ``set_log_level_from_string("info")``, as in DeepSpeed). ``log_dist`` prefixes ``[Rank r]``
(``-1`` without a process group) and logs on the ranks asked for, every rank without a group.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys

__all__ = [
    "logger",
    "log_dist",
    "log_dist_once",
    "print_dist",
    "print_json_dist",
    "get_dist_msg",
    "print_configuration",
    "get_log_level_from_string",
    "set_log_level_from_string",
    "get_current_level",
    "should_log_le",
    "warning_once",
    "LoggerFactory",
    "log_levels",
]

log_levels = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class LoggerFactory:
    @staticmethod
    def create_logger(name=None, level=logging.WARNING) -> logging.Logger:
        """DeepSpeed's logger set-up: ``level``, a stdout handler, no propagation (once per name)."""
        if name is None:
            raise ValueError("name for logger cannot be None")
        logger_ = logging.getLogger(name)
        logger_.setLevel(level)
        logger_.propagate = False
        if not logger_.handlers:
            ch = logging.StreamHandler(stream=sys.stdout)
            ch.setLevel(level)
            ch.setFormatter(
                logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s")
            )
            logger_.addHandler(ch)
        return logger_


logger = LoggerFactory.create_logger(name="DeepSpeed", level=logging.WARNING)


@functools.lru_cache(None)
def warning_once(*args, **kwargs) -> None:
    """``logger.warning`` once per distinct arguments."""
    logger.warning(*args, **kwargs)


logger.warning_once = warning_once


def print_configuration(args, name) -> None:
    logger.info(f"{name}:")
    for arg in sorted(vars(args)):
        logger.info("  {} {} {}".format(arg, "." * (29 - len(arg)), getattr(args, arg)))


def _should_log(ranks) -> tuple[bool, int]:
    from zerofit.deepspeed import comm as dist

    initialized = dist.is_initialized()
    my_rank = dist.get_rank() if initialized else -1
    ranks = ranks or []
    should = not initialized or (bool(ranks) and (ranks[0] == -1 or my_rank in set(ranks)))
    return should, my_rank


def get_dist_msg(message, ranks=None):
    """``"[Rank r] message"`` when it should be logged on this rank, else None (DeepSpeed's rule)."""
    should, my_rank = _should_log(ranks)
    return f"[Rank {my_rank}] {message}" if should else None


def log_dist(message, ranks=None, level=logging.INFO) -> None:
    final = get_dist_msg(message, ranks)
    if final is not None:
        logger.log(level, final)


def print_dist(message, ranks=None) -> None:
    final = get_dist_msg(message, ranks)
    if final is not None:
        print(final)


@functools.lru_cache(None)
def _log_dist_once_cached(message, ranks_key, level) -> None:
    log_dist(message, ranks=list(ranks_key) if ranks_key is not None else None, level=level)


def log_dist_once(message, ranks=None, level=logging.INFO) -> None:
    _log_dist_once_cached(message, tuple(ranks) if ranks is not None else None, level)


logger.log_dist_once = log_dist_once


def print_json_dist(message, ranks=None, path=None) -> None:
    should, my_rank = _should_log(ranks)
    if should:
        message["rank"] = my_rank
        with open(path, "w") as outfile:
            json.dump(message, outfile)
            outfile.flush()
            os.fsync(outfile.fileno())


def get_log_level_from_string(log_level_str: str) -> int:
    key = log_level_str.lower()
    if key not in log_levels:
        raise ValueError(
            f"{log_level_str} is not one of the valid logging levels. Valid log levels are {log_levels.keys()}."
        )
    return log_levels[key]


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str) -> bool:
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"{max_log_level_str} is not a string")
    return get_current_level() <= get_log_level_from_string(max_log_level_str)
