"""Scheduler steps on slices of the latent.

Parallel samplers update the latent a slice at a time (a rank's band, a PipeFusion
patch). Every common diffusion scheduler is elementwise in the latent, so a step on a
slice equals the slice of the step on the whole, provided any state the scheduler keeps
(a multistep solver's past model outputs, a step counter) is the slice's own. A stepper
therefore keeps one scheduler state per slice key.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable
from typing import Any

import torch

from tessera.diffusion.sampler import FlowMatchEuler


class FlowStepper:
    """Tessera's flow-matching Euler (stateless); the model takes t in [0, 1]."""

    def __init__(self, num_steps: int):
        self.times = FlowMatchEuler().timesteps(num_steps).tolist()
        self.num_steps = num_steps

    def model_time(self, step: int) -> float:
        return self.times[step]

    def scale_input(self, step: int, x: torch.Tensor) -> torch.Tensor:
        return x

    def step(self, key: Hashable, step: int, x: torch.Tensor, model_out: torch.Tensor) -> torch.Tensor:
        return FlowMatchEuler().step(x, model_out, self.times[step], self.times[step + 1])

    def split(
        self, key: Hashable, parts: dict[Hashable, tuple[int, int]], row_scale: int, height: int
    ) -> None:
        pass


class DiffusersStepper:
    """A diffusers scheduler (after ``set_timesteps``), one deep copy per slice key."""

    def __init__(
        self, scheduler: Any, num_steps: int, device: torch.device | str = "cpu", **timestep_kwargs: Any
    ):
        """``timestep_kwargs`` go to ``set_timesteps`` (e.g. Flux's ``sigmas`` and ``mu``)."""
        scheduler.set_timesteps(num_steps, device=device, **timestep_kwargs)
        self.pristine = copy.deepcopy(scheduler)
        self.timesteps = scheduler.timesteps
        self.num_steps = len(self.timesteps)
        self.states: dict[Hashable, Any] = {}

    def _state(self, key: Hashable) -> Any:
        if key not in self.states:
            self.states[key] = copy.deepcopy(self.pristine)
        return self.states[key]

    def model_time(self, step: int) -> torch.Tensor:
        return self.timesteps[step]

    def scale_input(self, step: int, x: torch.Tensor) -> torch.Tensor:
        # A throwaway copy: schedulers that scale (Euler) find their sigma from the timestep
        # when they have no step counter yet, so no slice's state is needed or disturbed.
        if not hasattr(self.pristine, "scale_model_input"):  # flow-matching schedulers do not scale
            return x
        return copy.deepcopy(self.pristine).scale_model_input(x, self.timesteps[step])

    def step(self, key: Hashable, step: int, x: torch.Tensor, model_out: torch.Tensor) -> torch.Tensor:
        return self._state(key).step(model_out, self.timesteps[step], x, return_dict=False)[0]

    def split(
        self, key: Hashable, parts: dict[Hashable, tuple[int, int]], row_scale: int, height: int
    ) -> None:
        """Give each new slice key a copy of ``key``'s state with every latent-shaped tensor
        in it (4-D, ``height`` rows) cut to the slice's rows [start*row_scale, stop*row_scale):
        PipeFusion's switch from the full latent after warm-up to patches."""
        whole = self.states.pop(key, None) or copy.deepcopy(self.pristine)
        for part, (start, stop) in parts.items():
            state = copy.deepcopy(whole)
            for name, value in vars(state).items():
                setattr(state, name, _cut(value, start * row_scale, stop * row_scale, height))
            self.states[part] = state


def _cut(value: Any, start: int, stop: int, height: int) -> Any:
    if torch.is_tensor(value) and value.dim() == 4 and value.shape[2] == height:
        return value[:, :, start:stop].clone()
    if isinstance(value, list | tuple):
        return type(value)(_cut(v, start, stop, height) for v in value)
    return value
