"""The engines' internals, off a first read and off by default: continuous batching over a paged KV cache
(`batching`; the cache itself is paged_kv.py's, beside config.py, which checks the pool's size), its decode step in
a CUDA graph (`graph_decode`), expert-parallel decode without host
syncs (`ep_decode`), and one SGLang server over HTTP (`sglang_server`). rollout.py (the native engine) and
sglang_engine.py (the SGLang adapter) use them."""
