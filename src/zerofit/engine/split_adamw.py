"""AdamW in two passes over host memory: the new master weights now, the moments later.

[Note: moments after the forward]
With deferred updates (clipping, fp16) every host update waits for the global norm and then sits on the
next forward's critical path, where the host's memory bandwidth binds (docs/benchmarks.md, issue 6). torch's
fused CPU AdamW reads master, gradient and both moments and writes master, both moments and, given a
``grad_scale`` (the clipping factor), the unscaled gradient too: 16 bytes read and 16 written per parameter.
The forward needs only the new master. So the update is split in two passes:

* the **master pass** (on the critical path) reads the four and writes the master: 20 bytes of host memory;
* the **moments pass** (later, while the post pass and the backward run and the host's memory is mostly
  idle) reads moments and gradient again and writes the moments: 20 bytes.

The passes are a small C++ kernel (built at first use by ``torch.utils.cpp_extension``, cached; about a
minute; a C++ compiler is needed, else ``available()`` is False and the engine keeps torch's fused kernel).
It does the fused kernel's arithmetic in its order (ATen ``FusedAdamKernel.cpp``, ADAMW mode, as torch's
AVX2/AVX-512 builds compile its vector loop: the gradient divided by the float ``grad_scale``; ``exp_avg`` by
``lerp`` as one fused multiply-add; ``exp_avg_sq`` as ``fma((1 - beta2) * g, g, v * beta2)``; the step
``p + ((-step_size) * m) / (sqrt(v) / bc2_sqrt + eps)``; in the scalar tail, the last ``numel % width``
elements, as torch's compiler contracted it there: ``fma(v, beta2, ((1 - beta2) * g) * g)``). Master and moments
come out bitwise as the fused kernel's where that was tested (torch 2.13, AVX2, tests/test_split_updates.py; not
compared bitwise on the GPU machine's torch 2.11, AVX-512). A build that rounds differently differs in the last
bit, as torch's CPU and GPU kernels do. Both passes compute the moments the same way, so the master pass's step
uses exactly the moments the later pass writes. The gradient is left unscaled (the fused kernel writes it scaled;
nothing reads it after the update).

The moments pass must run before the moments or the gradient buffer are read or written again: the engine
waits for it before the unit's next gradient comes down ([Note: moments after the forward] in engine.py), and
every reader of the optimizer state drains the worker first.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading

import torch

log = logging.getLogger("zerofit")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

namespace {

struct Consts {
  float scale, decay, lw, coeff, beta2, c2, bc2_sqrt, eps, neg_step_size;
  bool has_scale, has_decay, small;
};

Consts consts(double lr, double beta1, double beta2, double eps, double wd, double step, double scale) {
  Consts c;
  c.has_scale = scale != 0.0;
  c.scale = (float)scale;
  c.has_decay = wd != 0.0;
  c.decay = (float)(1 - lr * wd);
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

// MODE 1: torch's vector loop on an FMA build (AVX2, AVX-512); 2: its scalar tail there, as the compiler
// contracted it; 0: a build without FMA
template <int MODE>
inline void moments(const Consts& c, float g, float& m, float& v) {
  if (MODE != 0) {
    m = std::fma(c.coeff, g - m, c.small ? m : g);
  } else {
    m = c.small ? m + c.lw * (g - m) : g - (g - m) * (1.0f - c.lw);
  }
  if (MODE == 1) {
    v = std::fma(c.c2 * g, g, v * c.beta2);
  } else if (MODE == 2) {
    v = std::fma(v, c.beta2, (c.c2 * g) * g);
  } else {
    v = v * c.beta2 + (c.c2 * g) * g;
  }
}

template <int MODE>
void master_range(const Consts& c, float* p, const float* g, const float* m, const float* v, int64_t a, int64_t b) {
  for (int64_t i = a; i < b; i++) {
    float gv = c.has_scale ? g[i] / c.scale : g[i];
    float pv = c.has_decay ? p[i] * c.decay : p[i];
    float mv = m[i], vv = v[i];
    moments<MODE>(c, gv, mv, vv);
    float denom = std::sqrt(vv) / c.bc2_sqrt + c.eps;
    p[i] = pv + (c.neg_step_size * mv) / denom;
  }
}

template <int MODE>
void moments_range(const Consts& c, const float* g, float* m, float* v, int64_t a, int64_t b) {
  for (int64_t i = a; i < b; i++) {
    float gv = c.has_scale ? g[i] / c.scale : g[i];
    float mv = m[i], vv = v[i];
    moments<MODE>(c, gv, mv, vv);
    m[i] = mv;
    v[i] = vv;
  }
}

void check(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "split AdamW: contiguous fp32 CPU tensors only");
}

}  // namespace

// ``tail``: the last elements torch's kernel updates in its scalar loop (numel % its vector width);
// ``fused``: whether torch's build uses fused multiply-adds (every vector capability but the default)
void adamw_master(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v, double lr, double beta1, double beta2,
                  double eps, double wd, double step, double scale, int64_t tail, bool fused) {
  for (auto* t : {&p, &g, &m, &v}) check(*t);
  pybind11::gil_scoped_release nogil;    // the worker thread's pass must not stop the main thread
  Consts c = consts(lr, beta1, beta2, eps, wd, step, scale);
  float* pp = p.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  int64_t n = p.numel(), body = fused ? n - tail : n;
  at::parallel_for(0, body, 1 << 14, [&](int64_t a, int64_t b) {
    if (fused) master_range<1>(c, pp, gp, mp, vp, a, b); else master_range<0>(c, pp, gp, mp, vp, a, b);
  });
  master_range<2>(c, pp, gp, mp, vp, body, n);
}

void adamw_moments(at::Tensor g, at::Tensor m, at::Tensor v, double beta1, double beta2, double scale,
                   int64_t tail, bool fused) {
  for (auto* t : {&g, &m, &v}) check(*t);
  pybind11::gil_scoped_release nogil;
  Consts c = consts(0.0, beta1, beta2, 0.0, 0.0, 1.0, scale);
  const float* gp = g.data_ptr<float>();
  float *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  int64_t n = m.numel(), body = fused ? n - tail : n;
  at::parallel_for(0, body, 1 << 14, [&](int64_t a, int64_t b) {
    if (fused) moments_range<1>(c, gp, mp, vp, a, b); else moments_range<0>(c, gp, mp, vp, a, b);
  });
  moments_range<2>(c, gp, mp, vp, body, n);
}
"""

_lock = threading.Lock()
_module = None
_error: str | None = None


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
                    name="zerofit_split_adamw", cpp_sources=[_SOURCE], functions=["adamw_master", "adamw_moments"],
                    # only the fused multiply-adds written out; an errno-free sqrt lets the loops vectorize
                    extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:     # no compiler, no headers: the fused kernel stays
                lines = str(e).strip().splitlines()
                _error = f"{type(e).__name__}: {lines[-1] if lines else ''}"
                log.warning("zerofit: the split AdamW kernel could not be built (%s); torch's fused kernel is used",
                            _error)
    return _module


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


def _scale_of(factor: float) -> float:
    """The float ``grad_scale`` torch's fused kernel is given for ``factor`` (optimizer.adamw_flat); 0: none."""
    return 0.0 if factor == 1.0 else float(torch.tensor(1.0 / factor, dtype=torch.float32))


def _layout(numel: int) -> tuple[int, bool]:
    """(the elements torch's fused kernel leaves to its scalar tail, whether its build fuses multiply-adds) for
    ``numel`` fp32 elements on this CPU: its vector width is the dispatched capability's."""
    cap = torch.backends.cpu.get_cpu_capability()
    return numel % (16 if cap.startswith("AVX512") else 8), cap != "DEFAULT"


def master_pass(master, grad, exp_avg, exp_avg_sq, step, h, factor: float = 1.0) -> None:
    """``master`` takes its AdamW step (``step`` is incremented, as the fused kernel's caller does); the
    moments and the gradient are left as they were. ``h``: an optimizer.Hyper."""
    step.add_(1)
    _load().adamw_master(master, grad, exp_avg, exp_avg_sq, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay,
                         float(step), _scale_of(factor), *_layout(master.numel()))


def moments_pass(grad, exp_avg, exp_avg_sq, h, factor: float = 1.0) -> None:
    """The moments of the same step: the same gradient, moments and factor as its master pass."""
    _load().adamw_moments(grad, exp_avg, exp_avg_sq, h.beta1, h.beta2, _scale_of(factor),
                          *_layout(exp_avg.numel()))

