"""AdamW in two passes over host memory: the new master weights now, the moments later.

[Note: moments after the forward]
With deferred updates (clipping, fp16) every host update waits for the global norm and then sits on the
next forward's critical path, where the host's memory bandwidth binds (docs/benchmarks.md, the clipped step's host
updates). torch's
fused CPU AdamW reads master, gradient and both moments and writes master, both moments and, given a
``grad_scale`` (the clipping factor), the unscaled gradient too: 16 bytes read and 16 written per parameter.
The forward needs only the new master. So the update is split in two passes:

* the **master pass** (on the critical path) reads the four and writes the master: 20 bytes of host memory;
* the **moments pass** (later, while the post pass and the backward run and the host's memory is mostly
  idle) reads moments and gradient again and writes the moments: 20 bytes.

The passes are a small C++ kernel (built at first use by ``torch.utils.cpp_extension``, cached; about a
minute; a C++ compiler is needed, else ``available()`` is False and the engine keeps torch's fused kernel).
It does the fused kernel's arithmetic in its order (ATen ``FusedAdamKernel.cpp``, ADAMW mode: the gradient
divided by the float ``grad_scale``; ``exp_avg`` by ``lerp``; ``exp_avg_sq``; the step
``p + ((-step_size) * m) / (sqrt(v) / bc2_sqrt + eps)``), rounding as this process's torch build rounds: found
at load ([Note: the fused kernel's rounding]). Master and moments come out bitwise as the fused kernel's
(tests/unit/test_split_updates.py, passed on torch 2.13/AVX2 here and torch 2.11/AVX-512 on the GPU machine). Both
passes compute the moments the same way, so the master pass's step uses exactly the moments the later pass
writes. The gradient is left unscaled (the fused kernel writes it scaled;
nothing reads it after the update).

The moments pass must run before the moments or the gradient buffer are read or written again: the engine
waits for it before the unit's next gradient comes down (HostUpdates.await_moments, update/host.py), and
every reader of the optimizer state drains the worker first.

[Note: the master behind its cast]
A bf16 model's forward does not read the fp32 master: it reads the weights cast to bf16. So when a streamed
block has a bf16 host copy (``Unit.host16``; the engine makes them for split updates on a GPU), its
first pass writes only that cast (2 bytes, not the master's 4) and the second pass, the **rest pass**, writes
the master with the moments (28 bytes, off the critical path). On the forward's path per parameter: 16 bytes
read, 2 written by the CPU, 2 read by the upload, against 20 and 4 (the fp32 upload, cast on the device); the
upload itself takes half the time. The cast rounds as torch and the GPU round (to nearest, ties to even), so
the device gets the bits it would have cast itself (fp16 keeps the master pass and the fp32 uploads: GCC 12 does
not vectorize its conversion written portably); the rest pass recomputes the same new master from the same
inputs. Between the passes the master is stale (``Unit.master_behind``): its 16-bit copy is valid (labelled
for the step, [Note: 16-bit copies after the update]), and a read of the master itself (an fp32 upload once the
copies went stale, a checkpoint, the next update) waits for the rest pass or drains the worker.

[Note: dynamic chunks]
The passes split the elements into chunks that the threads take in turn, not into one equal range per thread:
the worker shares the cores with the main thread, which launches the GPU's work, and one thread of a static
split that the scheduler pauses holds the whole pass back. Elementwise, so any split gives the same bits. (Not
measured on its own: it came with the loops' vectorization, and the two together made the master pass faster on
the GPU host; docs/benchmarks.md, the clipped step's host updates.)
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from zerofit.engine.update.adamw import adamw_flat
from zerofit.optim.hyper import Hyper

log = logging.getLogger("zerofit")

_SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <cstring>

namespace {

struct Consts {
  float scale, decay, lw, coeff, beta2, c2, bc2_sqrt, eps, neg_step_size;
  bool small;
};

Consts consts(double lr, double beta1, double beta2, double eps, double wd, double step, double scale) {
  Consts c;
  // without a scale or a decay, torch's kernel skips the division or the product: by 1 they give the same bits
  // (exact in IEEE arithmetic), and the loop has no branch that would keep it from vectorizing
  c.scale = scale != 0.0 ? (float)scale : 1.0f;
  c.decay = wd != 0.0 ? (float)(1 - lr * wd) : 1.0f;
  c.lw = (float)(1 - beta1);
  c.small = std::fabs(c.lw) < 0.5f;
  c.coeff = c.small ? c.lw : c.lw - 1.0f;
  c.beta2 = (float)beta2;
  c.c2 = (float)(1 - beta2);
  double bc1 = 1 - std::pow(beta1, step), bc2 = 1 - std::pow(beta2, step);
  c.bc2_sqrt = (float)std::sqrt(bc2);
  c.eps = (float)eps;
  c.neg_step_size = (float)(-(lr / bc1));
  return c;
}

// [Note: the fused kernel's rounding] (split_adamw.py): MODE / 3 says whether ``exp_avg``'s lerp is one fused
// multiply-add, MODE % 3 how ``exp_avg_sq`` is: 0 none, 1 fma((1 - beta2) * g, g, v * beta2) (torch's vector
// loops on AVX2 and AVX-512), 2 fma(v, beta2, ((1 - beta2) * g) * g) (its scalar tail, as GCC contracted it)
template <int MODE>
inline void moments(const Consts& c, float g, float& m, float& v) {
  if (MODE / 3 == 1) {
    m = std::fma(c.coeff, g - m, c.small ? m : g);
  } else {
    m = c.small ? m + c.lw * (g - m) : g - (g - m) * (1.0f - c.lw);
  }
  if (MODE % 3 == 1) {
    v = std::fma(c.c2 * g, g, v * c.beta2);
  } else if (MODE % 3 == 2) {
    v = std::fma(v, c.beta2, (c.c2 * g) * g);
  } else {
    v = v * c.beta2 + (c.c2 * g) * g;
  }
}

// fp32 -> bfloat16, rounded to nearest even as c10::BFloat16 and the GPU round; a NaN stays a NaN (its bits, as
// between torch's own kernels, may differ). Integer arithmetic only, so that the loop vectorizes (GCC 12 leaves
// the loop scalar for a select or a comparison here)
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (uint32_t)((0x7F800000 - (int32_t)(u & 0x7FFFFFFFu)) >> 31);   // all ones for a NaN
  return (uint16_t)(r | (nan & 0x7FC0u));
}

// One pass over [a, b): the moments of the step always; what it writes: W_P the new master, W_MV the moments,
// OUT the new master cast to bfloat16 into ``o``
template <int MODE, bool W_P, bool W_MV, bool OUT>
void pass_range(const Consts& c, float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                float* __restrict__ v, uint16_t* __restrict__ o, int64_t a, int64_t b) {
  const Consts k = c;     // in registers: nothing the loop stores can change them
  for (int64_t i = a; i < b; i++) {
    const float gv = g[i] / k.scale;
    float mv = m[i], vv = v[i];
    moments<MODE>(k, gv, mv, vv);
    if (W_MV) {
      m[i] = mv;
      v[i] = vv;
    }
    if (W_P || OUT) {
      float pv = p[i] * k.decay;
      const float denom = std::sqrt(vv) / k.bc2_sqrt + k.eps;
      pv = pv + (k.neg_step_size * mv) / denom;
      if (W_P) p[i] = pv;
      if (OUT) o[i] = to_bf16(pv);
    }
  }
}

template <bool W_P, bool W_MV, bool OUT>
void range_in(int mode, const Consts& c, float* p, const float* g, float* m, float* v, uint16_t* o, int64_t a,
              int64_t b) {
  switch (mode) {
    case 0: pass_range<0, W_P, W_MV, OUT>(c, p, g, m, v, o, a, b); break;
    case 1: pass_range<1, W_P, W_MV, OUT>(c, p, g, m, v, o, a, b); break;
    case 2: pass_range<2, W_P, W_MV, OUT>(c, p, g, m, v, o, a, b); break;
    case 3: pass_range<3, W_P, W_MV, OUT>(c, p, g, m, v, o, a, b); break;
    case 4: pass_range<4, W_P, W_MV, OUT>(c, p, g, m, v, o, a, b); break;
    default: pass_range<5, W_P, W_MV, OUT>(c, p, g, m, v, o, a, b); break;
  }
}

// [Note: dynamic chunks] (split_adamw.py); the last ``tail`` elements in ``tail_mode``, the others in
// ``body_mode`` ([Note: the fused kernel's rounding])
template <bool W_P, bool W_MV, bool OUT>
void run(const Consts& c, float* p, const float* g, float* m, float* v, uint16_t* o, int64_t n, int64_t tail,
         int64_t body_mode, int64_t tail_mode, int64_t threads) {
  const int64_t body = n - tail, chunk = 1 << 16;
  const int64_t chunks = (body + chunk - 1) / chunk;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, chunks));
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
  for (int64_t k = 0; k < chunks; k++) {
    int64_t a = k * chunk, b = std::min(body, a + chunk);
    range_in<W_P, W_MV, OUT>((int)body_mode, c, p, g, m, v, o, a, b);
  }
  range_in<W_P, W_MV, OUT>((int)tail_mode, c, p, g, m, v, o, body, n);
}

void check(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "split AdamW: contiguous fp32 CPU tensors only");
}

}  // namespace

// ``tail``: the last elements torch's kernel updates in its scalar loop (numel % its vector width);
// ``body_mode``, ``tail_mode``: how its vector loop and its tail round ([Note: the fused kernel's rounding]);
// ``out``: an empty tensor, or a bfloat16 one the new master is cast into (then the master itself is not
// written: ``adamw_rest`` writes it later)
void adamw_master(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v, at::Tensor out, double lr, double beta1,
                  double beta2, double eps, double wd, double step, double scale, int64_t tail, int64_t body_mode,
                  int64_t tail_mode, int64_t threads) {
  for (auto* t : {&p, &g, &m, &v}) check(*t);
  const bool cast = out.numel() > 0;
  TORCH_CHECK(!cast || (out.is_contiguous() && out.numel() == p.numel() && out.scalar_type() == at::kBFloat16),
              "split AdamW: the cast's output must be a contiguous bfloat16 tensor of the master's size");
  pybind11::gil_scoped_release nogil;    // the worker thread's pass must not stop the main thread
  Consts c = consts(lr, beta1, beta2, eps, wd, step, scale);
  float *pp = p.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  uint16_t* op = cast ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
  if (cast) run<false, false, true>(c, pp, gp, mp, vp, op, p.numel(), tail, body_mode, tail_mode, threads);
  else run<true, false, false>(c, pp, gp, mp, vp, op, p.numel(), tail, body_mode, tail_mode, threads);
}

// the moments of the step (``with_master``: and the new master, after a master pass that wrote only its cast)
void adamw_rest(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v, bool with_master, double lr, double beta1,
                double beta2, double eps, double wd, double step, double scale, int64_t tail, int64_t body_mode,
                int64_t tail_mode, int64_t threads) {
  for (auto* t : {&p, &g, &m, &v}) check(*t);
  pybind11::gil_scoped_release nogil;
  Consts c = consts(lr, beta1, beta2, eps, wd, step, scale);
  float *pp = p.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  if (with_master) run<true, true, false>(c, pp, gp, mp, vp, nullptr, m.numel(), tail, body_mode, tail_mode, threads);
  else run<false, true, false>(c, pp, gp, mp, vp, nullptr, m.numel(), tail, body_mode, tail_mode, threads);
}
"""

_lock = threading.Lock()
_module = None
_error: str | None = None
_modes: tuple[int, int] = (4, 5)  # (body, tail): [Note: the fused kernel's rounding], set by _calibrate
_tail_width = 8  # the fused kernel's vector width: its tail is numel % this (_calibrate)


def _load():
    """The built extension, or None (the reason in ``_error``) where it cannot be built."""
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            try:
                from torch.utils.cpp_extension import load_inline

                _ninja_on_path()

                log.info("zerofit: loading the split AdamW kernel (built at its first use here: about a minute)")
                _module = load_inline(
                    name="zerofit_split_adamw",
                    cpp_sources=[_SOURCE],
                    functions=["adamw_master", "adamw_rest"],
                    # only the fused multiply-adds written out; an errno-free sqrt lets the loops vectorize
                    extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
                _calibrate(_module)
            except Exception as e:  # no compiler, no headers, no way to round as torch: the fused kernel stays
                lines = str(e).strip().splitlines()
                _error = f"{type(e).__name__}: {lines[-1] if lines else ''}"
                log.warning("zerofit: the split AdamW kernel is not used (%s); torch's fused kernel is", _error)
    return _module


def _calibrate(module) -> None:
    """[Note: the fused kernel's rounding]
    torch's fused CPU AdamW is written once (ATen ``FusedAdamKernel.cpp``) but compiled per capability and per
    build, and the compiler decides which products it fuses with additions: on torch 2.13's AVX2 build the
    vector loop fuses ``exp_avg_sq``'s update one way and the scalar tail (the last ``numel % width`` elements)
    another; on the GPU machine's torch 2.11 AVX-512 build the tail rounds the same way but is ``numel % 8``,
    not ``% 16`` (found there: assuming 16, the passes differed in the last bit of ``exp_avg_sq`` on n = 1000;
    ``bench/probes/split_probe.py --rounding``). So the passes do not assume an order or a width: at load they
    try each way of rounding the moments (with and without the fused multiply-adds), body and tail, and each
    vector width the tail may follow (the dispatched capability's first), against the fused kernel of this
    process on vectors with long tails, a clipping factor and weight decay, and keep the first that gives every
    master, moment and step bitwise. If none does, the kernel is not used (torch's fused kernel is, with a
    notice)."""
    global _modes, _tail_width
    cases = _calibration_cases()
    order = (4, 5, 0, 1, 2, 3)  # torch 2.13's AVX2 build first; a build without fused multiply-adds next
    for width in dict.fromkeys((_capability_width(), 8, 16, 32)):
        for body in order:
            for tail in order:
                if _matches(module, cases, body, tail, width):
                    _modes, _tail_width = (body, tail), width
                    return
    raise RuntimeError("no order of the passes' arithmetic rounds as torch's fused AdamW does in this build")


def _capability_width() -> int:
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def _calibration_cases() -> list[tuple]:
    """((master, grad, exp_avg, exp_avg_sq), Hyper, factor, the fused kernel's results) on vectors whose tails
    are long and tell vector widths of 8, 16 and 32 apart, with and without a factor and weight decay."""
    gen = torch.Generator().manual_seed(1234)
    cases = []
    # n % (8, 16, 32): 1039 (7, 15, 15), 1000 (0, 8, 8), 1048 (0, 8, 24), 4109 (5, 13, 13), 657 (1, 1, 17)
    for n, factor, wd in (
        (1039, 0.127, 0.01),
        (1000, 1.0, 0.0),
        (1048, 0.31, 0.0),
        (4109, 0.31, 0.1),
        (657, 1.0, 0.01),
    ):
        p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
        h = Hyper(1e-3, 0.9, 0.999, 1e-8, wd)
        want = [t.clone() for t in (p, g, m, v)] + [torch.tensor(4.0)]
        adamw_flat(want[0], want[1], want[2], want[3], want[4], h, factor)
        cases.append(((p, g, m, v), h, factor, want))
    return cases


def _matches(module, cases, body: int, tail: int, width: int) -> bool:
    """Whether the two passes in these modes, the tail ``numel % width``, give each case's fused results
    bitwise."""
    for (p, g, m, v), h, factor, want in cases:
        got = [t.clone() for t in (p, g, m, v)]
        args = (
            h.lr,
            h.beta1,
            h.beta2,
            h.eps,
            h.weight_decay,
            float(want[4]),
            _scale_of(factor),
            p.numel() % width,
            body,
            tail,
            1,
        )
        module.adamw_master(*got, _EMPTY, *args)
        module.adamw_rest(*got, False, *args)
        if not all(torch.equal(a, b) for a, b in zip((got[0], got[2], got[3]), (want[0], want[2], want[3]))):
            return False
    return True


def _ninja_on_path() -> None:
    """torch's build runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency) installs it in the virtual
    environment, whose bin folder is on PATH only when the environment is activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def available() -> bool:
    """Whether the kernel is built (building it now if it was not tried yet)."""
    return _load() is not None


def why_unavailable() -> str | None:
    return _error


def will_build() -> bool:
    """Whether its first use in this process compiles the kernel (about a minute): not loaded yet, and no
    earlier build in torch's extensions folder (``TORCH_EXTENSIONS_DIR``). A CLI says so before it waits."""
    if _module is not None or _error is not None:
        return False
    from torch.utils.cpp_extension import _get_build_directory

    try:
        folder = _get_build_directory("zerofit_split_adamw", False)
    except Exception:  # noqa: BLE001 - no folder to look in: torch's build would make one
        return True
    return not any(Path(folder).glob("zerofit_split_adamw*.so"))


def _scale_of(factor: float) -> float:
    """The float ``grad_scale`` torch's fused kernel is given for ``factor`` (adamw.adamw_flat); 0: none."""
    return 0.0 if factor == 1.0 else float(torch.tensor(1.0 / factor, dtype=torch.float32))


def _layout(numel: int) -> tuple[int, int, int]:
    """(the elements torch's fused kernel leaves to its scalar tail, how its vector loop rounds, how its tail
    rounds) for ``numel`` fp32 elements in this process: [Note: the fused kernel's rounding]."""
    return numel % _tail_width, *_modes


_EMPTY = torch.empty(0)


def _threads() -> int:
    return torch.get_num_threads()


def master_pass(master, grad, exp_avg, exp_avg_sq, step, h, factor: float = 1.0, out16=None) -> None:
    """``master`` takes its AdamW step (``step`` is incremented, as the fused kernel's caller does); the
    moments and the gradient are left as they were. ``h``: an optim.hyper.Hyper. With ``out16`` (a bfloat16
    tensor of the master's size) the new master is written there, cast, and not into ``master``:
    [Note: the master behind its cast]; ``rest_pass(..., with_master=True)`` writes it."""
    step.add_(1)
    _load().adamw_master(
        master,
        grad,
        exp_avg,
        exp_avg_sq,
        _EMPTY if out16 is None else out16,
        h.lr,
        h.beta1,
        h.beta2,
        h.eps,
        h.weight_decay,
        float(step),
        _scale_of(factor),
        *_layout(master.numel()),
        _threads(),
    )


def rest_threads(configured: int | None = None) -> int:
    """[Note: threads for the rest pass]
    The second pass runs while the post pass and the backward do, off the critical path and bound by host
    memory, while the main thread launches the GPU's kernels: it leaves a quarter of the threads free for that.
    (With clipping on the 3B model, 8, 12 and 16 threads ran within the runs' noise of a few percent of each
    other (docs/benchmarks.md, the CPU optimizer's threads), so a choice for the main thread's sake, not a
    measured gain.)
    ``configured``: offload.rest_pass_threads."""
    return configured or max(1, _threads() - _threads() // 4)


def rest_pass(
    master,
    grad,
    exp_avg,
    exp_avg_sq,
    step,
    h,
    factor: float = 1.0,
    with_master: bool = False,
    threads: int | None = None,
) -> None:
    """The rest of the step whose master pass ran: the same gradient, moments, factor and (already counted)
    ``step``. Writes the moments, and with ``with_master`` the new master too (its master pass wrote only the
    cast). ``threads``: default all of torch's intra-op threads."""
    _load().adamw_rest(
        master,
        grad,
        exp_avg,
        exp_avg_sq,
        with_master,
        h.lr,
        h.beta1,
        h.beta2,
        h.eps,
        h.weight_decay,
        float(step),
        _scale_of(factor),
        *_layout(exp_avg.numel()),
        threads or _threads(),
    )
