"""zerofit doctor: each measurement on its own, small and fast; failures reported, not raised."""

from __future__ import annotations

import errno
import json
import os
from collections import namedtuple

import pytest
import torch

from zerofit.cli import doctor
from zerofit.cli.doctor import MiB

SMALL = dict(copy_bytes=16 * MiB, optimizer_params=1 * MiB, disk_bytes=16 * MiB)
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@no_gpu
def test_without_a_gpu_the_rest_is_measured(tmp_path):
    report = doctor.run_doctor(tmp_path, **SMALL)
    assert not report.gpu.available and report.gpu.reason
    assert report.copies == []
    assert report.errors == {}
    assert report.host.total_bytes >= report.host.available_bytes > 0
    assert report.optimizer.params_per_s > 0 and report.optimizer.threads == torch.get_num_threads()
    d = report.disk
    assert d.bytes_tested == 16 * MiB and d.write_gb_per_s > 0 and d.read_gb_per_s > 0
    assert d.free_bytes > 0 and d.path == str(tmp_path.resolve())
    assert d.tier_write_gb_per_s > 0 and d.tier_read_gb_per_s > 0  # the disk tier's own path, measured too
    assert list(tmp_path.iterdir()) == []  # the scratch files are gone
    json.dumps(report.to_dict())  # --json needs plain data


def test_disk_falls_back_when_o_direct_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(doctor.os, "open", no_direct)
    d = doctor.disk_speed(tmp_path, nbytes=8 * MiB)
    assert not d.direct_io and "O_DIRECT" in d.note
    assert d.bytes_tested == 8 * MiB and d.read_gb_per_s > 0
    assert list(tmp_path.iterdir()) == []


def test_disk_test_shrinks_or_skips_when_space_is_short(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda p: usage(100 * MiB, 90 * MiB, 10 * MiB))
    d = doctor.disk_speed(tmp_path, nbytes=8 * MiB)
    assert d.bytes_tested == 0 and "skipped" in d.note
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda p: usage(100 * MiB, 60 * MiB, 40 * MiB))
    assert doctor.disk_speed(tmp_path, nbytes=64 * MiB).bytes_tested == 20 * MiB


def test_disk_path_must_be_a_folder(tmp_path):
    with pytest.raises(NotADirectoryError):
        doctor.disk_speed(tmp_path / "missing")


def test_a_failing_measurement_is_reported_and_the_rest_run(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no fused AdamW today")

    monkeypatch.setattr(doctor, "optimizer_speed", broken)
    report = doctor.run_doctor(tmp_path, **SMALL)
    assert report.optimizer is None
    failed = "RuntimeError: no fused AdamW today"  # with a GPU, its rate while copies run failed as well
    assert report.errors == {"optimizer": failed} | (
        {"optimizer while copying": failed} if report.gpu.available else {}
    )
    assert report.optimizer_copying is None
    assert report.disk.bytes_tested > 0 and report.host is not None


def test_optimizer_speed_counts_params_and_steps():
    o = doctor.optimizer_speed(params=1 * MiB, time_limit_s=1.0)
    assert o.params == 1 * MiB and 1 <= o.steps <= 5
    assert o.implementation in ("fused", "foreach") and o.params_per_s > 0


@gpu
def test_copy_bandwidth_on_a_gpu():
    copies = doctor.copy_bandwidth(nbytes=16 * MiB, repeats=2)
    assert {(c.direction, c.host_memory) for c in copies} == {
        ("host->gpu", "pinned"),
        ("gpu->host", "pinned"),
        ("host->gpu", "pageable"),
        ("gpu->host", "pageable"),
        ("both", "pinned"),
    }
    assert all(c.gb_per_s > 0 for c in copies)
    rate = {(c.direction, c.host_memory): c.gb_per_s for c in copies}
    # each way, both at once, is no faster than that way alone, and together they move more than one way alone
    assert rate[("both", "pinned")] <= 1.05 * max(rate[("host->gpu", "pinned")], rate[("gpu->host", "pinned")])
    assert 2 * rate[("both", "pinned")] > min(rate[("host->gpu", "pinned")], rate[("gpu->host", "pinned")])
    busy = doctor.optimizer_speed(params=4 * MiB, time_limit_s=1.0, while_copying=True)
    assert busy.while_copying and busy.params_per_s > 0
    info = doctor.gpu_info()
    assert info.available and info.memory_total_bytes >= info.memory_free_bytes > 0 and info.name
