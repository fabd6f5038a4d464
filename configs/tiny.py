# A ~2M-parameter MoE that learns small-number arithmetic on a laptop CPU in minutes.
out_dir = "out/tiny"
model = dict(vocab_size=336, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
             num_experts=8, top_k=2, moe_inter_dim=128, max_seq_len=256)
