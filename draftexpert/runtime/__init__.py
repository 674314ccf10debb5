"""The expert-offload runtime: the lean MoE forward (`model`), where routed experts live and how they
move (`experts`, `gguf_experts`), what every forward moved (`ledger`), checkpoints (`loader`,
`checkpoint`) and the parameter arithmetic of Fig. 1a (`params`). Imports nothing else of the library."""
