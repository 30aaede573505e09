"""Dynamic loss scaling for fp16 training, with ``torch.amp.GradScaler``'s semantics and
its own kernels, over gradients that live in ZeRO shards on many ranks.

GradScaler scales the loss, then unscales each gradient (multiplying by the reciprocal of
the scale, taken in fp64) while checking for inf/NaN, skips the optimizer step if any was
found, and updates the scale: times ``backoff_factor`` after an overflow, times
``growth_factor`` after ``growth_interval`` clean steps in a row. Here the gradients a rank
checks are its reduced shards, so the "found inf" flag is max-reduced over the data- and
tensor-parallel axes before anyone decides: every rank skips the same steps. The state
dict has GradScaler's keys, so either loads the other's.
"""

from __future__ import annotations

import torch


class LossScaler:
    def __init__(
        self,
        *,
        init_scale: float,
        growth_interval: int,
        device: torch.device,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        self.growth_factor, self.backoff_factor, self.growth_interval = (
            growth_factor,
            backoff_factor,
            growth_interval,
        )
        self.scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale.to(loss.device)

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide ``grads`` by the scale in place; returns this rank's found-inf flag (0. or 1.)."""
        inv_scale = self.scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=self.scale.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        with torch.no_grad():
            for same in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(same, found_inf, inv_scale)
        return found_inf

    def update(self, found_inf: torch.Tensor) -> None:
        """After the (possibly skipped) step, with the flag every rank agreed on."""
        if found_inf.item() > 0:
            self.skipped_steps += 1
        torch._amp_update_scale_(
            self.scale,
            self.growth_tracker,
            found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )

    def state_dict(self) -> dict:
        return {
            "scale": float(self.scale),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": int(self.growth_tracker),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale.fill_(state["scale"])
        self.growth_tracker.fill_(state["_growth_tracker"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
