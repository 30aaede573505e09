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
        self.euler = FlowMatchEuler()
        self.times = self.euler.timesteps(num_steps).tolist()
        self.num_steps = num_steps

    def model_time(self, step: int) -> float:
        return self.times[step]

    def scale_input(self, step: int, x: torch.Tensor) -> torch.Tensor:
        return x

    def step(self, key: Hashable, step: int, x: torch.Tensor, model_out: torch.Tensor) -> torch.Tensor:
        return self.euler.step(x, model_out, self.times[step], self.times[step + 1])


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
        self.scalers: dict[int, Any] = {}  # step -> a throwaway copy for scale_model_input

    def _state(self, key: Hashable) -> Any:
        if key not in self.states:
            self.states[key] = copy.deepcopy(self.pristine)
        return self.states[key]

    def model_time(self, step: int) -> torch.Tensor:
        return self.timesteps[step]

    def scale_input(self, step: int, x: torch.Tensor) -> torch.Tensor:
        # Schedulers that scale (Euler) find their sigma from the timestep when they have no
        # step counter yet, and scaling never advances it: one throwaway copy per step serves
        # every slice, and no slice's state is needed or disturbed.
        if not hasattr(self.pristine, "scale_model_input"):  # flow-matching schedulers do not scale
            return x
        if step not in self.scalers:
            self.scalers = {step: copy.deepcopy(self.pristine)}  # earlier steps are done with
        return self.scalers[step].scale_model_input(x, self.timesteps[step])

    def step(self, key: Hashable, step: int, x: torch.Tensor, model_out: torch.Tensor) -> torch.Tensor:
        # A copy: some schedulers keep the sample they are given for the next step (UniPC's
        # corrector reads ``last_sample``), and PipeFusion then writes the result into the
        # very rows ``x`` views.
        return self._state(key).step(model_out, self.timesteps[step], x.clone(), return_dict=False)[0]
