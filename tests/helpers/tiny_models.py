"""Model sizes shared by tests: small enough to train in seconds on a CPU."""

# A transformers Llama with grouped-query attention (4 heads, 2 key-value heads).
TINY_LLAMA = (
    "model.family='llama'",
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=4",
    "model.n_kv_head=2",
    "model.intermediate_size=64",
)
