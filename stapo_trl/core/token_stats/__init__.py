"""Where the per-token log p and entropy that the token rules read come from: `statistics.TokenStatistics` (which pass
supplies them in a run), the backends that compute them without ``[N, V]`` logits (`backends`: TRL's fused head, the
blocked torch op of `torch_backend`, Liger's kernel in `liger_backend`), and their recording while `generate()` samples
(`generation`)."""
