"""Model definitions as pure functions over named parameter pytrees, and the registry of model
families the training loop looks them up in (:mod:`functional_pp.models.family`); the decoder
of :mod:`functional_pp.models.llama` is registered here as ``"llama"``: Llama and the Hugging
Face families that are its configurations (Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, the
mixtures of experts, SmolLM3, Granite, OLMo 2/3, Cohere, Phi-1/2, GPT-NeoX; ``Config.model_type``,
docs/models.md)."""
from functional_pp.models import llama, llama_hf
from functional_pp.models.family import ModelFamily, UnknownFamilyError, family_names, get_family, register, unregister

__all__ = ["llama", "llama_hf", "ModelFamily", "UnknownFamilyError", "register", "unregister",
           "get_family", "family_names", "LLAMA"]

LLAMA = register(ModelFamily(
    name="llama", config_class=llama.Config, presets=llama.Config.presets(), param_decls=llama.init,
    loss=llama.loss, flops_per_token=llama.flops_per_token, default_rules=llama.default_rules,
    activations=llama.activations,
    summary_fields=("model_type", "layers", "hidden", "heads", "kv_heads", "mlp", "vocab"),
    hf_config_from_dict=llama_hf.config_from_hf_dict, pipeline_ends=llama.pipeline_ends,
    forward=llama.forward, serial_under_cp=llama.serial_under_cp,
    uncached_layers=llama.uncached_layers, layer_states=llama.layer_states, prefix_refusal=llama.prefix_refusal))
