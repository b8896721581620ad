"""Run a ported DeepSpeedExamples script as ``python script.py ...`` would, and record what its engine saw.

    python record.py OUT_DIR script.py ARGS...                 # the script runs as __main__, as python runs it
    python record.py OUT_DIR --launcher [LAUNCHER ARGS] script.py ARGS...   # through `zerofit deepspeed`

The script itself carries the one change (``import zerofit.deepspeed.alias`` as its first line, written by the
test) or none (``--launcher``, whose code is ``zerofit deepspeed``'s own: zerofit.deepspeed.launcher.main). This
wrapper changes nothing in it: it only watches zerofit's engine from outside, so that the test can compare the
training with plain PyTorch: the model's state when ``initialize`` was called, the engine's weights after it, after a ``load_checkpoint`` and at the end (``OUT_DIR/initial.pt``), every
training call of the engine (its inputs, ``OUT_DIR/calls.pt``) and every loss given to ``engine.backward``
(``OUT_DIR/losses.json``), written also when the script fails. It imports zerofit's engine, never ``deepspeed``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import torch


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(v) for v in x)
    return x


def main(argv: list[str]) -> int:
    out, rest = argv[0], argv[1:]
    os.makedirs(out, exist_ok=True)
    import zerofit.deepspeed as zds
    from zerofit.engine.faces.deepspeed_surface import DeepSpeedFace
    from zerofit.engine.engine import Engine

    losses, calls, initial, engines = [], [], {}, []
    backward, call, initialize = DeepSpeedFace.backward, DeepSpeedFace.__call__, zds.initialize
    load = Engine.load_checkpoint

    def rec_load(self, *a, **k):
        out = load(self, *a, **k)
        initial["loaded"] = self.master_state_dict()
        return out

    def rec_backward(self, loss, *a, **k):
        losses.append(float(loss.detach().float()))
        return backward(self, loss, *a, **k)

    def rec_call(self, *inputs, **batch):
        if torch.is_grad_enabled():
            calls.append((_cpu(inputs), _cpu(batch)))
        return call(self, *inputs, **batch)

    def rec_initialize(*a, **k):
        model = k.get("model", a[1] if len(a) > 1 else None)
        first = not initial
        if model is not None and first:
            state = model.state_dict()
            if not any(t.is_meta for t in state.values()):  # a model built under zero.Init has no weights yet
                initial["model"] = {n: _cpu(t) for n, t in state.items()}
        out = initialize(*a, **k)
        engines.append(out[0])
        if first:  # the weights training starts from (a zero.Init model's too), by parameter name
            initial["start"] = out[0].master_state_dict()
        return out

    DeepSpeedFace.backward, DeepSpeedFace.__call__, zds.initialize = rec_backward, rec_call, rec_initialize
    Engine.load_checkpoint = rec_load
    try:
        if rest and rest[0] == "--launcher":
            from zerofit.deepspeed.launcher import main as launch

            return launch(rest[1:])
        script = os.path.abspath(rest[0])
        sys.argv = [rest[0], *rest[1:]]
        sys.path[0] = os.path.dirname(script)  # as `python script.py`
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return 0
    finally:
        if engines:  # the last engine's weights at the end (readable after close too)
            e = engines[-1]
            initial["final"] = {n: _cpu(p) for n, p in e.module.named_parameters()}
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(losses, f)
        torch.save(initial, os.path.join(out, "initial.pt"))
        torch.save(calls, os.path.join(out, "calls.pt"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
