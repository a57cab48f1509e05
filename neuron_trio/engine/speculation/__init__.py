"""Speculative decoding: proposals from the prompt or a draft model, verified."""
