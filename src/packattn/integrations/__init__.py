"""Drop-in attention for other libraries: registration and layout conversion only.

- :mod:`packattn.integrations.transformers`: ``register()`` adds ``attn_implementation="packattn"`` to
  Hugging Face transformers (packed, padded and plain batches; causal, bidirectional, sliding-window,
  soft-capped and GQA layers).
- :mod:`packattn.integrations.diffusers`: ``PackedJointAttnProcessor`` for diffusers' joint text+image
  attention blocks, which attends each sample's real text tokens and its image tokens as one packed sequence
  instead of attending padded text.

Each submodule imports its library only when used; importing packattn never imports either library.
"""
