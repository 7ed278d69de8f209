"""fusegen's generated ops inside other libraries' models. Each integration is its own
module, imported only when used: importing fusegen imports none of them, nor the libraries
they serve.

- huggingface: `patch(model)` swaps generated ops into a built transformers model (LLaMA,
  Mistral, Qwen2, Qwen3, GPT-2) and `Patch.undo()` puts the model back.
- hub_layers: the ops as layers of Hugging Face's `kernels` (`fusegen kernels-repo`,
  `kernel_mapping(folder)` for `use_kernel_mapping` + `kernelize`).
"""
