"""A training run's resumable state (``sluice train model --stop-after`` / ``--resume``).

``DIR/state`` holds the model's tensors (buffers too) and AdamW's moments as safetensors and
the rest as JSON (no pickle), with the identity of the run that wrote it (settings, model
overrides, training data digest, device kind); a resume under another identity is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.train.model import TrainModel

STATE_DIR = "state"


def open_curve(path: Path, steps_done: int) -> Any:
    """The loss curve, keeping the lines of the first ``steps_done`` steps (and their validation points)."""
    if steps_done == 0:
        return path.open("w", encoding="utf-8")
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if json.loads(line)["step"] > steps_done:
            break
        kept.append(line + "\n")
    path.write_text("".join(kept), encoding="utf-8")
    return path.open("a", encoding="utf-8")


def save_state(
    out_dir: Path,
    model: TrainModel,
    opt: torch.optim.Optimizer,
    identity: dict[str, Any],
    step: int,
    seconds: float,
) -> None:
    """Model tensors (buffers too) and AdamW's moments as safetensors, the rest as JSON: no pickle."""
    from safetensors.torch import save_file

    state = out_dir / STATE_DIR
    state.mkdir(exist_ok=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
        str(state / "model.safetensors"),
    )
    moments: dict[str, torch.Tensor] = {}
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        for key, value in opt.state.get(p, {}).items():
            moments[f"{i}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    save_file(moments, str(state / "optimizer.safetensors"))
    info = {"step": step, "seconds": seconds, "identity": identity}
    (state / "state.json").write_text(json.dumps(info, indent=1) + "\n")


def load_state(
    out_dir: Path, model: TrainModel, opt: torch.optim.Optimizer, identity: dict[str, Any]
) -> tuple[int, float]:
    """Restore what ``save_state`` wrote; returns (steps done, training seconds so far)."""
    from safetensors.torch import load_file

    state = out_dir / STATE_DIR
    if not (state / "state.json").is_file():
        raise ValueError(f"nothing to resume: {state / 'state.json'} does not exist")
    info = json.loads((state / "state.json").read_text())
    if info["identity"] != identity:
        raise ValueError(f"{state} was saved by a run with other settings, data or device; start afresh")
    dev = next(model.parameters()).device
    model.load_state_dict({k: v.to(dev) for k, v in load_file(str(state / "model.safetensors")).items()})
    moments = load_file(str(state / "optimizer.safetensors"))
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        entry = {k.split(".", 1)[1]: v for k, v in moments.items() if k.split(".", 1)[0] == str(i)}
        if entry:
            opt.state[p] = {k: (v if k == "step" else v.to(dev)) for k, v in entry.items()}
    return int(info["step"]), float(info["seconds"])
