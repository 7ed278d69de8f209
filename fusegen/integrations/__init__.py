"""fusegen's generated ops inside other libraries' models.

- huggingface: `patch(model)` swaps generated ops into a built transformers model (LLaMA,
  Mistral, Qwen2, Qwen3, GPT-2) and `Patch.undo()` puts the model back.

Nothing here is imported by `import fusegen`; each integration imports its library only
when it is used.
"""
