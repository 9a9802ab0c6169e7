"""The native Qwen3-MoE model: config, layers, loader. Runs flattened token batches over a paged KV cache.

Shape suffix legend used throughout: T tokens in a step, B sequences, D hidden size, H query heads,
G key/value heads, C head dim, E experts, I expert intermediate size, V vocabulary, L context length.
"""
