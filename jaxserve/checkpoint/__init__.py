"""Model weights: streaming HF safetensors onto devices, Orbax conversion and restore, and the built-in model."""

from jaxserve.checkpoint.builtin import BUILTIN_MODEL_DIR
from jaxserve.checkpoint.loading import LoadedModel, ModelPlan, convert_hf_to_orbax, load_model, plan_model

__all__ = ["BUILTIN_MODEL_DIR", "LoadedModel", "ModelPlan", "convert_hf_to_orbax", "load_model", "plan_model"]
