"""Runs the model on devices: the dense reference decoder now, the paged step later."""
