"""``zerofit doctor``: measure this machine's limits before choosing an offload plan.

    zerofit doctor --disk /mnt/nvme

Every figure the planner's arithmetic depends on (where the time of one
optimizer step goes): GPU memory, host<->GPU copy bandwidth pinned
and pageable, the CPU optimizer's speed, host RAM, and the disk that would hold
an NVMe tier. Each measurement is bounded in time (the whole run takes well
under 30 s) and fails on its own: an error in one is reported in its place and
the others still run.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch

MiB = 1 << 20
GiB = 1 << 30


@dataclass
class GpuInfo:
    """The first CUDA device (``cuda:0``), or why there is none."""

    available: bool
    reason: str = ""  # why there is no GPU, when ``available`` is false
    name: str = ""
    count: int = 0  # CUDA devices visible to this process
    driver_version: str = ""  # from nvidia-smi when present, else the CUDA driver API version
    cuda_runtime: str = ""  # torch.version.cuda: the CUDA this torch was built against
    capability: str = ""  # compute capability, e.g. "9.0"
    memory_total_bytes: int = 0
    memory_free_bytes: int = 0


@dataclass
class CopyBandwidth:
    """One host<->GPU copy measurement."""

    direction: str  # "host->gpu", "gpu->host", or "both" (both at once on two streams: each way's rate)
    host_memory: str  # "pinned" or "pageable"
    bytes_per_copy: int
    repeats: int
    gb_per_s: float  # best of ``repeats``, 1e9 bytes per second


@dataclass
class OptimizerSpeed:
    """``torch.optim.AdamW`` stepping fp32 parameters on the CPU."""

    implementation: str  # "fused" or "foreach" (when fused is not available)
    params: int
    steps: int
    threads: int  # torch.get_num_threads()
    params_per_s: float  # best of ``steps``
    while_copying: bool = False  # measured while pinned copies ran both ways (as in a training step)


@dataclass
class HostMemory:
    total_bytes: int
    available_bytes: int
    cpu_cores: int  # logical CPUs
    torch_threads: int


@dataclass
class DiskSpeed:
    """Sequential 1 MiB writes (with fsync) and reads of a scratch file under ``path``."""

    path: str
    total_bytes: int
    free_bytes: int
    bytes_tested: int = 0
    direct_io: bool = False  # O_DIRECT used (page cache bypassed); else buffered + fsync + fadvise
    write_gb_per_s: float = 0.0
    read_gb_per_s: float = 0.0
    note: str = ""
    tier_write_gb_per_s: float = 0.0  # the disk tier's own path: parallel direct requests (engine/disk/tier.py)
    tier_read_gb_per_s: float = 0.0


@dataclass
class DoctorReport:
    """Everything ``zerofit doctor`` measured; ``errors`` names each measurement that failed and why."""

    torch_version: str
    python_version: str
    platform: str
    gpu: GpuInfo
    host: HostMemory | None = None
    copies: list[CopyBandwidth] = field(default_factory=list)
    optimizer: OptimizerSpeed | None = None
    optimizer_copying: OptimizerSpeed | None = None  # the same while copies run both ways (a GPU here)
    disk: DiskSpeed | None = None
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the whole run

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- GPU


def gpu_info() -> GpuInfo:
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            reason = f"this torch ({torch.__version__}) is a CPU-only build"
        else:
            reason = f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable CUDA device"
        return GpuInfo(available=False, reason=reason)
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    return GpuInfo(
        available=True,
        name=props.name,
        count=torch.cuda.device_count(),
        driver_version=_driver_version(),
        cuda_runtime=str(torch.version.cuda),
        capability=f"{props.major}.{props.minor}",
        memory_total_bytes=int(total),
        memory_free_bytes=int(free),
    )


def _driver_version() -> str:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=5
            )
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    try:  # the CUDA driver API version, e.g. 12040 -> "CUDA driver API 12.4"
        v = int(torch._C._cuda_getDriverVersion())
        return f"CUDA driver API {v // 1000}.{(v % 1000) // 10}"
    except Exception:  # a private API: absent is not an error worth reporting
        return "unknown"


def copy_bandwidth(nbytes: int = 256 * MiB, repeats: int = 3) -> list[CopyBandwidth]:
    """Host->GPU and GPU->host copies of ``nbytes``, from pinned and from pageable host memory.

    Timed with CUDA events on the current stream; the best of ``repeats`` after one warm-up copy.
    """
    dev = torch.device("cuda", 0)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    results = []
    for host_memory in ("pinned", "pageable"):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=(host_memory == "pinned"))
        host.fill_(1)  # touch every page: a first-touch fault is not a copy
        for direction in ("host->gpu", "gpu->host"):
            src, dst = (host, gpu) if direction == "host->gpu" else (gpu, host)
            best = float("inf")
            for i in range(repeats + 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=(host_memory == "pinned"))
                end.record()
                end.synchronize()  # waits for this copy only, not for the whole device
                if i > 0:  # the first copy is a warm-up
                    best = min(best, start.elapsed_time(end) / 1000.0)
            results.append(CopyBandwidth(direction, host_memory, nbytes, repeats, nbytes / best / 1e9))
        del host
    results.append(_duplex(gpu, nbytes, repeats))
    del gpu
    torch.cuda.empty_cache()
    return results


def _duplex(gpu: torch.Tensor, nbytes: int, repeats: int) -> CopyBandwidth:
    """Each way's rate while pinned copies run up and down at once on two streams: the copies of a training
    step overlap, and both ways together carry less than twice what one way alone does."""
    half = nbytes // 2
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    best = float("inf")
    for i in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for stream, dst, src in ((up, gpu[:half], host[:half]), (down, host[half : 2 * half], gpu[half : 2 * half])):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            torch.cuda.current_stream().wait_stream(stream)
        end.record()
        end.synchronize()
        if i > 0:
            best = min(best, start.elapsed_time(end) / 1000.0)
    return CopyBandwidth("both", "pinned", half, repeats, half / best / 1e9)


class BackgroundCopies:
    """Pinned copies up and down in a loop on their own streams, from a thread, until the block ends."""

    def __init__(self, nbytes: int = 256 * MiB):
        self.nbytes, self._stop = nbytes, threading.Event()

    def __enter__(self):
        dev = torch.device("cuda", 0)
        gpu = torch.empty(2, self.nbytes, dtype=torch.uint8, device=dev)
        host = torch.empty(2, self.nbytes, dtype=torch.uint8, pin_memory=True)
        host.fill_(1)

        def loop():
            streams = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
            while not self._stop.is_set():
                done = []
                for s, dst, src in zip(streams, (gpu[0], host[1]), (host[0], gpu[1])):
                    with torch.cuda.stream(s):
                        dst.copy_(src, non_blocking=True)
                    done.append(torch.cuda.Event(blocking=True))  # a blocking wait: a spinning thread
                    done[-1].record(s)  # would take a core from the optimizer
                for ev in done:
                    ev.synchronize()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- CPU optimizer


def optimizer_speed(params: int = 16 * MiB, time_limit_s: float = 5.0, while_copying: bool = False) -> OptimizerSpeed:
    """Steps of ``torch.optim.AdamW`` over ``params`` fp32 parameters (4 tensors) on the CPU.

    Fused AdamW when this torch has it on the CPU, else ``foreach``. One warm-up
    step (it allocates the moments), then the best of up to 5 timed steps within ``time_limit_s``.
    ``while_copying`` (a GPU here): with pinned copies running both ways meanwhile, as in a training step,
    where they share the host's memory bandwidth with it (about a quarter slower than alone on the benchmark
    machine); the median of up to 9 steps.
    """
    if while_copying:  # the median of more steps: the best one could fall in a gap between the copies
        with BackgroundCopies():
            speed = _optimizer_speed(params, time_limit_s, steps=9, pick=statistics.median)
        return dataclasses.replace(speed, while_copying=True)
    return _optimizer_speed(params, time_limit_s, steps=5, pick=min)


def _optimizer_speed(params: int, time_limit_s: float, steps: int, pick) -> OptimizerSpeed:
    chunk = params // 4
    tensors = [torch.nn.Parameter(torch.randn(chunk)) for _ in range(4)]
    for t in tensors:
        t.grad = torch.randn(chunk) * 1e-3
    try:
        opt, impl = torch.optim.AdamW(tensors, lr=1e-3, fused=True), "fused"
        opt.step()
    except (RuntimeError, TypeError, ValueError):
        opt, impl = torch.optim.AdamW(tensors, lr=1e-3, foreach=True), "foreach"
        opt.step()
    times = timed_steps(opt.step, time_limit_s, steps)
    return OptimizerSpeed(impl, chunk * 4, len(times), torch.get_num_threads(), chunk * 4 / pick(times))


def timed_steps(step, time_limit_s: float, steps: int) -> list[float]:
    """Seconds of up to ``steps`` calls of ``step()`` (at least one) within ``time_limit_s``."""
    times: list[float] = []
    deadline = time.perf_counter() + time_limit_s
    while len(times) < steps and (not times or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def master_pass_speed(params: int = 64 * MiB, time_limit_s: float = 5.0, cast: torch.dtype | None = None) -> float:
    """Parameters per second of the two-pass AdamW's first pass (engine/update/split_adamw.py, [Note: moments after
    the forward]; with ``cast``, the pass that writes only the new weights cast to that 16-bit dtype: [Note: the
    master behind its cast]) while pinned copies run both ways, as optimizer_speed(while_copying=True)
    measures the fused kernel: one warm-up, then the median of up to 9 steps."""
    from zerofit.engine.update import split_adamw
    from zerofit.optim.hyper import Hyper

    p, g, m, v = (torch.randn(params) for _ in range(4))
    out16 = None if cast is None else torch.empty(params, dtype=cast)
    h = Hyper(1e-4, 0.9, 0.999, 1e-8, 0.01)
    step = lambda: split_adamw.master_pass(p, g, m, v, torch.tensor(0.0), h, 0.5, out16=out16)  # noqa: E731
    step()
    with BackgroundCopies():
        times = timed_steps(step, time_limit_s, 9)
    return params / statistics.median(times)


# ---------------------------------------------------------------- host


def host_memory() -> HostMemory:
    vm = psutil.virtual_memory()
    return HostMemory(int(vm.total), int(vm.available), os.cpu_count() or 1, torch.get_num_threads())


# ---------------------------------------------------------------- disk


def disk_speed(path: str | Path = ".", nbytes: int = 256 * MiB, time_limit_s: float = 8.0) -> DiskSpeed:
    """Write ``nbytes`` in 1 MiB chunks then fsync, read them back, delete the file.

    O_DIRECT is tried first (the page cache would otherwise make the read a memory
    copy); where the file system refuses it (tmpfs, some overlays) the test falls
    back to buffered I/O and drops the written pages with ``posix_fadvise`` before
    reading. Writing stops early at ``time_limit_s / 2``; the figures then use the
    bytes actually moved. Less than 2x ``nbytes`` free shrinks the test (to half the
    free space), and skips it below 16 MiB.
    """
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise NotADirectoryError(f"--disk {path}: not a folder")
    usage = shutil.disk_usage(folder)
    result = DiskSpeed(str(folder), int(usage.total), int(usage.free))
    wanted, nbytes = nbytes, min(nbytes, (usage.free // 2) // MiB * MiB)
    if nbytes < min(wanted, 16 * MiB):
        result.note = f"skipped: only {usage.free / MiB:.0f} MiB free"
        return result
    buf = mmap.mmap(-1, MiB)  # page-aligned, as O_DIRECT requires
    buf.write(os.urandom(MiB))
    fd, name = tempfile.mkstemp(prefix=".zerofit-doctor-", dir=folder)
    os.close(fd)
    try:
        fd, direct = _open(name, os.O_WRONLY | os.O_TRUNC)
        written = 0
        t0 = time.perf_counter()
        try:
            while written < nbytes and time.perf_counter() - t0 < time_limit_s / 2:
                written += os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = time.perf_counter() - t0

        if not direct and hasattr(os, "posix_fadvise"):
            fd = os.open(name, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages after fsync: dropped
            os.close(fd)
        fd, _ = _open(name, os.O_RDONLY, direct=direct)
        read = 0
        t0 = time.perf_counter()
        try:
            while read < written:
                n = os.readv(fd, [buf])
                if n <= 0:
                    break
                read += n
        finally:
            os.close(fd)
        read_s = time.perf_counter() - t0
    finally:
        buf.close()
        os.unlink(name)
    result.bytes_tested = written
    result.direct_io = direct
    result.write_gb_per_s = written / write_s / 1e9
    result.read_gb_per_s = read / read_s / 1e9 if read_s > 0 else 0.0
    if not direct:
        result.note = "O_DIRECT not supported here: buffered I/O, page cache dropped before reading"
    return result


def _tier_speed(d: DiskSpeed, folder, nbytes: int) -> None:
    """The disk tier's own write and read speed under ``folder`` (what it streams at: 8 direct requests of 4
    MiB in flight, ``zerofit estimate`` uses the same), into ``d``."""
    from zerofit.engine.disk.tier import measure_folder

    d.tier_write_gb_per_s, d.tier_read_gb_per_s = measure_folder(folder, nbytes)


def _open(name: str, flags: int, direct: bool = True) -> tuple[int, bool]:
    """Open with O_DIRECT when asked and supported; report whether it was used."""
    o_direct = getattr(os, "O_DIRECT", 0)
    if direct and o_direct:
        try:
            return os.open(name, flags | o_direct), True
        except OSError:  # EINVAL: this file system does not do direct I/O
            pass
    return os.open(name, flags), False


# ---------------------------------------------------------------- all together


def run_doctor(
    disk: str | Path = ".",
    *,
    copy_bytes: int = 256 * MiB,
    optimizer_params: int = 16 * MiB,
    disk_bytes: int = 256 * MiB,
) -> DoctorReport:
    """Measure everything; a measurement that fails records its error and the rest still run."""
    t0 = time.perf_counter()
    report = DoctorReport(
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        platform=platform.platform(),
        gpu=GpuInfo(available=False),
    )

    def attempt(name: str, fn: Callable[[], object]) -> object | None:
        try:
            return fn()
        except Exception as e:  # a broken measurement is a finding, not a crash
            report.errors[name] = f"{type(e).__name__}: {e}"
            return None

    report.gpu = attempt("gpu", gpu_info) or GpuInfo(available=False, reason=report.errors.get("gpu", ""))
    report.host = attempt("host", host_memory)
    if report.gpu.available:
        report.copies = attempt("copies", lambda: copy_bandwidth(copy_bytes)) or []
    report.optimizer = attempt("optimizer", lambda: optimizer_speed(optimizer_params))
    if report.gpu.available:
        report.optimizer_copying = attempt(
            "optimizer while copying", lambda: optimizer_speed(optimizer_params, while_copying=True)
        )
    report.disk = attempt("disk", lambda: disk_speed(disk, disk_bytes))
    if report.disk is not None and report.disk.bytes_tested:
        attempt("disk tier", lambda: _tier_speed(report.disk, disk, disk_bytes))
    report.seconds = time.perf_counter() - t0
    return report


# ---------------------------------------------------------------- between the nodes


def inter_node_bandwidth(nbytes: int = 64 * MiB, repeats: int = 3) -> dict:
    """Under ``torchrun --nnodes N`` (or srun over N nodes): the bandwidth between the nodes as zerofit's hybrid
    layout uses it ([Note: nodes hold the state whole], engine/distributed/ranks.py): each local rank's fp32 buffer of
    ``nbytes`` all-reduced with the same local rank of every other node (NCCL on GPUs, gloo otherwise), all local
    ranks at once. Returns, on every rank, {nodes, ranks_per_node, bytes, seconds (the best of ``repeats``),
    gb_per_s_per_node}: the bytes a node sends in a ring all-reduce (2 (n-1)/n x nbytes per rank, times its ranks)
    over the seconds, what ``zerofit estimate --inter-node-gbps`` takes."""
    import torch.distributed as dist

    from zerofit.engine.distributed import slurm

    slurm.adopt()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    nodes = world // local_world
    if nodes < 2:
        raise ValueError(
            f"WORLD_SIZE {world}, LOCAL_WORLD_SIZE {local_world}: launch on 2 nodes or more "
            "(torchrun --nnodes N --node-rank i ...) to measure between them"
        )
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    mine = None
    for i in range(local_world):  # every rank makes every cross-node group, in the same order
        g = dist.new_group([n * local_world + i for n in range(nodes)])
        if i == rank % local_world:
            mine = g
    buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=f"cuda:{local}" if cuda else "cpu")
    dist.all_reduce(buf, group=mine)  # warm-up (connections made)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        dist.all_reduce(buf, group=mine)
        if cuda:
            torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(dt.to(buf.device), op=dist.ReduceOp.MAX)  # the slowest rank's
        best = min(best, float(dt))
    sent = 2 * (nodes - 1) / nodes * buf.numel() * 4 * local_world
    if made:
        dist.destroy_process_group()
    return {
        "nodes": nodes,
        "ranks_per_node": local_world,
        "bytes": buf.numel() * 4,
        "seconds": best,
        "gb_per_s_per_node": sent / best / 1e9,
    }


def inter_node_text(r: dict) -> str:
    """:func:`inter_node_bandwidth`'s result as the line ``zerofit doctor --inter-node`` prints."""
    return (
        f"between {r['nodes']} nodes ({r['ranks_per_node']} ranks each): {r['gb_per_s_per_node']:.2f} GB/s per node "
        f"(all-reduce of {r['bytes'] / 2**20:.0f} MiB per rank, {r['seconds'] * 1e3:.1f} ms): zerofit estimate "
        f"--nnodes {r['nodes']} --inter-node-gbps {r['gb_per_s_per_node']:.2f}"
    )


def render(report: DoctorReport, console) -> None:
    """``zerofit doctor``'s table of ``report`` on the rich ``console``."""
    from rich.table import Table
    from rich.text import Text

    gib = lambda n: f"{n / 2**30:,.1f} GiB"  # noqa: E731
    t = Table(title=f"zerofit doctor ({report.seconds:.1f} s)", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("torch", f"{report.torch_version} (Python {report.python_version})")
    g = report.gpu
    if g.available:
        t.add_row("GPU", f"{g.name} (x{g.count}), compute capability {g.capability}")
        t.add_row("driver / CUDA", f"{g.driver_version} / CUDA runtime {g.cuda_runtime}")
        t.add_row("GPU memory", f"{gib(g.memory_free_bytes)} free of {gib(g.memory_total_bytes)}")
        for c in report.copies:
            way = "both ways at once (each)" if c.direction == "both" else c.direction
            t.add_row(
                f"{way}, {c.host_memory}",
                f"{c.gb_per_s:,.1f} GB/s ({c.bytes_per_copy >> 20} MiB copies, best of {c.repeats})",
            )
    else:
        t.add_row("GPU", Text(f"none: {g.reason}; host measurements only", style="yellow"))
    if report.optimizer:
        o = report.optimizer
        t.add_row(
            "CPU AdamW",
            f"{o.params_per_s / 1e9:,.2f} G params/s ({o.implementation}, fp32, "
            f"{o.params / 1e6:.0f} M params, {o.threads} torch threads)",
        )
    if report.optimizer_copying:
        t.add_row(
            "CPU AdamW, copies running",
            f"{report.optimizer_copying.params_per_s / 1e9:,.2f} G params/s "
            "(pinned copies both ways meanwhile, as in a training step)",
        )
    if report.host:
        h = report.host
        t.add_row("host RAM", f"{gib(h.available_bytes)} available of {gib(h.total_bytes)}, {h.cpu_cores} CPUs")
    if report.disk:
        d = report.disk
        t.add_row("disk", f"{d.path}: {gib(d.free_bytes)} free of {gib(d.total_bytes)}")
        if d.bytes_tested:
            mode = "O_DIRECT" if d.direct_io else "buffered"
            t.add_row(
                "disk speed",
                f"write {d.write_gb_per_s:,.2f} GB/s, read {d.read_gb_per_s:,.2f} GB/s "
                f"({d.bytes_tested >> 20} MiB, 1 MiB {mode})",
            )
        if d.tier_write_gb_per_s:
            t.add_row(
                "disk tier",
                f"write {d.tier_write_gb_per_s:,.2f} GB/s, read {d.tier_read_gb_per_s:,.2f} GB/s "
                "(the NVMe tier's own path: 8 requests of 4 MiB in flight)",
            )
        if d.note:
            t.add_row("", Text(d.note, style="yellow"))
    for name, err in report.errors.items():
        t.add_row(f"{name} failed", Text(err, style="red"))
    console.print(t)
