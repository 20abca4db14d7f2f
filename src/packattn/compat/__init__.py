"""Drop-in signatures of other libraries' varlen attention, on every device.

Each module reproduces one function's signature, defaults and return conventions as a thin translation onto
:func:`packattn.varlen_attention` (nothing re-implemented), so that code written against that library runs
unchanged on any PyTorch device. What packattn cannot honour raises an error naming the argument rather
than being ignored, and each module's docstring lists where its behaviour differs from the original, and why.

* :mod:`packattn.compat.flash_attn`: flash-attn 2's ``flash_attn_varlen_func``.
* :mod:`packattn.compat.sglang`: sglang's Ascend ``fused_infer_attention_varlen``, with sequences empty
  on one side supported.

The modules are imported on demand (``from packattn.compat.flash_attn import flash_attn_varlen_func``);
importing them needs neither flash-attn nor sglang.
"""
