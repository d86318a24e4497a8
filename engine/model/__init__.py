"""How the model is loaded and computed, beneath the engine's scheduling: converting and
loading the weights (``loader``), serving GGUF blocks or int8 as stored (``gguf``, ``weights``,
``quant``: the block linear), the fused decode step (``fused_decode``), batch-invariant
numerics (``batch_invariant``) and CUDA graphs of the decode step (``cuda_graphs``)."""
