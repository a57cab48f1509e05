"""A model's states, one definition: the actor sets them, `/v1/node` shows them, and the
`neuron_model_state` gauge has one series per state."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["MODEL_STATES", "ModelState"]

ModelState = Literal["loading", "serving", "recovering", "wedged", "unloading", "unloaded"]
MODEL_STATES: tuple[ModelState, ...] = get_args(ModelState)
