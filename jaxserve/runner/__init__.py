"""Runs the model on devices: bucketed padded inputs, the AOT-compiled paged step, on-device sampling."""
